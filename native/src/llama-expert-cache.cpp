// Spark expert cache: banks of expert slots on the device, an exact LRU over them,
// and a host graph node that plans each step and remaps routed ids to slot ids.
#include "llama-expert-cache.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>

namespace {

// NOTE: these run on the CPU backend (the node is pinned there), after the scheduler copied the
// routed ids back from the device; single task, so each step is planned once.
void expert_cache_node_remap(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith == 0) {
        auto * n = (llama_expert_cache_node *) userdata;
        n->layer->owner->step(*n->layer, n->phase, dst->src[0], dst, true);
    }
}

void expert_cache_node_count(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith == 0) {
        auto * n = (llama_expert_cache_node *) userdata;
        n->layer->owner->step(*n->layer, n->phase, dst->src[0], dst, false);
    }
}

std::string fmt(const char * f, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof(buf), f, ap);
    va_end(ap);
    return buf;
}

} // namespace

llama_expert_cache::llama_expert_cache(const llama_model & model) : model(model) {}

llama_expert_cache_layer * llama_expert_cache::layer(int32_t il) {
    if (il < 0 || (size_t) il >= layers.size()) {
        return nullptr;
    }
    return layers[il].get();
}

int32_t llama_expert_cache::init(const llama_expert_cache_params & params, std::string & err) {
    const auto & hp = model.hparams;
    const int32_t n_layer = (int32_t) hp.n_layer();
    n_expert = (int32_t) hp.n_expert;
    trace_on = params.trace;

    if (params.n_layers < 0 || (params.n_layers > 0 && params.layers == nullptr)) {
        err = "invalid parameters: layers is null or n_layers < 0";
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    if (n_expert <= 0) {
        err = "the model has no routed experts";
        return LLAMA_EXPERT_CACHE_ERR_NOT_MOE;
    }

    layers.resize(n_layer);
    for (int32_t il = 0; il < n_layer && il < (int32_t) model.layers.size(); ++il) {
        const auto & ml = model.layers[il];
        if (!ml.ffn_up_exps && !ml.ffn_gate_up_exps && !ml.ffn_down_exps) {
            continue;
        }
        auto L = std::make_unique<llama_expert_cache_layer>();
        L->owner = this;
        L->il    = il;
        L->counts[0].assign(n_expert, 0);
        L->counts[1].assign(n_expert, 0);
        L->seen.assign(n_expert, 0);
        L->nodes[0] = { L.get(), LLAMA_EXPERT_CACHE_PHASE_PREFILL };
        L->nodes[1] = { L.get(), LLAMA_EXPERT_CACHE_PHASE_DECODE };
        layers[il] = std::move(L);
    }

    // validate every cached layer before allocating anything
    std::map<ggml_backend_buffer_type_t, size_t> need; // bytes per device buffer type
    std::map<ggml_backend_buffer_type_t, ggml_backend_dev_t> buft_dev;
    for (int32_t i = 0; i < params.n_layers; ++i) {
        const auto & lp = params.layers[i];
        if (lp.il < 0 || lp.il >= n_layer) {
            err = fmt("layer %d is out of range (the model has %d layers)", lp.il, n_layer);
            return LLAMA_EXPERT_CACHE_ERR_LAYER;
        }
        llama_expert_cache_layer * L = layer(lp.il);
        if (!L) {
            err = fmt("layer %d is not a MoE layer", lp.il);
            return LLAMA_EXPERT_CACHE_ERR_NOT_MOE;
        }
        if (L->n_slots > 0) {
            err = fmt("layer %d is listed twice", lp.il);
            return LLAMA_EXPERT_CACHE_ERR_LAYER;
        }
        const int32_t k = (int32_t) hp.n_expert_used(lp.il);
        if (lp.n_pinned < 0 || lp.n_slots > n_expert || lp.n_slots - lp.n_pinned < k || (lp.n_pinned > 0 && !lp.pinned)) {
            err = fmt("layer %d: %d slots with %d pinned leave fewer LRU slots than the %d experts used per token (at most %d slots)",
                    lp.il, lp.n_slots, lp.n_pinned, k, n_expert);
            return LLAMA_EXPERT_CACHE_ERR_SLOTS;
        }
        std::vector<uint8_t> pin_seen(n_expert, 0);
        for (int32_t j = 0; j < lp.n_pinned; ++j) {
            const int32_t e = lp.pinned[j];
            if (e < 0 || e >= n_expert || pin_seen[e]) {
                err = fmt("layer %d: pinned expert id %d is out of range [0, %d) or repeated", lp.il, e, n_expert);
                return LLAMA_EXPERT_CACHE_ERR_EXPERT_ID;
            }
            pin_seen[e] = 1;
        }

        ggml_backend_dev_t dev = model.dev_layer(lp.il);
        const auto dev_type = dev ? ggml_backend_dev_type(dev) : GGML_BACKEND_DEVICE_TYPE_CPU;
        if (dev_type != GGML_BACKEND_DEVICE_TYPE_GPU && dev_type != GGML_BACKEND_DEVICE_TYPE_IGPU) {
            err = fmt("layer %d runs on %s, not on a GPU-type device: offload the layer (n_gpu_layers) to cache it",
                    lp.il, dev ? ggml_backend_dev_name(dev) : "the CPU");
            return LLAMA_EXPERT_CACHE_ERR_PLACEMENT;
        }
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
        buft_dev[buft] = dev;

        const auto & ml = model.layers[lp.il];
        for (ggml_tensor * t : { ml.ffn_gate_exps, ml.ffn_up_exps, ml.ffn_down_exps, ml.ffn_gate_up_exps }) {
            if (!t) {
                continue;
            }
            // NOTE: slices are copied byte for byte, so the host tensor must be plain (not repacked) and contiguous
            if (!t->buffer || !ggml_backend_buffer_is_host(t->buffer) || t->extra != nullptr ||
                t->ne[2] != n_expert || !ggml_is_contiguous(t)) {
                err = fmt("layer %d: %s is not in plain host memory (%s): override it to the CPU without repacking",
                        lp.il, t->name, t->buffer ? ggml_backend_buffer_name(t->buffer) : "no buffer");
                return LLAMA_EXPERT_CACHE_ERR_PLACEMENT;
            }
            need[buft] += GGML_PAD(t->nb[2] * (size_t) (lp.n_slots + 1), ggml_backend_buft_get_alignment(buft));
        }
        if (lp.miss_path != LLAMA_EXPERT_CACHE_MISS_UPLOAD && lp.miss_path != LLAMA_EXPERT_CACHE_MISS_CPU) {
            err = fmt("layer %d: unknown miss path %d", lp.il, lp.miss_path);
            return LLAMA_EXPERT_CACHE_ERR_ARG;
        }
        L->n_slots   = lp.n_slots;
        L->n_pinned  = lp.n_pinned;
        L->miss_path = lp.miss_path;
        L->max_admit = lp.max_admit < 0 ? k : lp.max_admit;
    }

    for (const auto & [buft, bytes] : need) {
        size_t budget = params.device_budget;
        if (budget == 0) {
            size_t free = 0, total = 0;
            ggml_backend_dev_memory(buft_dev[buft], &free, &total);
            budget = free;
        }
        if (bytes > budget) {
            err = fmt("the expert banks need %.3f GiB on %s but only %.3f GiB is available",
                    bytes / 1073741824.0, ggml_backend_buft_name(buft), budget / 1073741824.0);
            return LLAMA_EXPERT_CACHE_ERR_NO_MEMORY;
        }
    }

    // allocate one buffer per device buffer type holding all its banks
    std::map<ggml_backend_buffer_type_t, ggml_context *> bctx;
    for (const auto & [buft, bytes] : need) {
        (void) bytes;
        ggml_init_params ip = { /*.mem_size =*/ ggml_tensor_overhead() * 4 * (size_t) n_layer + 1024, /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ true };
        ggml_context * c = ggml_init(ip);
        if (!c) {
            err = "ggml_init failed";
            return LLAMA_EXPERT_CACHE_ERR_INTERNAL;
        }
        ctxs.emplace_back(c);
        bctx[buft] = c;
    }
    for (auto & Lp : layers) {
        if (!Lp || Lp->n_slots == 0) {
            continue;
        }
        auto & L = *Lp;
        ggml_context * c = bctx[ggml_backend_dev_buffer_type(model.dev_layer(L.il))];
        const auto & ml = model.layers[L.il];
        for (ggml_tensor * t : { ml.ffn_gate_exps, ml.ffn_up_exps, ml.ffn_down_exps, ml.ffn_gate_up_exps }) {
            if (!t) {
                continue;
            }
            ggml_tensor * b = ggml_new_tensor_3d(c, t->type, t->ne[0], t->ne[1], L.n_slots + 1);
            ggml_format_name(b, "spark_bank.%s", t->name);
            L.banks.push_back({ t, b });
        }
        L.slot_expert.assign(L.n_slots, -1);
        L.slot_tick.assign(L.n_slots, 0);
        L.slot_step.assign(L.n_slots, 0);
        L.expert_slot.assign(n_expert, -1);
    }
    for (const auto & [buft, c] : bctx) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
        if (!buf) {
            err = fmt("could not allocate %.3f GiB of expert banks on %s", need[buft] / 1073741824.0, ggml_backend_buft_name(buft));
            return LLAMA_EXPERT_CACHE_ERR_NO_MEMORY;
        }
        ggml_backend_buffer_clear(buf, 0); // zeroed guard slices (and empty slots)
        device_bytes += ggml_backend_buffer_get_size(buf);
        bufs.emplace_back(buf);
    }

    // upload the pinned experts into the first slots
    for (int32_t i = 0; i < params.n_layers; ++i) {
        const auto & lp = params.layers[i];
        auto & L = *layer(lp.il);
        for (int32_t j = 0; j < lp.n_pinned; ++j) {
            const int32_t e = lp.pinned[j];
            const int64_t t0 = ggml_time_us();
            for (auto & b : L.banks) {
                const size_t nb = b.src->nb[2];
                ggml_backend_tensor_set(b.bank, (const char *) b.src->data + (size_t) e * nb, (size_t) j * nb, nb);
                L.stats.bytes_uploaded += nb;
            }
            L.stats.upload_us += ggml_time_us() - t0;
            L.stats.uploads++;
            L.slot_expert[j] = e;
            L.expert_slot[e] = j;
        }
    }
    return LLAMA_EXPERT_CACHE_OK;
}

