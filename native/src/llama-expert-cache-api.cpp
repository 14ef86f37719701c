// Spark expert cache: the C API (llama-expert-cache-api.h) over a context's cache.
#include "llama-expert-cache-impl.h"

using namespace llama_expert_cache_impl;

//
// C API
//

int32_t llama_expert_cache_api_version(void) {
    return LLAMA_EXPERT_CACHE_API_VERSION;
}

struct llama_expert_cache_params llama_expert_cache_default_params(void) {
    llama_expert_cache_params p = {};
    p.size          = sizeof(llama_expert_cache_params);
    p.layers        = nullptr;
    p.n_layers      = 0;
    p.device_budget = 0;
    p.device_margin = (size_t) 512 << 20;
    p.trace         = false;
    p.trace_max     = (int64_t) 64 << 20;
    p.n_threads     = 1;
    p.policy_window = 16;
    p.slru_protected_num = 3;
    p.slru_protected_den = 4;
    p.n_stage       = 0;
    p.count_uncached = true;
    p.file_path     = nullptr;
    p.n_readers     = 4;
    p.host_budget   = 0;
    p.ahead         = 0;
    p.ahead_min_prob = 0;
    return p;
}

int32_t llama_expert_cache_init(llama_context * ctx, const llama_expert_cache_params * params, char * err, size_t err_len) {
    std::string msg;
    int32_t rc = LLAMA_EXPERT_CACHE_OK;
    try {
        if (!ctx || !params) {
            msg = "ctx or params is null";
            rc  = LLAMA_EXPERT_CACHE_ERR_ARG;
        } else if (params->size != sizeof(llama_expert_cache_params)) {
            msg = fmt("params.size is %zu, this library expects %zu (API version %d): rebuild the caller",
                    params->size, sizeof(llama_expert_cache_params), LLAMA_EXPERT_CACHE_API_VERSION);
            rc  = LLAMA_EXPERT_CACHE_ERR_VERSION;
        } else {
            auto ec = std::make_unique<llama_expert_cache>(ctx->get_model());
            rc = ec->init(*params, msg);
            if (rc == LLAMA_EXPERT_CACHE_OK) {
                ctx->set_expert_cache(std::move(ec));
            }
        }
    } catch (const std::exception & e) {
        msg = e.what();
        rc  = LLAMA_EXPERT_CACHE_ERR_INTERNAL;
    }
    if (rc != LLAMA_EXPERT_CACHE_OK) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, msg.c_str());
        if (err && err_len > 0) {
            snprintf(err, err_len, "%s", msg.c_str());
        }
    }
    return rc;
}

void llama_expert_cache_free(llama_context * ctx) {
    if (ctx) {
        ctx->set_expert_cache(nullptr);
    }
}

bool llama_expert_cache_enabled(const llama_context * ctx) {
    return ctx && ctx->get_expert_cache() != nullptr;
}

static llama_expert_cache_layer * layer_of(const llama_context * ctx, int32_t il, int32_t & rc) {
    llama_expert_cache * ec = ctx ? ctx->get_expert_cache() : nullptr;
    if (!ec) {
        rc = LLAMA_EXPERT_CACHE_ERR_ARG;
        return nullptr;
    }
    if (il < 0 || (size_t) il >= ec->layers.size()) {
        rc = LLAMA_EXPERT_CACHE_ERR_LAYER;
        return nullptr;
    }
    llama_expert_cache_layer * L = ec->layer(il);
    rc = L ? LLAMA_EXPERT_CACHE_OK : LLAMA_EXPERT_CACHE_ERR_NOT_MOE;
    return L;
}

