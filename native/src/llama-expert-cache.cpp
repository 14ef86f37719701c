// Spark expert cache: banks of expert slots on the device, host graph nodes that run the
// policy core (llama-expert-cache-policy.cpp) on each step and remap routed ids to slot ids,
// uploads, and a CPU miss path that computes non-resident experts from the host weights with
// the ggml CPU kernels.
#include "llama-expert-cache.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <unordered_set>

static_assert((int) LLAMA_EXPERT_CACHE_POLICY_LRU      == (int) LLAMA_EXPERT_CACHE_POLICY_ID_LRU &&
              (int) LLAMA_EXPERT_CACHE_POLICY_LFU_AGED == (int) LLAMA_EXPERT_CACHE_POLICY_ID_LFU_AGED &&
              (int) LLAMA_EXPERT_CACHE_POLICY_SLRU     == (int) LLAMA_EXPERT_CACHE_POLICY_ID_SLRU &&
              (int) LLAMA_EXPERT_CACHE_POLICY_TINYLFU  == (int) LLAMA_EXPERT_CACHE_POLICY_ID_TINYLFU &&
              (int) LLAMA_EXPERT_CACHE_MISS_UPLOAD     == (int) LLAMA_EXPERT_CACHE_MISS_ID_UPLOAD &&
              (int) LLAMA_EXPERT_CACHE_MISS_CPU        == (int) LLAMA_EXPERT_CACHE_MISS_ID_CPU &&
              (int) LLAMA_EXPERT_CACHE_MISS_AUTO       == (int) LLAMA_EXPERT_CACHE_MISS_ID_AUTO,
              "the policy core's ids must be the C API's values");

namespace {

// NOTE: host nodes run on the CPU backend (pinned there) after the scheduler copied the routed
// ids (and the matmul input) back from the device; single task, so each step is planned once.
// Nothing may throw through ggml's C code: a failure is logged and flagged on the cache.
template <typename F>
void guarded(llama_expert_cache * ec, const char * what, F && f) {
    try {
        f();
    } catch (const std::exception & e) {
        ec->failed = true;
        LLAMA_LOG_ERROR("expert cache: %s failed: %s\n", what, e.what());
    } catch (...) {
        ec->failed = true;
        LLAMA_LOG_ERROR("expert cache: %s failed\n", what);
    }
}

void expert_cache_node_remap(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith == 0) {
        auto * n = (llama_expert_cache_node *) userdata;
        guarded(n->layer->owner, "remap", [&] { n->layer->owner->step(*n, dst->src[0], dst, true); });
    }
}

void expert_cache_node_count(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith == 0) {
        auto * n = (llama_expert_cache_node *) userdata;
        guarded(n->layer->owner, "count", [&] { n->layer->owner->step(*n, dst->src[0], dst, false); });
    }
}

void expert_cache_node_partial(ggml_tensor * dst, int ith, int nth, void * userdata) {
    auto * n = (llama_expert_cache_node *) userdata;
    guarded(n->layer->owner, "cpu miss path", [&] { n->layer->owner->compute_partial(*n, dst, ith, nth); });
}

std::string fmt(const char * f, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof(buf), f, ap);
    va_end(ap);
    return buf;
}

bool is_gpu(ggml_backend_dev_t dev) {
    const auto t = dev ? ggml_backend_dev_type(dev) : GGML_BACKEND_DEVICE_TYPE_CPU;
    return t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU;
}

// ops the CPU miss path may rebuild between the expert matmuls and the down projection
bool recipe_op_ok(ggml_op op) {
    switch (op) {
        case GGML_OP_MUL_MAT_ID:
        case GGML_OP_ADD_ID:
        case GGML_OP_VIEW:
        case GGML_OP_GLU:
        case GGML_OP_UNARY:
        case GGML_OP_CLAMP:
        case GGML_OP_SCALE:
        case GGML_OP_ADD:
        case GGML_OP_SUB:
        case GGML_OP_MUL:
        case GGML_OP_DIV:
        case GGML_OP_SQR:
        case GGML_OP_SQRT:
            return true;
        default:
            return false;
    }
}

// expert weights (a bank or its host tensor): the host tensor
ggml_tensor * host_of(const llama_expert_cache_layer & L, const ggml_tensor * t) {
    for (const auto & b : L.banks) {
        if (t == b.bank || t == b.src) {
            return b.src;
        }
    }
    return nullptr;
}

const size_t MIRROR_MAX = (size_t) 64 << 20; // device leaves (biases) copied to the host at most this big
constexpr size_t RECIPE_MAX = 32;         // ops between the expert matmuls' input and the down projection

} // namespace

llama_expert_cache::llama_expert_cache(const llama_model & model) : model(model) {}

llama_expert_cache::~llama_expert_cache() {
    for (auto & [dev, b] : upload_backends) {
        (void) dev;
        if (b) {
            ggml_backend_synchronize(b);
        }
    }
    for (auto & L : layers) {
        if (L) {
            for (ggml_backend_event_t ev : L->slot_event) {
                if (ev) {
                    ggml_backend_event_free(ev);
                }
            }
            if (L->stage_event) {
                ggml_backend_event_free(L->stage_event);
            }
        }
    }
    for (auto & [dev, b] : upload_backends) {
        (void) dev;
        if (b) {
            ggml_backend_free(b);
        }
    }
    for (auto & w : workers) {
        ggml_backend_free(w.backend);
        if (w.ctx) {
            ggml_free(w.ctx);
        }
    }
}

llama_expert_cache_layer * llama_expert_cache::layer(int32_t il) {
    if (il < 0 || (size_t) il >= layers.size()) {
        return nullptr;
    }
    return layers[il].get();
}