ggml_tensor * llama_expert_cache::build(
        ggml_context        * ctx0,
        ggml_cgraph         * gf,
        ggml_backend_sched_t  sched,
        ggml_backend_t        backend_cpu,
        int                   il,
        int64_t               n_ubatch_tokens,
        ggml_tensor         * selected_experts,
        bool                  can_remap,
        ggml_tensor        ** up_exps,
        ggml_tensor        ** gate_exps,
        ggml_tensor        ** down_exps,
        ggml_tensor        ** gate_up_exps) {
    llama_expert_cache_layer * L = layer(il);
    if (!L || !backend_cpu) {
        return selected_experts;
    }
    const int64_t k        = selected_experts->ne[0];
    const int64_t n_tokens = selected_experts->ne[1];

    // NOTE: decided when the graph is built: a step whose ids may not all fit the LRU slots
    // takes the stock path, so it can neither fail nor flush the decode working set
    bool remap = can_remap && L->n_slots > 0 && n_tokens * k <= L->n_slots - L->n_pinned;

    ggml_tensor ** wts[4] = { up_exps, gate_exps, down_exps, gate_up_exps };
    ggml_tensor *  swap[4] = { nullptr, nullptr, nullptr, nullptr };
    for (int i = 0; i < 4 && remap; ++i) {
        if (!wts[i] || !*wts[i]) {
            continue;
        }
        for (auto & b : L->banks) {
            if (b.src == *wts[i]) {
                swap[i] = b.bank;
            }
        }
        remap = remap && swap[i] != nullptr; // a weight the cache does not hold: stock path
    }

    ggml_tensor * args[1] = { selected_experts };
    ggml_tensor * node = ggml_custom_4d(ctx0, GGML_TYPE_I32, k, n_tokens, 1, 1, args, 1,
            remap ? expert_cache_node_remap : expert_cache_node_count, 1,
            &L->nodes[n_ubatch_tokens == 1 ? LLAMA_EXPERT_CACHE_PHASE_DECODE : LLAMA_EXPERT_CACHE_PHASE_PREFILL]);
    ggml_format_name(node, "%s-%d", remap ? "spark_ec_remap" : "spark_ec_count", il);
    ggml_backend_sched_set_tensor_backend(sched, node, backend_cpu);

    if (!remap) {
        ggml_build_forward_expand(gf, node);
        return selected_experts;
    }
    for (int i = 0; i < 4; ++i) {
        if (swap[i]) {
            *wts[i] = swap[i];
        }
    }
    return node;
}