int32_t llama_expert_cache_get_stats(const llama_context * ctx, int32_t il, llama_expert_cache_stats * out) {
    int32_t rc;
    llama_expert_cache_layer * L = layer_of(ctx, il, rc);
    if (!L || !out) {
        return out ? rc : LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    std::lock_guard<std::mutex> lock(L->owner->mutex);
    *out = L->stats;
    return L->owner->failed ? LLAMA_EXPERT_CACHE_ERR_INTERNAL : LLAMA_EXPERT_CACHE_OK;
}

int32_t llama_expert_cache_get_counts(const llama_context * ctx, int32_t il, int32_t phase, uint64_t * out, int32_t n) {
    int32_t rc;
    llama_expert_cache_layer * L = layer_of(ctx, il, rc);
    if (!L) {
        return rc;
    }
    if (phase < 0 || phase > 1 || (n > 0 && !out)) {
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    std::lock_guard<std::mutex> lock(L->owner->mutex);
    const int32_t ne = (int32_t) L->counts[phase].size();
    std::copy_n(L->counts[phase].begin(), std::min(n, ne), out);
    return ne;
}

int32_t llama_expert_cache_get_slots(const llama_context * ctx, int32_t il, int32_t * out, int32_t n) {
    int32_t rc;
    llama_expert_cache_layer * L = layer_of(ctx, il, rc);
    if (!L) {
        return rc;
    }
    if (n > 0 && !out) {
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    std::lock_guard<std::mutex> lock(L->owner->mutex);
    const llama_expert_cache_slots & ps = L->slots;
    for (int32_t s = 0; s < std::min<int32_t>(n, ps.n_slots); ++s) {
        const bool pending = ps.slot_state[s] == LLAMA_EXPERT_CACHE_SLOT_PENDING;
        out[s] = pending ? -2 - ps.slot_expert[s] : ps.slot_expert[s];
    }
    return ps.n_slots;
}

int64_t llama_expert_cache_get_trace(const llama_context * ctx, int32_t * out, int64_t n) {
    llama_expert_cache * ec = ctx ? ctx->get_expert_cache() : nullptr;
    if (!ec) {
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    std::lock_guard<std::mutex> lock(ec->mutex);
    if (out && n > 0) {
        std::copy_n(ec->trace.begin(), std::min<size_t>(n, ec->trace.size()), out);
    }
    return (int64_t) ec->trace.size();
}

void llama_expert_cache_reset_stats(llama_context * ctx) {
    llama_expert_cache * ec = ctx ? ctx->get_expert_cache() : nullptr;
    if (!ec) {
        return;
    }
    std::lock_guard<std::mutex> lock(ec->mutex);
    for (auto & L : ec->layers) {
        if (L) {
            L->stats = {};
            std::fill(L->counts[0].begin(), L->counts[0].end(), 0);
            std::fill(L->counts[1].begin(), L->counts[1].end(), 0);
        }
    }
    ec->trace.clear();
    ec->trace_dropped = 0;
}

size_t llama_expert_cache_device_bytes(const llama_context * ctx) {
    llama_expert_cache * ec = ctx ? ctx->get_expert_cache() : nullptr;
    return ec ? ec->device_bytes : 0;
}


int32_t llama_expert_cache_set_miss_path(llama_context * ctx, int32_t il, int32_t miss_path) {
    int32_t rc;
    llama_expert_cache_layer * L = layer_of(ctx, il, rc);
    if (!L) {
        return rc;
    }
    if (miss_path < LLAMA_EXPERT_CACHE_MISS_UPLOAD || miss_path > LLAMA_EXPERT_CACHE_MISS_AUTO) {
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    std::lock_guard<std::mutex> lock(L->owner->mutex);
    if (L->slots.n_slots == 0) {
        return LLAMA_EXPERT_CACHE_ERR_LAYER;
    }
    if (miss_path != LLAMA_EXPERT_CACHE_MISS_UPLOAD && L->cpu_ok == 0) {
        LLAMA_LOG_ERROR("%s: layer %d: its expert ops cannot run on the CPU miss path\n", __func__, il);
        return LLAMA_EXPERT_CACHE_ERR_PLACEMENT;
    }
    L->slots.miss_path = miss_path;
    return LLAMA_EXPERT_CACHE_OK;
}

int32_t llama_expert_cache_set_miss_costs(llama_context * ctx, int32_t il, int64_t cpu_expert_ns, int64_t cpu_ns,
        int64_t upload_ns) {
    int32_t rc;
    llama_expert_cache_layer * L = layer_of(ctx, il, rc);
    if (!L) {
        return rc;
    }
    if (cpu_expert_ns < 0 || cpu_ns < 0 || upload_ns < 0) {
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    std::lock_guard<std::mutex> lock(L->owner->mutex);
    if (L->slots.n_slots == 0) {
        return LLAMA_EXPERT_CACHE_ERR_LAYER;
    }
    L->slots.costs.cpu_expert_ns = cpu_expert_ns;
    L->slots.costs.cpu_ns        = cpu_ns;
    L->slots.costs.upload_ns = upload_ns;
    return LLAMA_EXPERT_CACHE_OK;
}

int32_t llama_expert_cache_get_miss_path(const llama_context * ctx, int32_t il) {
    int32_t rc;
    llama_expert_cache_layer * L = layer_of(ctx, il, rc);
    if (!L) {
        return rc;
    }
    std::lock_guard<std::mutex> lock(L->owner->mutex);
    return L->slots.miss_path;
}

int64_t llama_expert_cache_get_trace_dropped(const llama_context * ctx) {
    llama_expert_cache * ec = ctx ? ctx->get_expert_cache() : nullptr;
    if (!ec) {
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    std::lock_guard<std::mutex> lock(ec->mutex);
    return ec->trace_dropped;
}

namespace {

void copy_name(char * dst, size_t n, const char * src) {
    snprintf(dst, n, "%s", src ? src : "");
}

// one entry per buffer type: llama.cpp's breakdown plus the banks
std::map<ggml_backend_buffer_type_t, llama_expert_cache_mem_entry> memory_entries(llama_context * ctx) {
    std::map<ggml_backend_buffer_type_t, llama_expert_cache_mem_entry> ret;
    auto entry = [&](ggml_backend_buffer_type_t buft) -> llama_expert_cache_mem_entry & {
        auto it = ret.find(buft);
        if (it == ret.end()) {
            llama_expert_cache_mem_entry e = {};
            copy_name(e.buft, sizeof(e.buft), ggml_backend_buft_name(buft));
            ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
            copy_name(e.device, sizeof(e.device), dev ? ggml_backend_dev_name(dev) : "");
            e.is_host = ggml_backend_buft_is_host(buft) ? 1 : 0;
            it = ret.emplace(buft, e).first;
        }
        return it->second;
    };
    for (const auto & [buft, mb] : ctx->memory_breakdown()) {
        auto & e = entry(buft);
        e.model   += mb.model;
        e.context += mb.context;
        e.compute += mb.compute;
    }
    if (const llama_expert_cache * ec = ctx->get_expert_cache()) {
        for (const auto & [buft, bytes] : ec->bank_bytes) {
            entry(buft).banks += bytes;
        }
    }
    return ret;
}

} // namespace

int32_t llama_expert_cache_memory_breakdown(llama_context * ctx, llama_expert_cache_mem_entry * out, int32_t n_max) {
    if (!ctx || n_max < 0 || (n_max > 0 && !out)) {
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    try {
        ctx->sched_reserve(); // NOTE: no-op unless the graph changed since it was last reserved
        const auto entries = memory_entries(ctx);
        int32_t i = 0;
        for (const auto & [buft, e] : entries) {
            (void) buft;
            if (i < n_max) {
                out[i] = e;
            }
            ++i;
        }
        return i;
    } catch (const std::exception & e) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, e.what());
    } catch (...) {
        LLAMA_LOG_ERROR("%s: unknown exception\n", __func__);
    }
    return LLAMA_EXPERT_CACHE_ERR_INTERNAL;
}