int32_t llama_expert_cache::init(const llama_expert_cache_params & params, std::string & err) {
    n_expert  = (int32_t) model.hparams.n_expert;
    trace_on  = params.trace;
    trace_max = params.trace_max > 0 ? params.trace_max : 0;
    n_threads = params.n_threads > 0 ? params.n_threads : 1;
    count_uncached = params.count_uncached || params.n_layers == 0;
    dry       = model.hparams.no_alloc;
    if (params.slru_protected_num < 0 || params.slru_protected_den <= 0 || params.slru_protected_num > params.slru_protected_den) {
        err = "invalid parameters: slru_protected_num / slru_protected_den must be a share in [0, 1]";
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    if (params.n_stage < 0 || params.n_stage > (int32_t) model.hparams.n_expert) {
        err = fmt("invalid parameters: %d staging slices: expected 0 to %d (the experts of a layer)",
                params.n_stage, (int32_t) model.hparams.n_expert);
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    if (params.n_layers < 0 || (params.n_layers > 0 && params.layers == nullptr)) {
        err = "invalid parameters: layers is null or n_layers < 0";
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    if (n_expert <= 0) {
        err = "the model has no routed experts";
        return LLAMA_EXPERT_CACHE_ERR_NOT_MOE;
    }
    make_layers();

    // validate every cached layer before allocating anything
    llama_expert_cache_bank_needs need;
    for (int32_t i = 0; i < params.n_layers; ++i) {
        const int32_t rc = configure_layer(params, params.layers[i], need, err);
        if (rc != LLAMA_EXPERT_CACHE_OK) {
            return rc;
        }
    }
    int32_t rc = plan_arenas(params.n_stage, need, err);
    if (rc == LLAMA_EXPERT_CACHE_OK && !dry) {
        rc = check_budget(params, need, err); // NOTE: a dry run measures, never refuses
    }
    if (rc == LLAMA_EXPERT_CACHE_OK) {
        rc = alloc_banks(need, err);
    }
    if (rc != LLAMA_EXPERT_CACHE_OK) {
        return rc;
    }
    init_workers();
    upload_pinned(params);
    if (trace_on) {
        trace.reserve((size_t) std::min<int64_t>(trace_max, (int64_t) 1 << 20));
    }
    return LLAMA_EXPERT_CACHE_OK;
}

void llama_expert_cache::make_layers() {
    const int32_t n_layer = (int32_t) model.hparams.n_layer();
    layers.resize(n_layer);
    for (int32_t il = 0; il < n_layer && il < (int32_t) model.layers.size(); ++il) {
        const auto & ml = model.layers[il];
        if (!ml.ffn_up_exps && !ml.ffn_gate_up_exps && !ml.ffn_down_exps) {
            continue;
        }
        auto L = std::make_unique<llama_expert_cache_layer>();
        L->owner = this;
        L->il    = il;
        L->on_device = is_gpu(model.dev_layer(il));
        L->counts[0].assign(n_expert, 0);
        L->counts[1].assign(n_expert, 0);
        for (int ph = 0; ph < 2; ++ph) {
            for (int kind = 0; kind < 3; ++kind) {
                L->nodes[ph][kind] = { L.get(), ph, kind == LLAMA_EXPERT_CACHE_NODE_HYBRID };
            }
        }
        layers[il] = std::move(L);
    }
}

int32_t llama_expert_cache::check_layer(const llama_expert_cache_layer_params & lp, std::string & err) {
    const int32_t n_layer = (int32_t) layers.size();
    if (lp.il < 0 || lp.il >= n_layer) {
        err = fmt("layer %d is out of range (the model has %d layers)", lp.il, n_layer);
        return LLAMA_EXPERT_CACHE_ERR_LAYER;
    }
    const llama_expert_cache_layer * L = layer(lp.il);
    if (!L) {
        err = fmt("layer %d is not a MoE layer", lp.il);
        return LLAMA_EXPERT_CACHE_ERR_NOT_MOE;
    }
    if (L->slots.n_slots > 0) {
        err = fmt("layer %d is listed twice", lp.il);
        return LLAMA_EXPERT_CACHE_ERR_LAYER;
    }
    const int32_t k = (int32_t) model.hparams.n_expert_used(lp.il);
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
    if (lp.miss_path < LLAMA_EXPERT_CACHE_MISS_UPLOAD || lp.miss_path > LLAMA_EXPERT_CACHE_MISS_AUTO) {
        err = fmt("layer %d: unknown miss path %d", lp.il, lp.miss_path);
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    if (lp.policy < LLAMA_EXPERT_CACHE_POLICY_LRU || lp.policy > LLAMA_EXPERT_CACHE_POLICY_TINYLFU) {
        err = fmt("layer %d: unknown policy %d", lp.il, lp.policy);
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    return LLAMA_EXPERT_CACHE_OK;
}

// the layer's expert tensors must be plain host tensors
int32_t llama_expert_cache::check_layer_tensors(const llama_expert_cache_layer_params & lp, llama_expert_cache_bank_needs & need,
        size_t & expert_bytes, std::string & err) {
    ggml_backend_dev_t dev = model.dev_layer(lp.il);
    if (!is_gpu(dev)) {
        err = fmt("layer %d runs on %s, not on a GPU-type device: offload the layer (n_gpu_layers) to cache it",
                lp.il, dev ? ggml_backend_dev_name(dev) : "the CPU");
        return LLAMA_EXPERT_CACHE_ERR_PLACEMENT;
    }
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
    need.dev[buft] = dev;
    ggml_backend_buffer_type_t host_buft = ggml_backend_dev_host_buffer_type(dev);

    const auto & ml = model.layers[lp.il];
    expert_bytes = 0;
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
        if (host_buft && ggml_backend_buffer_get_type(t->buffer) != host_buft && !need.warned_pinned) {
            need.warned_pinned = true;
            LLAMA_LOG_WARN("expert cache: %s is in %s, not in %s's pinned host memory: uploads are slower and cannot overlap\n",
                    t->name, ggml_backend_buffer_name(t->buffer), ggml_backend_buft_name(host_buft));
        }
        expert_bytes += t->nb[2];
    }
    return LLAMA_EXPERT_CACHE_OK;
}

int32_t llama_expert_cache::configure_layer(const llama_expert_cache_params & params, const llama_expert_cache_layer_params & lp,
        llama_expert_cache_bank_needs & need, std::string & err) {
    size_t expert_bytes = 0;
    int32_t rc = check_layer(lp, err);
    if (rc == LLAMA_EXPERT_CACHE_OK) {
        rc = check_layer_tensors(lp, need, expert_bytes, err);
    }
    if (rc != LLAMA_EXPERT_CACHE_OK) {
        return rc;
    }
    llama_expert_cache_layer & L = *layer(lp.il);
    const int32_t k = (int32_t) model.hparams.n_expert_used(lp.il);
    L.slots.init(n_expert, lp.n_slots, lp.n_pinned, lp.policy, lp.miss_path, lp.max_admit < 0 ? k : lp.max_admit,
            params.policy_window, params.slru_protected_num, params.slru_protected_den, params.n_stage);
    L.expert_bytes = expert_bytes;
    return LLAMA_EXPERT_CACHE_OK;
}

int32_t llama_expert_cache::check_budget(const llama_expert_cache_params & params, llama_expert_cache_bank_needs & need, std::string & err) {
    for (const auto & [buft, bytes] : need.bytes) {
        size_t budget = params.device_budget;
        if (budget == 0) {
            // NOTE: never all free memory: compute buffers, pools and graphs allocate after the banks
            size_t free = 0, total = 0;
            ggml_backend_dev_memory(need.dev[buft], &free, &total);
            budget = free > params.device_margin ? free - params.device_margin : 0;
        }
        if (bytes > budget) {
            err = fmt("the expert banks need %.3f GiB on %s but only %.3f GiB is available",
                    bytes / 1073741824.0, ggml_backend_buft_name(buft), budget / 1073741824.0);
            return LLAMA_EXPERT_CACHE_ERR_NO_MEMORY;
        }
    }
    return LLAMA_EXPERT_CACHE_OK;
}

namespace {

std::vector<ggml_tensor *> expert_tensors(const llama_layer & ml) {
    std::vector<ggml_tensor *> out;
    for (ggml_tensor * t : { ml.ffn_gate_exps, ml.ffn_up_exps, ml.ffn_down_exps, ml.ffn_gate_up_exps }) {
        if (t) {
            out.push_back(t);
        }
    }
    return out;
}

bool same_shapes(const std::vector<ggml_tensor *> & a, const std::vector<ggml_tensor *> & b) {
    if (a.size() != b.size()) {
        return false;
    }
    for (size_t i = 0; i < a.size(); ++i) {
        if (a[i]->type != b[i]->type || a[i]->ne[0] != b[i]->ne[0] || a[i]->ne[1] != b[i]->ne[1]) {
            return false;
        }
    }
    return true;
}

// the first slice at or after `at` whose byte offset suits the buffer type in every kind (views of
// an arena start there), within a bound
int64_t aligned_slice(const std::vector<ggml_tensor *> & like, int64_t at, size_t align) {
    for (int64_t s = at; s < at + 4096; ++s) {
        bool ok = true;
        for (ggml_tensor * t : like) {
            ok = ok && ((size_t) s * t->nb[2]) % align == 0;
        }
        if (ok) {
            return s;
        }
    }
    return at;
}

} // namespace

// Which arena holds each cached layer's banks (layer order), the staging slices after them, and the
// bytes they need per buffer type.
int32_t llama_expert_cache::plan_arenas(int32_t n_stage, llama_expert_cache_bank_needs & need, std::string & err) {
    for (auto & Lp : layers) {
        if (!Lp || Lp->slots.n_slots == 0) {
            continue;
        }
        llama_expert_cache_layer & L = *Lp;
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(model.dev_layer(L.il));
        const std::vector<ggml_tensor *> like = expert_tensors(model.layers[L.il]);
        const size_t align = ggml_backend_buft_get_alignment(buft);
        size_t nb_max = 0;
        for (ggml_tensor * t : like) {
            nb_max = std::max(nb_max, t->nb[2]);
        }
        const int64_t max_slices = nb_max > 0 ? (int64_t) (ggml_backend_buft_get_max_size(buft) / nb_max) : INT64_MAX;
        llama_expert_cache_arena * a = nullptr;
        for (auto & c : arenas) {
            if (c.buft == buft && same_shapes(c.like, like)) {
                a = &c; // the newest arena of this kind (a full one is followed by a new one)
            }
        }
        int64_t at = a ? aligned_slice(like, a->total, align) : 0;
        const int64_t need_slices = L.slots.n_slots + 1;
        if (a && aligned_slice(like, at + need_slices, align) + n_stage > max_slices) {
            a = nullptr; // past the buffer type's max size: a new arena
            at = 0;
        }
        if (!a) {
            if (need_slices + n_stage > max_slices) {
                err = fmt("layer %d: a bank of %d slots does not fit one %s buffer (%.3f GiB at most)", L.il,
                        L.slots.n_slots, ggml_backend_buft_name(buft), ggml_backend_buft_get_max_size(buft) / 1073741824.0);
                return LLAMA_EXPERT_CACHE_ERR_NO_MEMORY;
            }
            arenas.emplace_back();
            a = &arenas.back();
            a->buft = buft;
            a->like = like;
        }
        a->layers.push_back(L.il);
        a->start.push_back(at);
        a->total = at + need_slices;
    }
    for (auto & a : arenas) {
        const size_t align = ggml_backend_buft_get_alignment(a.buft);
        a.stage_start = aligned_slice(a.like, a.total, align);
        a.total       = a.stage_start + n_stage;
        for (ggml_tensor * t : a.like) {
            need.bytes[a.buft] += GGML_PAD(t->nb[2] * (size_t) a.total, align);
        }
        for (size_t i = 0; i < a.layers.size(); ++i) {
            layer(a.layers[i])->slots.stage_base = (int32_t) (a.stage_start - a.start[i]);
        }
    }
    return LLAMA_EXPERT_CACHE_OK;
}

// one buffer per device buffer type holding its arenas (more where the buffer type's max size asks)
int32_t llama_expert_cache::alloc_banks(llama_expert_cache_bank_needs & need, std::string & err) {
    std::map<ggml_backend_buffer_type_t, ggml_context *> bctx;
    for (const auto & [buft, bytes] : need.bytes) {
        (void) bytes;
        ggml_init_params ip = { /*.mem_size =*/ ggml_tensor_overhead() * 4 * (arenas.size() + 1) + 1024, /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ true };
        ggml_context * c = ggml_init(ip);
        if (!c) {
            err = "ggml_init failed";
            return LLAMA_EXPERT_CACHE_ERR_INTERNAL;
        }
        ctxs.emplace_back(c);
        bctx[buft] = c;
    }
    for (size_t i = 0; i < arenas.size(); ++i) {
        auto & a = arenas[i];
        for (ggml_tensor * t : a.like) {
            ggml_tensor * b = ggml_new_tensor_3d(bctx[a.buft], t->type, t->ne[0], t->ne[1], a.total);
            ggml_format_name(b, "spark_arena%zu.%s", i, t->name);
            a.tensors.push_back(b);
        }
    }
    for (const auto & [buft, c] : bctx) {
        if (dry) {
            size_t bytes = 0;
            ggml_backend_buffer_t buf = dry_buffer(c, buft, bytes);
            bank_bytes[buft] += bytes;
            device_bytes     += bytes;
            bufs.emplace_back(buf);
            continue;
        }
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
        if (!buf) {
            err = fmt("could not allocate %.3f GiB of expert banks on %s", need.bytes[buft] / 1073741824.0, ggml_backend_buft_name(buft));
            return LLAMA_EXPERT_CACHE_ERR_NO_MEMORY;
        }
        // NOTE: weights usage, so the scheduler keeps the expert matmuls on the bank's device
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_buffer_clear(buf, 0); // zeroed guard slices (and empty slots)
        bank_bytes[buft] += ggml_backend_buffer_get_size(buf);
        device_bytes     += ggml_backend_buffer_get_size(buf);
        bufs.emplace_back(buf);
    }
    size_t n_views = 0;
    for (const auto & a : arenas) {
        n_views += a.layers.size() * a.like.size();
    }
    ggml_init_params ip = { /*.mem_size =*/ ggml_tensor_overhead() * (n_views + 1) + 1024, /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ true };
    ggml_context * vctx = ggml_init(ip);
    if (!vctx) {
        err = "ggml_init failed";
        return LLAMA_EXPERT_CACHE_ERR_INTERNAL;
    }
    ctxs.emplace_back(vctx);
    for (const auto & a : arenas) {
        make_views(a, vctx);
        for (int32_t il : a.layers) {
            init_admissions(*layer(il), model.dev_layer(il));
        }
    }
    return LLAMA_EXPERT_CACHE_OK;
}

// a dry run's banks: the size a real allocation would take, and a zero-size buffer that marks the
// tensors allocated (as llama.cpp's no_alloc weights), so the scheduler plans the cached graph
ggml_backend_buffer_t llama_expert_cache::dry_buffer(ggml_context * c, ggml_backend_buffer_type_t buft, size_t & bytes) {
    bytes = ggml_backend_alloc_ctx_tensors_from_buft_size(c, buft);
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, 0);
    for (ggml_tensor * t = ggml_get_first_tensor(c); t != nullptr; t = ggml_get_next_tensor(c, t)) {
        t->buffer = buf;
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    return buf;
}

// each layer's banks: views of the arena from its slot 0 to the arena's end (slots, guard, the
// banks after it, the staging slices), so one id space holds its slots and the staging slices
void llama_expert_cache::make_views(const llama_expert_cache_arena & a, ggml_context * c) {
    for (size_t i = 0; i < a.layers.size(); ++i) {
        llama_expert_cache_layer & L = *layer(a.layers[i]);
        const std::vector<ggml_tensor *> srcs = expert_tensors(model.layers[L.il]);
        for (size_t k = 0; k < a.tensors.size(); ++k) {
            ggml_tensor * t = a.tensors[k];
            ggml_tensor * v = ggml_view_3d(c, t, t->ne[0], t->ne[1], a.total - a.start[i], t->nb[1], t->nb[2],
                    (size_t) a.start[i] * t->nb[2]);
            ggml_format_name(v, "spark_bank.%s", srcs[k]->name);
            if (dry) {
                v->buffer = t->buffer; // NOTE: no data to point into: the dry run's marked buffer
            } else {
                GGML_ASSERT(ggml_backend_view_init(v) == GGML_STATUS_SUCCESS);
            }
            L.banks.push_back({ srcs[k], v });
        }
    }
}

// background admissions: a second backend on the device (its own stream) and an event per slot
void llama_expert_cache::init_admissions(llama_expert_cache_layer & L, ggml_backend_dev_t dev) {
    L.slot_event.assign(L.slots.n_slots, nullptr);
    if (upload_backends.find(dev) == upload_backends.end()) {
        ggml_backend_t ub = ggml_backend_dev_init(dev, nullptr);
        upload_backends[dev] = ub;
        if (!ub) {
            LLAMA_LOG_WARN("expert cache: no second backend on %s: admissions upload synchronously\n", ggml_backend_dev_name(dev));
        }
    }
    L.upload_backend = upload_backends[dev];
    if (L.upload_backend) {
        for (int32_t s = L.slots.n_pinned; s < L.slots.n_slots; ++s) {
            L.slot_event[s] = ggml_backend_event_new(dev);
            if (!L.slot_event[s]) {
                L.upload_backend = nullptr; // no events: admissions upload synchronously
                break;
            }
        }
    }
    if (L.upload_backend && L.slots.n_stage > 0) {
        L.stage_event = ggml_backend_event_new(dev);
    }
    // NOTE: the split's cost rule: staged uploads beside the CPU work only with their own queue and event
    L.slots.costs.concurrent = L.upload_backend != nullptr && L.stage_event != nullptr;
}

// the CPU miss path's private backend (never the context's: its threads run the host nodes)
// The CPU miss path's workers: a private one-thread CPU backend each (a backend of more threads
// would nest a thread team inside the graph's, which runs the host node).
void llama_expert_cache::init_workers() {
    for (int32_t i = 0; i < n_threads; ++i) {
        ggml_backend_t b = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
        if (!b) {
            break;
        }
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(ggml_backend_get_device(b));
        auto set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
        if (set_threads) {
            set_threads(b, 1);
        }
        workers.emplace_back();
        workers.back().backend = b;
        workers.back().expert_rows.assign(n_expert, 0);
    }
}

// the pinned experts go into the first slots
void llama_expert_cache::upload_pinned(const llama_expert_cache_params & params) {
    for (int32_t i = 0; i < params.n_layers; ++i) {
        const auto & lp = params.layers[i];
        auto & L = *layer(lp.il);
        for (int32_t j = 0; j < lp.n_pinned; ++j) {
            const int32_t e = lp.pinned[j];
            if (dry) { // NOTE: no weights to read: the slot only records its expert
                L.slots.pin(j, e);
                continue;
            }
            const int64_t t0 = ggml_time_us();
            for (auto & b : L.banks) {
                const size_t nb = b.src->nb[2];
                ggml_backend_tensor_set(b.bank, (const char *) b.src->data + (size_t) e * nb, (size_t) j * nb, nb);
                L.stats.bytes_uploaded += nb;
            }
            L.stats.upload_us += ggml_time_us() - t0;
            L.stats.uploads++;
            L.slots.pin(j, e);
        }
    }
}

ggml_tensor * llama_expert_cache::build(
        ggml_context        * ctx0,
        ggml_backend_sched_t  sched,
        ggml_backend_t        backend_cpu,
        int                   il,
        int64_t               n_ubatch_tokens,
        ggml_tensor         * cur,
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
    // NOTE: the hook passes 1 for a decode step, one token per sequence (several with -np)
    const int phase = n_ubatch_tokens == 1 ? LLAMA_EXPERT_CACHE_PHASE_DECODE : LLAMA_EXPERT_CACHE_PHASE_PREFILL;
    L->building_remap = L->building_partial = L->building_count = L->building_part = L->building_mask = nullptr;
    L->building_node = nullptr;
    L->building_cur = cur;
    L->building_sel = selected_experts;

    // NOTE: warm-up routes every expert (n_expert_used = n_expert): leave it stock and uncounted; an
    // uncached layer stays stock unless its routing is counted (a stop per step)
    if (k != (int64_t) model.hparams.n_expert_used(il) || (L->slots.n_slots == 0 && !count_uncached)) {
        return selected_experts;
    }
    if (L->slots.n_slots > 0 && !L->compute_backend) {
        L->compute_backend = backend_of(sched, model.dev_layer(il));
    }

    // NOTE: decided when the graph is built. With the CPU miss path (known once a graph of this
    // layer was analysed, see finish) any ubatch is remapped: misses read filler slots and go to
    // the CPU. Without it, a step whose ids may not all fit the LRU slots takes the stock path.
    const bool fits   = n_tokens * k <= L->slots.n_slots - L->slots.n_pinned;
    const bool hybrid = L->cpu_ok == 1 && !L->recipe.empty() && cur != nullptr && !workers.empty() &&
                        down_exps && *down_exps && cur->ne[1] == n_tokens && cur->ne[2] == 1 && cur->ne[3] == 1 &&
                        L->compute_backend != nullptr;
    ggml_tensor ** wts[4] = { up_exps, gate_exps, down_exps, gate_up_exps };
    ggml_tensor *  swap[4] = { nullptr, nullptr, nullptr, nullptr };
    const bool remap = can_remap && L->slots.n_slots > 0 && (fits || hybrid) && bank_swaps(*L, wts, swap);

    // NOTE: the stop reads one device tensor: the routed ids, or (hybrid) the ids packed with the
    // matmuls' input, so that the scheduler copies one tensor down per stop
    const int kind = !remap ? LLAMA_EXPERT_CACHE_NODE_COUNT : hybrid ? LLAMA_EXPERT_CACHE_NODE_HYBRID : LLAMA_EXPERT_CACHE_NODE_REMAP;
    ggml_tensor * args[1] = { kind == LLAMA_EXPERT_CACHE_NODE_HYBRID ? pack_inputs(*L, ctx0, sched, cur, selected_experts) : selected_experts };
    ggml_tensor * node = ggml_custom_4d(ctx0, GGML_TYPE_I32, k, n_tokens, 1, 1, args, 1,
            remap ? expert_cache_node_remap : expert_cache_node_count, 1, &L->nodes[phase][kind]);
    ggml_format_name(node, "%s-%d", remap ? "spark_ec_remap" : "spark_ec_count", il);
    ggml_backend_sched_set_tensor_backend(sched, node, backend_cpu);
    L->building_node = &L->nodes[phase][kind];

    if (!remap) {
        L->building_count = node;
        return selected_experts;
    }
    L->building_remap = node;
    ggml_tensor * ids = node; // the slot ids: copied up as they are, or (hybrid) packed with the CPU's outputs
    if (hybrid) {
        ids = build_cpu_nodes(*L, ctx0, sched, backend_cpu, phase, node, *down_exps);
    }
    L->building_node->writes = 1;
    for (int i = 0; i < 4; ++i) {
        if (swap[i]) {
            *wts[i] = swap[i];
        }
    }
    return ids;
}

ggml_backend_t llama_expert_cache::backend_of(ggml_backend_sched_t sched, ggml_backend_dev_t dev) {
    ggml_backend_t res = nullptr;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
        ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
        if (ggml_backend_get_device(b) == dev) {
            res = b;
        }
    }
    return res;
}

// the banks that replace the layer's expert weights; false if the cache does not hold one of them
bool llama_expert_cache::bank_swaps(const llama_expert_cache_layer & L, ggml_tensor ** wts[4], ggml_tensor * swap[4]) {
    for (int i = 0; i < 4; ++i) {
        if (!wts[i] || !*wts[i]) {
            continue;
        }
        for (const auto & b : L.banks) {
            if (b.src == *wts[i]) {
                swap[i] = b.bank;
            }
        }
        if (swap[i] == nullptr) {
            return false;
        }
    }
    return true;
}

// the hybrid stop's one input, on the layer's device: per token the matmuls' input row, then its
// routed ids as F32 (exact below 2^24)
ggml_tensor * llama_expert_cache::pack_inputs(llama_expert_cache_layer & L, ggml_context * ctx0, ggml_backend_sched_t sched,
        ggml_tensor * cur, ggml_tensor * selected_experts) {
    ggml_tensor * ids_f = ggml_cast(ctx0, selected_experts, GGML_TYPE_F32);
    ggml_tensor * down  = ggml_concat(ctx0, cur, ids_f, 0); // [n_embd + k, n_tokens]
    ggml_format_name(down, "spark_ec_down-%d", L.il);
    ggml_backend_sched_set_tensor_backend(sched, ids_f, L.compute_backend);
    ggml_backend_sched_set_tensor_backend(sched, down, L.compute_backend);
    const int64_t kT = selected_experts->ne[0] * selected_experts->ne[1];
    if ((int64_t) L.sel.size() < kT) {
        L.sel.resize(kT); // at graph build, never in a step
    }
    return down;
}

// The CPU miss path's node: one output packing, per (token, expert) entry, the partial result of
// the missed entries (a row each), then the device entries' mask, then the slot ids as F32, each
// part starting on a row. The device copies it once and reads views of its copy (views of the host
// node itself would each be copied) and casts the slot ids back to I32 for the matmuls.
ggml_tensor * llama_expert_cache::build_cpu_nodes(llama_expert_cache_layer & L, ggml_context * ctx0, ggml_backend_sched_t sched,
        ggml_backend_t backend_cpu, int phase, ggml_tensor * node, ggml_tensor * down_exps) {
    const int64_t k        = node->ne[0];
    const int64_t n_tokens = node->ne[1];
    const int64_t kT       = k * n_tokens;
    const int64_t n_out    = down_exps->ne[1];
    const int64_t part_rows = (kT + n_out - 1) / n_out; // rows of the mask, and of the slot ids
    ggml_tensor * pargs[2] = { node, node->src[0] };
    L.building_partial = ggml_custom_4d(ctx0, GGML_TYPE_F32, n_out, kT + 2 * part_rows, 1, 1, pargs, 2,
            expert_cache_node_partial, GGML_N_TASKS_MAX, &L.nodes[phase][LLAMA_EXPERT_CACHE_NODE_HYBRID]); // every thread of the graph
    ggml_format_name(L.building_partial, "spark_ec_cpu-%d", L.il);
    ggml_backend_sched_set_tensor_backend(sched, L.building_partial, backend_cpu);

    ggml_tensor * dev = ggml_cont(ctx0, L.building_partial);
    ggml_format_name(dev, "spark_ec_up-%d", L.il);
    ggml_backend_sched_set_tensor_backend(sched, dev, L.compute_backend);
    const size_t row = dev->nb[1];
    L.building_part = ggml_view_3d(ctx0, dev, n_out, k, n_tokens, row, row * k, 0);
    // NOTE: 1 for an entry the device computed, 0 for one the CPU computed: a missed entry
    // reads a filler slot (no expert id twice in a token: device kernels assume that), and
    // its device output is dropped by this factor before the CPU's is added
    L.building_mask = ggml_view_3d(ctx0, dev, 1, k, n_tokens, sizeof(float), sizeof(float) * k, row * kT);
    ggml_tensor * slots_f = ggml_view_2d(ctx0, dev, k, n_tokens, sizeof(float) * k, row * (kT + part_rows));
    ggml_tensor * slots = ggml_cast(ctx0, slots_f, GGML_TYPE_I32);
    ggml_format_name(slots, "spark_ec_slots-%d", L.il);
    ggml_backend_sched_set_tensor_backend(sched, slots, L.compute_backend);
    if ((int64_t) L.missed.size() < kT) {
        L.missed.resize(kT); // at graph build, never in a step
    }
    return slots;
}

void llama_expert_cache::expand(ggml_cgraph * gf, int il) {
    llama_expert_cache_layer * L = layer(il);
    if (!L) {
        return;
    }
    // NOTE: one after the other, so the scheduler puts them in one CPU split: one stop per layer
    std::vector<ggml_tensor *> host;
    for (ggml_tensor * t : { L->building_count, L->building_remap, L->building_partial }) {
        if (t) {
            ggml_build_forward_expand(gf, t);
            host.push_back(t);
        }
    }
    // the device tensors they read: the scheduler copies each one down
    std::vector<const ggml_tensor *> reads;
    for (ggml_tensor * t : host) {
        for (const ggml_tensor * s : t->src) {
            if (s && std::find(host.begin(), host.end(), s) == host.end() && std::find(reads.begin(), reads.end(), s) == reads.end()) {
                reads.push_back(s);
            }
        }
    }
    if (L->building_node) {
        L->building_node->reads = (int32_t) reads.size();
    }
}

ggml_tensor * llama_expert_cache::finish(ggml_context * ctx0, int il, ggml_tensor * experts) {
    llama_expert_cache_layer * L = layer(il);
    if (!L || L->slots.n_slots == 0 || (!L->building_remap && !L->building_count)) {
        return experts; // not cached, warm-up, or not built through the cache
    }
    ggml_tensor * partial = L->building_part;
    ggml_tensor * mask    = L->building_mask;
    ggml_tensor * cur     = L->building_cur;
    if (L->cpu_ok < 0) {
        L->cpu_ok = analyse(*L, experts, L->building_sel, cur) ? 1 : 0;
        if (!L->cpu_ok) {
            LLAMA_LOG_WARN("expert cache: layer %d: its expert ops cannot run on the CPU miss path; misses are uploaded\n", il);
        }
    }
    L->building_remap = L->building_partial = L->building_count = L->building_cur = L->building_sel = nullptr;
    L->building_part = L->building_mask = nullptr;
    L->building_node = nullptr;
    if (!partial) {
        return experts;
    }
    size_workers(*L, partial->ne[1] * partial->ne[2], cur->ne[0]);
    ggml_tensor * out = ggml_add(ctx0, ggml_mul(ctx0, experts, mask), partial);
    ggml_format_name(out, "spark_ec_join-%d", il);
    return out;
}

void llama_expert_cache::size_workers(const llama_expert_cache_layer & L, int64_t n_entries, int64_t n_embd_in) {
    // NOTE: at graph build; a step only resets these contexts (ggml_init allocates). A worker's share
    // of a step's entries is at most ceil(n_entries / W): one pass holds it.
    const int64_t W = (int64_t) workers.size();
    const int64_t rows = std::max<int64_t>(1, (n_entries + W - 1) / W);
    size_t need = ggml_graph_overhead_custom(RECIPE_MAX * 2, false) + ggml_tensor_overhead() * (RECIPE_MAX * 2 + 8) + 4096;
    need += GGML_PAD(ggml_row_size(GGML_TYPE_F32, n_embd_in) * rows, 64) + GGML_PAD(sizeof(int32_t) * rows, 64) + 128;
    for (const auto & r : L.recipe) {
        if (r.op != GGML_OP_VIEW) {
            need += GGML_PAD(ggml_row_size(r.type, r.ne0) * rows, 64) + 64;
        }
    }
    for (auto & w : workers) {
        if (w.arena.size() >= need && w.ctx) {
            w.rows = std::max(w.rows, rows);
            continue;
        }
        if (w.ctx) {
            ggml_free(w.ctx);
        }
        w.arena.resize(std::max(w.arena.size(), need));
        ggml_init_params ip = { /*.mem_size =*/ w.arena.size(), /*.mem_buffer =*/ w.arena.data(), /*.no_alloc =*/ false };
        w.ctx = ggml_init(ip);
        GGML_ASSERT(w.ctx);
        w.rows = std::max(w.rows, rows);
    }
}

bool llama_expert_cache::analyse(llama_expert_cache_layer & L, ggml_tensor * experts, ggml_tensor * sel, ggml_tensor * cur) {
    if (!cur || cur->type != GGML_TYPE_F32 || cur->nb[0] != sizeof(float) || experts->op != GGML_OP_MUL_MAT_ID) {
        return false;
    }
    std::vector<ggml_tensor *> order;
    if (!recipe_order(L, experts, sel, cur, order)) {
        return false;
    }
    std::vector<llama_expert_cache_recipe_op> recipe(order.size());
    for (size_t i = 0; i < order.size(); ++i) {
        const ggml_tensor * t = order[i];
        auto & r = recipe[i];
        r.op   = t->op;
        r.type = t->type;
        r.ne0  = t->ne[0];
        memcpy(r.op_params, t->op_params, sizeof(r.op_params));
        r.view_offs = t->op == GGML_OP_VIEW ? t->view_offs : 0;
        for (int j = 0; j < GGML_MAX_SRC; ++j) {
            if (t->src[j] && !recipe_src(L, order, i, j, r.src[j])) {
                return false;
            }
        }
    }
    L.recipe = std::move(recipe);
    return true;
}

// the ops from the matmuls' input to the down projection, sources first
bool llama_expert_cache::recipe_order(const llama_expert_cache_layer & L, ggml_tensor * experts, ggml_tensor * sel,
        ggml_tensor * cur, std::vector<ggml_tensor *> & order) {
    const int64_t k = sel->ne[0];
    const int64_t T = sel->ne[1];
    std::unordered_set<const ggml_tensor *> visited;
    ggml_tensor * ids  = nullptr;
    ggml_tensor * x_in = nullptr;
    bool ok = true;

    auto is_input = [&](const ggml_tensor * t) {
        return t == cur || (t->view_src == cur && ggml_nelements(t) == ggml_nelements(cur) && t->ne[1] == 1);
    };
    std::function<void(ggml_tensor *)> visit = [&](ggml_tensor * t) {
        if (!ok || !t || visited.count(t)) {
            return;
        }
        visited.insert(t);
        if (t->op == GGML_OP_NONE) {
            ok = t->buffer != nullptr; // a model tensor, not some other input
            return;
        }
        if (!recipe_op_ok(t->op) || t->ne[1] != k || t->ne[2] != T || t->ne[3] != 1) {
            ok = false;
            return;
        }
        if (t->op == GGML_OP_MUL_MAT_ID) {
            ids = ids ? ids : t->src[2];
            ok = ok && t->src[2] == ids && host_of(L, t->src[0]) != nullptr;
            if (is_input(t->src[1])) {
                ok = ok && (x_in == nullptr || x_in == t->src[1]);
                x_in = t->src[1];
            } else {
                visit(t->src[1]);
            }
        } else if (t->op == GGML_OP_ADD_ID) {
            ok = ok && t->src[2] == sel && t->src[1]->op == GGML_OP_NONE;
            visit(t->src[0]);
            visit(t->src[1]);
        } else if (t->op == GGML_OP_VIEW) {
            ggml_tensor * p = t->view_src;
            ok = ok && p && t->src[0] == p && t->nb[0] == ggml_type_size(t->type) &&
                 t->nb[1] == p->nb[1] && t->nb[2] == p->nb[2] && t->view_offs < p->nb[1];
            visit(p);
        } else {
            for (ggml_tensor * s : t->src) {
                visit(s);
            }
        }
        order.push_back(t);
    };
    visit(experts);
    return ok && ids != nullptr && x_in != nullptr && !order.empty() && order.back() == experts && order.size() <= RECIPE_MAX;
}

// where source j of op i of the recipe comes from; false if the CPU cannot read it
bool llama_expert_cache::recipe_src(const llama_expert_cache_layer & L, const std::vector<ggml_tensor *> & order, size_t i,
        int j, llama_expert_cache_recipe_src & rs) {
    const ggml_tensor * t = order[i];
    ggml_tensor * s = t->src[j];
    auto it = std::find(order.begin(), order.begin() + i, s);
    if (it != order.begin() + i) {
        rs.kind = LLAMA_EXPERT_CACHE_SRC_OP;
        rs.op   = (int32_t) (it - order.begin());
    } else if (t->op == GGML_OP_MUL_MAT_ID && j == 1) {
        rs.kind = LLAMA_EXPERT_CACHE_SRC_INPUT;
    } else if ((t->op == GGML_OP_MUL_MAT_ID || t->op == GGML_OP_ADD_ID) && j == 2) {
        rs.kind = LLAMA_EXPERT_CACHE_SRC_IDS;
    } else if (ggml_tensor * h = host_of(L, s)) {
        rs.kind   = LLAMA_EXPERT_CACHE_SRC_HOST;
        rs.tensor = h;
    } else if (s->op == GGML_OP_NONE && ggml_backend_buffer_is_host(s->buffer)) {
        rs.kind   = LLAMA_EXPERT_CACHE_SRC_HOST;
        rs.tensor = s;
    } else if (s->op == GGML_OP_NONE && ggml_nbytes(s) <= MIRROR_MAX && ggml_is_contiguous(s)) {
        // NOTE: small device weights (per-expert biases) are read from a host copy made once
        auto & m = host_mirror[s];
        m.resize(ggml_nbytes(s));
        if (!dry) { // a dry run has no weights to copy (its graph is never computed)
            ggml_backend_tensor_get(s, m.data(), 0, m.size());
        }
        rs.kind   = LLAMA_EXPERT_CACHE_SRC_MIRROR;
        rs.tensor = s;
    } else {
        return false;
    }
    return true;
}

// the step's routed ids: the I32 selection itself, or (hybrid) the last k columns of the packed F32
// input, converted into L.sel (the CPU miss path reads them there too)
llama_expert_cache_ids llama_expert_cache::routed_ids(llama_expert_cache_layer & L, const ggml_tensor * src, int64_t k) {
    llama_expert_cache_ids v;
    v.k        = k;
    v.n_tokens = src->ne[1];
    if (src->type == GGML_TYPE_I32) {
        v.data = src->data;
        v.nb0  = src->nb[0];
        v.nb1  = src->nb[1];
        return v;
    }
    GGML_ASSERT(src->type == GGML_TYPE_F32 && src->ne[0] > k && (int64_t) L.sel.size() >= k * v.n_tokens);
    const int64_t col = src->ne[0] - k;
    for (int64_t t = 0; t < v.n_tokens; ++t) {
        const float * row = (const float *) ((const char *) src->data + t * src->nb[1]);
        for (int64_t j = 0; j < k; ++j) {
            L.sel[t * k + j] = (int32_t) row[col + j];
        }
    }
    v.data = L.sel.data();
    v.nb0  = sizeof(int32_t);
    v.nb1  = sizeof(int32_t) * k;
    return v;
}

void llama_expert_cache::step(llama_expert_cache_node & n, const ggml_tensor * ids, ggml_tensor * dst, bool remap) {
    llama_expert_cache_layer & L = *n.layer;
    const llama_expert_cache_ids v = routed_ids(L, ids, dst->ne[0]);

    std::unique_lock<std::mutex> lock(mutex);
    count_step(L, n.phase, v);
    if (L.on_device) {
        L.stats.stop_reads  += n.reads;
        L.stats.stop_writes += n.writes;
    }
    if (!remap) {
        if (L.slots.n_slots > 0) {
            L.stats.steps_stock++;
        }
        return;
    }
    L.stats.steps_cached++;

    const bool hybrid = n.hybrid && !L.recipe.empty();
    const llama_expert_cache_mode m = L.slots.mode(v.n_tokens, v.k, n.phase == LLAMA_EXPERT_CACHE_PHASE_DECODE, hybrid);
    if (!m.read_only) {
        wait_admissions(L);
    }
    llama_expert_cache_outcome o;
    if (const char * err = L.slots.step(v, m, o)) {
        GGML_ABORT("expert cache: %s", err);
    }
    L.stats.hits             += o.hits;
    L.stats.misses           += o.misses;
    L.stats.admit_skipped    += o.skipped;
    L.stats.cpu_experts      += o.n_cpu;
    L.stats.cpu_expert_bytes += (uint64_t) o.n_cpu * L.expert_bytes;

    // slot ids for the expert matmuls (dst is contiguous [k, n_tokens])
    uint8_t * missed = n.hybrid && (int64_t) L.missed.size() >= v.n_tokens * v.k ? L.missed.data() : nullptr;
    bool any_wait = false;
    if (const char * err = L.slots.remap(v, (int32_t *) dst->data, missed, any_wait)) {
        GGML_ABORT("expert cache: %s", err);
    }

    // NOTE: uploads run without the lock; only this thread changes the slots
    lock.unlock();
    upload_staged(L, o.n_staged);
    upload_admissions(L, o.n_admit, m.to_cpu && L.upload_backend != nullptr, any_wait);
}

// the step's staged misses into its staging slices: on the upload queue, the device's compute
// waiting only for their event, or blocking. NOTE: a slice is reused by the layer's next step only
// after its host node saw this step's ids, so after the device finished the matmuls reading it.
void llama_expert_cache::upload_staged(llama_expert_cache_layer & L, int32_t n_staged) {
    if (n_staged == 0) {
        return;
    }
    const bool background = L.slots.costs.concurrent && L.compute_backend != nullptr;
    uint64_t bytes = 0, blocking = 0;
    for (int32_t i = 0; i < n_staged; ++i) {
        const int32_t e = L.slots.stage_expert[i];
        const size_t  s = (size_t) (L.slots.stage_base + i);
        for (auto & b : L.banks) {
            const size_t nb = b.src->nb[2];
            const void * src = (const char *) b.src->data + (size_t) e * nb;
            if (background) {
                ggml_backend_tensor_set_async(L.upload_backend, b.bank, src, s * nb, nb);
            } else {
                ggml_backend_tensor_set(b.bank, src, s * nb, nb);
                blocking++;
            }
            bytes += nb;
        }
    }
    if (background) {
        ggml_backend_event_record(L.stage_event, L.upload_backend);
        ggml_backend_event_wait(L.compute_backend, L.stage_event);
    }
    std::lock_guard<std::mutex> lock(mutex);
    L.stats.staged_uploads      += n_staged;
    L.stats.staged_upload_bytes += bytes;
    L.stats.blocking_calls      += blocking;
}

// routing counts and the trace, for every step of a counted layer (under the lock)
void llama_expert_cache::count_step(llama_expert_cache_layer & L, int phase, const llama_expert_cache_ids & ids) {
    if (L.on_device) {
        L.stats.syncs++; // the scheduler waited for the device to copy the ids here
    }
    for (int64_t t = 0; t < ids.n_tokens; ++t) {
        for (int64_t j = 0; j < ids.k; ++j) {
            const int32_t e = ids.at(t, j);
            if (e >= 0 && e < n_expert) {
                L.counts[phase][e]++;
            }
        }
    }
    if (!trace_on) {
        return;
    }
    const int64_t len = 4 + ids.n_tokens * ids.k;
    if ((int64_t) trace.size() + len > trace_max) {
        trace_dropped++;
        return;
    }
    trace.push_back(L.il);
    trace.push_back((int32_t) ids.n_tokens);
    trace.push_back((int32_t) ids.k);
    trace.push_back(phase);
    for (int64_t t = 0; t < ids.n_tokens; ++t) {
        for (int64_t j = 0; j < ids.k; ++j) {
            trace.push_back(ids.at(t, j));
        }
    }
}

// admissions of earlier steps land at the layer's next step that may change the slots (a decode
// step): order the device after their uploads
// (under the lock)
void llama_expert_cache::wait_admissions(llama_expert_cache_layer & L) {
    for (int32_t s = L.slots.n_pinned; s < L.slots.n_slots; ++s) {
        if (L.slots.slot_state[s] == LLAMA_EXPERT_CACHE_SLOT_PENDING && L.slot_event[s] && L.upload_backend) {
            if (L.compute_backend) {
                ggml_backend_event_wait(L.compute_backend, L.slot_event[s]);
            } else {
                ggml_backend_event_synchronize(L.slot_event[s]);
                L.stats.blocking_calls++;
            }
        }
    }
}

// the step's placements (upload path: blocking) or admissions (CPU path: in the background when
// the device has a second backend), then the waits for pending slots read as fillers
void llama_expert_cache::upload_admissions(llama_expert_cache_layer & L, int32_t n_admit, bool background, bool any_wait) {
    uint64_t bytes = 0, blocking = 0;
    const int64_t t0 = ggml_time_us();
    for (int32_t a = 0; a < n_admit; ++a) {
        const int32_t e = L.slots.admit[2 * a];
        const int32_t s = L.slots.admit[2 * a + 1];
        for (auto & b : L.banks) {
            const size_t nb = b.src->nb[2];
            const void * src = (const char *) b.src->data + (size_t) e * nb;
            if (background) {
                ggml_backend_tensor_set_async(L.upload_backend, b.bank, src, (size_t) s * nb, nb);
            } else {
                ggml_backend_tensor_set(b.bank, src, (size_t) s * nb, nb);
                blocking++;
            }
            bytes += nb;
        }
        if (background) {
            ggml_backend_event_record(L.slot_event[s], L.upload_backend);
        }
    }
    // a pending slot read as a filler: the device reads it after its upload (rare: a token needing
    // more fillers than the guard and the landed slots it does not read)
    for (int32_t s = L.slots.n_pinned; any_wait && s < L.slots.n_slots; ++s) {
        if (L.slots.filler_wait[s]) {
            L.slots.filler_wait[s] = 0;
            if (L.slot_event[s] && L.upload_backend && L.compute_backend) {
                ggml_backend_event_wait(L.compute_backend, L.slot_event[s]);
            }
        }
    }
    const int64_t dt = ggml_time_us() - t0;
    std::lock_guard<std::mutex> lock(mutex);
    L.stats.uploads        += n_admit;
    L.stats.bytes_uploaded += bytes;
    L.stats.blocking_calls += blocking;
    if (background) {
        L.stats.async_uploads      += n_admit;
        L.stats.async_upload_bytes += bytes;
    } else {
        L.stats.blocking_upload_bytes += bytes;
        L.stats.upload_us             += dt;
    }
}

void llama_expert_cache::compute_partial(llama_expert_cache_node & n, ggml_tensor * dst, int ith, int nth) {
    llama_expert_cache_layer & L = *n.layer;
    const ggml_tensor * slots = dst->src[0]; // [k, n_tokens] contiguous, from the remap node
    const int32_t * sel = L.sel.data();      // [k * n_tokens], the routed ids the remap node read
    const int64_t k  = slots->ne[0];
    const int64_t kT = k * slots->ne[1];
    const int64_t n_embd_out = dst->ne[0];
    const uint8_t * missed = L.missed.data(); // written by the remap node of this step
    GGML_ASSERT((int64_t) L.missed.size() >= kT);
    int64_t zero = 0;
    cpu_t0.compare_exchange_strong(zero, ggml_time_us());
    const bool cpu = !L.recipe.empty() && !workers.empty();
    int64_t n_miss = 0;
    for (int64_t i = 0; i < kT; ++i) {
        n_miss += missed[i];
    }
    // the node's last thread to finish (also on an exception) adds the wall time from the first start
    struct last_out {
        llama_expert_cache & ec; llama_expert_cache_layer & L; int nth; bool timed; int64_t entries;
        ~last_out() {
            if (ec.cpu_done.fetch_add(1) + 1 == nth) {
                const int64_t us = ggml_time_us() - ec.cpu_t0.exchange(0);
                ec.cpu_done.store(0);
                if (timed) {
                    std::lock_guard<std::mutex> lock(ec.mutex);
                    L.stats.cpu_us      += us;
                    L.stats.cpu_entries += entries;
                }
            }
        }
    } out_guard{*this, L, nth, cpu && n_miss > 0, n_miss};

    // each thread zeroes its range of the device's entries (row t*k + j); a missed entry is written by
    // its expert's worker
    for (int64_t i = kT * ith / nth; i < kT * (ith + 1) / nth; ++i) {
        if (!missed[i] || !cpu) {
            memset((char *) dst->data + i * dst->nb[1], 0, n_embd_out * sizeof(float));
        }
    }
    if (ith == nth - 1) {
        write_tail(L, dst);
    }
    const int64_t W = std::min<int64_t>(nth, (int64_t) workers.size());
    if (cpu && n_miss > 0 && ith < W) {
        // the missed entries in (expert, entry) order, split evenly by count; every thread derives the
        // same order. An expert's entries may span two workers: the CPU kernel's output for an entry is
        // its own dot products with the expert's rows, whatever other entries share the pass.
        auto & w = workers[ith];
        auto id_of = [&](int64_t i) { return sel[i]; };
        std::fill(w.expert_rows.begin(), w.expert_rows.end(), 0);
        for (int64_t i = 0; i < kT; ++i) {
            if (missed[i]) {
                w.expert_rows[id_of(i)]++;
            }
        }
        int64_t at = 0;
        for (int64_t e = 0; e < n_expert; ++e) { // counts -> each expert's first position
            const int64_t c = w.expert_rows[e];
            w.expert_rows[e] = at;
            at += c;
        }
        const int64_t r0 = n_miss * ith / W, r1 = n_miss * (ith + 1) / W;
        w.order.resize(r1 - r0);
        for (int64_t i = 0; i < kT; ++i) {
            if (missed[i]) {
                const int64_t pos = w.expert_rows[id_of(i)]++;
                if (pos >= r0 && pos < r1) {
                    w.order[pos - r0] = i;
                }
            }
        }
        compute_entries(w, L, dst);
    }
}

// One worker's missed entries (w.order: index t*k + j, grouped by expert), in passes that fit its arena.
void llama_expert_cache::compute_entries(llama_expert_cache_worker & w, llama_expert_cache_layer & L, ggml_tensor * dst) {
    const ggml_tensor * cur = dst->src[1]; // [n_embd + k, n_tokens]: the input rows, then the routed ids
    const int64_t k = dst->src[0]->ne[0];
    const int64_t n_embd_in  = cur->ne[0] - k;
    const int64_t n_embd_out = dst->ne[0];
    const int64_t n = (int64_t) w.order.size();
    GGML_ASSERT(w.rows > 0);
    for (int64_t p0 = 0; p0 < n; p0 += w.rows) {
        const int64_t rows = std::min(w.rows, n - p0);
        ggml_context * pctx = w.ctx;
        ggml_reset(pctx);

        // the pass's entries, one row each: their input row and their expert id
        ggml_tensor * x  = ggml_new_tensor_3d(pctx, GGML_TYPE_F32, n_embd_in, rows, 1);
        ggml_tensor * xi = ggml_new_tensor_2d(pctx, GGML_TYPE_I32, rows, 1);
        for (int64_t m = 0; m < rows; ++m) {
            const int64_t i = w.order[p0 + m], t = i / k, j = i % k;
            memcpy((char *) x->data + m * x->nb[1], (const char *) cur->data + t * cur->nb[1], n_embd_in * sizeof(float));
            ((int32_t *) xi->data)[m] = L.sel[t * k + j];
        }
        ggml_tensor * res = build_recipe(L, pctx, x, xi, rows); // [n_embd, rows, 1]
        GGML_ASSERT(res->ne[0] == n_embd_out);
        ggml_cgraph * gf = ggml_new_graph_custom(pctx, RECIPE_MAX * 2, false);
        ggml_build_forward_expand(gf, res);
        const ggml_status st = ggml_backend_graph_compute(w.backend, gf);
        GGML_ASSERT(st == GGML_STATUS_SUCCESS);

        // each entry's output goes where the device's is dropped
        for (int64_t m = 0; m < rows; ++m) {
            const int64_t i = w.order[p0 + m], t = i / k, j = i % k;
            memcpy((char *) dst->data + (t * k + j) * dst->nb[1], (const char *) res->data + m * res->nb[1],
                   n_embd_out * sizeof(float));
        }
    }
}

// the recipe's ops on [.., n_miss, 1] instead of [.., k, n_tokens]: per entry the same arithmetic
ggml_tensor * llama_expert_cache::build_recipe(const llama_expert_cache_layer & L, ggml_context * pctx, ggml_tensor * x,
        ggml_tensor * xi, int64_t n_miss) {
    ggml_tensor * ops[RECIPE_MAX];
    const size_t n_ops = L.recipe.size();
    for (size_t i = 0; i < n_ops; ++i) {
        const auto & r = L.recipe[i];
        ggml_tensor * src[GGML_MAX_SRC] = {};
        for (int j = 0; j < GGML_MAX_SRC; ++j) {
            const auto & rs = r.src[j];
            switch (rs.kind) {
                case LLAMA_EXPERT_CACHE_SRC_OP:    src[j] = ops[rs.op]; break;
                case LLAMA_EXPERT_CACHE_SRC_INPUT: src[j] = x;          break;
                case LLAMA_EXPERT_CACHE_SRC_IDS:   src[j] = xi;         break;
                case LLAMA_EXPERT_CACHE_SRC_HOST:  src[j] = rs.tensor;  break;
                case LLAMA_EXPERT_CACHE_SRC_MIRROR: {
                    ggml_set_no_alloc(pctx, true);
                    src[j] = ggml_new_tensor(pctx, rs.tensor->type, GGML_MAX_DIMS, rs.tensor->ne);
                    ggml_set_no_alloc(pctx, false);
                    src[j]->data = host_mirror.at(rs.tensor).data();
                } break;
                default: break;
            }
        }
        ggml_tensor * c;
        if (r.op == GGML_OP_VIEW) {
            ggml_tensor * p = src[0];
            c = ggml_view_4d(pctx, p, r.ne0, n_miss, 1, 1, p->nb[1], p->nb[2], p->nb[3], r.view_offs);
        } else {
            c = ggml_new_tensor_3d(pctx, r.type, r.ne0, n_miss, 1);
            c->op = r.op;
            memcpy(c->op_params, r.op_params, sizeof(r.op_params));
            for (int j = 0; j < GGML_MAX_SRC; ++j) {
                c->src[j] = src[j];
            }
        }
        ops[i] = c;
    }
    return ops[n_ops - 1];
}

// after the entries' rows of the packed output: the mask, then the slot ids as F32 (build_cpu_nodes)
void llama_expert_cache::write_tail(const llama_expert_cache_layer & L, ggml_tensor * dst) {
    const ggml_tensor * slots = dst->src[0]; // [k, n_tokens] contiguous
    const int64_t kT   = slots->ne[0] * slots->ne[1];
    const int64_t rows = (kT + dst->ne[0] - 1) / dst->ne[0];
    GGML_ASSERT((int64_t) L.missed.size() >= kT && dst->ne[1] == kT + 2 * rows);
    float * mask = (float *) ((char *) dst->data + kT * dst->nb[1]);
    float * ids  = (float *) ((char *) dst->data + (kT + rows) * dst->nb[1]);
    const int32_t * s = (const int32_t *) slots->data;
    for (int64_t i = 0; i < kT; ++i) {
        mask[i] = L.missed[i] ? 0.0f : 1.0f;
        ids[i]  = (float) s[i];
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
    p.policy_window = 16;
    p.slru_protected_num = 3;
    p.slru_protected_den = 4;
    p.n_stage       = 0;
    p.count_uncached = true;
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