void llama_expert_cache::step(llama_expert_cache_layer & L, int phase, const ggml_tensor * ids, ggml_tensor * dst, bool remap) {
    const int64_t k        = ids->ne[0];
    const int64_t n_tokens = ids->ne[1];

    auto id_at = [&](int64_t t, int64_t j) {
        return *(const int32_t *) ((const char *) ids->data + t * ids->nb[1] + j * ids->nb[0]);
    };

    std::lock_guard<std::mutex> lock(mutex);

    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            const int32_t e = id_at(t, j);
            if (e >= 0 && e < n_expert) {
                L.counts[phase][e]++;
            }
        }
    }
    if (trace_on) {
        trace.push_back(L.il);
        trace.push_back((int32_t) n_tokens);
        trace.push_back((int32_t) k);
        trace.push_back(phase);
        for (int64_t t = 0; t < n_tokens; ++t) {
            for (int64_t j = 0; j < k; ++j) {
                trace.push_back(id_at(t, j));
            }
        }
    }

    if (!remap) {
        if (L.n_slots > 0) {
            L.stats.steps_stock++;
        }
        return;
    }
    L.stats.steps_cached++;

    // distinct experts in order of first appearance
    std::vector<int32_t> distinct;
    distinct.reserve(n_tokens * k);
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            const int32_t e = id_at(t, j);
            GGML_ASSERT(e >= 0 && e < n_expert);
            if (!L.seen[e]) {
                L.seen[e] = 1;
                distinct.push_back(e);
            }
        }
    }

    // hits first, so that no expert this step needs can be evicted by its misses
    for (int32_t e : distinct) {
        const int32_t s = L.expert_slot[e];
        if (s >= 0) {
            L.stats.hits++;
            L.slot_step[s] = 1;
            if (s >= L.n_pinned) {
                L.slot_tick[s] = ++tick;
            }
        }
    }
    int64_t t_upload = 0;
    for (int32_t e : distinct) {
        if (L.expert_slot[e] >= 0) {
            continue;
        }
        int32_t victim = -1;
        for (int32_t s = L.n_pinned; s < L.n_slots; ++s) {
            if (L.slot_expert[s] < 0) {
                victim = s;
                break;
            }
        }
        if (victim < 0) {
            for (int32_t s = L.n_pinned; s < L.n_slots; ++s) {
                if (!L.slot_step[s] && (victim < 0 || L.slot_tick[s] < L.slot_tick[victim])) {
                    victim = s;
                }
            }
        }
        GGML_ASSERT(victim >= 0 && "expert cache: no evictable slot (step larger than the LRU slots)");
        if (L.slot_expert[victim] >= 0) {
            L.expert_slot[L.slot_expert[victim]] = -1;
        }
        const int64_t t0 = ggml_time_us();
        for (auto & b : L.banks) {
            const size_t nb = b.src->nb[2];
            ggml_backend_tensor_set(b.bank, (const char *) b.src->data + (size_t) e * nb, (size_t) victim * nb, nb);
            L.stats.bytes_uploaded += nb;
        }
        t_upload += ggml_time_us() - t0;
        L.slot_expert[victim] = e;
        L.expert_slot[e]      = victim;
        L.slot_tick[victim]   = ++tick;
        L.slot_step[victim]   = 1;
        L.stats.misses++;
        L.stats.uploads++;
    }
    L.stats.upload_us += t_upload;

    // slot ids for the expert matmuls; dst is contiguous [k, n_tokens]
    int32_t * out = (int32_t *) dst->data;
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            out[t * k + j] = L.expert_slot[id_at(t, j)];
        }
    }
    for (int32_t e : distinct) {
        L.seen[e] = 0;
        L.slot_step[L.expert_slot[e]] = 0;
    }
}

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
    return LLAMA_EXPERT_CACHE_OK;
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
    std::copy_n(L->slot_expert.begin(), std::min<size_t>(n, L->slot_expert.size()), out);
    return L->n_slots;
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
    if (miss_path != LLAMA_EXPERT_CACHE_MISS_UPLOAD && miss_path != LLAMA_EXPERT_CACHE_MISS_CPU) {
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    std::lock_guard<std::mutex> lock(L->owner->mutex);
    L->miss_path = miss_path;
    return LLAMA_EXPERT_CACHE_OK;
}

int32_t llama_expert_cache_get_miss_path(const llama_context * ctx, int32_t il) {
    int32_t rc;
    llama_expert_cache_layer * L = layer_of(ctx, il, rc);
    if (!L) {
        return rc;
    }
    std::lock_guard<std::mutex> lock(L->owner->mutex);
    return L->miss_path;
}

int64_t llama_expert_cache_get_trace_dropped(const llama_context * ctx) {
    llama_expert_cache * ec = ctx ? ctx->get_expert_cache() : nullptr;
    if (!ec) {
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    std::lock_guard<std::mutex> lock(ec->mutex);
    return ec->trace_dropped;
}
