// Spark expert cache: banks of expert slots on the device, an exact LRU over them, host
// graph nodes that plan each step and remap routed ids to slot ids, and a CPU miss path
// that computes non-resident experts from the host weights with the ggml CPU kernels.
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
    (void) nth;
    if (ith == 0) {
        auto * n = (llama_expert_cache_node *) userdata;
        guarded(n->layer->owner, "cpu miss path", [&] { n->layer->owner->compute_partial(*n, dst); });
    }
}

void expert_cache_node_mask(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith == 0) {
        auto * n = (llama_expert_cache_node *) userdata;
        guarded(n->layer->owner, "cpu miss mask", [&] { n->layer->owner->compute_mask(*n, dst); });
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

const size_t MIRROR_MAX = (size_t) 64 << 20; // device leaves (biases) copied to the host at most this big
constexpr size_t RECIPE_MAX = 32;         // ops between the expert matmuls' input and the down projection

} // namespace

llama_expert_cache::llama_expert_cache(const llama_model & model) : model(model) {}

llama_expert_cache::~llama_expert_cache() {
    for (auto & [dev, b] : upload_backends) {
        (void) dev;
        ggml_backend_synchronize(b);
    }
    for (auto & L : layers) {
        if (L) {
            for (ggml_backend_event_t ev : L->slot_event) {
                if (ev) {
                    ggml_backend_event_free(ev);
                }
            }
        }
    }
    for (auto & [dev, b] : upload_backends) {
        (void) dev;
        ggml_backend_free(b);
    }
    if (cpu_backend) {
        ggml_backend_free(cpu_backend);
    }
    if (arena_ctx) {
        ggml_free(arena_ctx);
    }
}

llama_expert_cache_layer * llama_expert_cache::layer(int32_t il) {
    if (il < 0 || (size_t) il >= layers.size()) {
        return nullptr;
    }
    return layers[il].get();
}

int32_t llama_expert_cache::init(const llama_expert_cache_params & params, std::string & err) {
    const auto & hp = model.hparams;
    const int32_t n_layer = (int32_t) hp.n_layer();
    n_expert  = (int32_t) hp.n_expert;
    trace_on  = params.trace;
    trace_max = params.trace_max > 0 ? params.trace_max : 0;
    n_threads = params.n_threads > 0 ? params.n_threads : 1;
    policy_window = params.policy_window > 0 ? params.policy_window : 0;
    if (params.slru_protected_num < 0 || params.slru_protected_den <= 0 || params.slru_protected_num > params.slru_protected_den) {
        err = "invalid parameters: slru_protected_num / slru_protected_den must be a share in [0, 1]";
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
        L->seen.assign(n_expert, 0);
        L->distinct.assign(n_expert, 0);
        L->admit.assign(2 * (size_t) n_expert, 0);
        for (int ph = 0; ph < 2; ++ph) {
            for (int hy = 0; hy < 2; ++hy) {
                L->nodes[ph][hy] = { L.get(), ph, hy == 1 };
            }
        }
        layers[il] = std::move(L);
    }

    // validate every cached layer before allocating anything
    std::map<ggml_backend_buffer_type_t, size_t> need; // bytes per device buffer type
    std::map<ggml_backend_buffer_type_t, ggml_backend_dev_t> buft_dev;
    bool warned_pinned = false;
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
        if (lp.miss_path != LLAMA_EXPERT_CACHE_MISS_UPLOAD && lp.miss_path != LLAMA_EXPERT_CACHE_MISS_CPU) {
            err = fmt("layer %d: unknown miss path %d", lp.il, lp.miss_path);
            return LLAMA_EXPERT_CACHE_ERR_ARG;
        }
        if (lp.policy < LLAMA_EXPERT_CACHE_POLICY_LRU || lp.policy > LLAMA_EXPERT_CACHE_POLICY_TINYLFU) {
            err = fmt("layer %d: unknown policy %d", lp.il, lp.policy);
            return LLAMA_EXPERT_CACHE_ERR_ARG;
        }

        ggml_backend_dev_t dev = model.dev_layer(lp.il);
        if (!is_gpu(dev)) {
            err = fmt("layer %d runs on %s, not on a GPU-type device: offload the layer (n_gpu_layers) to cache it",
                    lp.il, dev ? ggml_backend_dev_name(dev) : "the CPU");
            return LLAMA_EXPERT_CACHE_ERR_PLACEMENT;
        }
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
        buft_dev[buft] = dev;
        ggml_backend_buffer_type_t host_buft = ggml_backend_dev_host_buffer_type(dev);

        const auto & ml = model.layers[lp.il];
        size_t expert_bytes = 0;
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
            if (host_buft && ggml_backend_buffer_get_type(t->buffer) != host_buft && !warned_pinned) {
                warned_pinned = true;
                LLAMA_LOG_WARN("expert cache: %s is in %s, not in %s's pinned host memory: uploads are slower and cannot overlap\n",
                        t->name, ggml_backend_buffer_name(t->buffer), ggml_backend_buft_name(host_buft));
            }
            expert_bytes += t->nb[2];
            need[buft] += GGML_PAD(t->nb[2] * (size_t) (lp.n_slots + 1), ggml_backend_buft_get_alignment(buft));
        }
        L->n_slots      = lp.n_slots;
        L->n_pinned     = lp.n_pinned;
        L->miss_path    = lp.miss_path;
        L->max_admit    = lp.max_admit < 0 ? k : lp.max_admit;
        L->policy       = lp.policy;
        L->protected_cap = (lp.n_slots - lp.n_pinned) * params.slru_protected_num / params.slru_protected_den;
        L->expert_bytes = expert_bytes;
    }

    for (const auto & [buft, bytes] : need) {
        size_t budget = params.device_budget;
        if (budget == 0) {
            // NOTE: never all free memory: compute buffers, pools and graphs allocate after the banks
            size_t free = 0, total = 0;
            ggml_backend_dev_memory(buft_dev[buft], &free, &total);
            budget = free > params.device_margin ? free - params.device_margin : 0;
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
        ggml_backend_dev_t dev = model.dev_layer(L.il);
        ggml_context * c = bctx[ggml_backend_dev_buffer_type(dev)];
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
        L.slot_state.assign(L.n_slots, LLAMA_EXPERT_CACHE_SLOT_FREE);
        L.slot_tick.assign(L.n_slots, 0);
        L.slot_step.assign(L.n_slots, 0);
        L.filler_wait.assign(L.n_slots, 0);
        L.slot_seg.assign(L.n_slots, 0);
        L.freq.assign(n_expert, 0);
        L.slot_event.assign(L.n_slots, nullptr);
        L.expert_slot.assign(n_expert, -1);

        // background admissions: a second backend on the device (its own stream) and an event per slot
        if (upload_backends.find(dev) == upload_backends.end()) {
            ggml_backend_t ub = ggml_backend_dev_init(dev, nullptr);
            upload_backends[dev] = ub;
            if (!ub) {
                LLAMA_LOG_WARN("expert cache: no second backend on %s: admissions upload synchronously\n", ggml_backend_dev_name(dev));
            }
        }
        L.upload_backend = upload_backends[dev];
        if (L.upload_backend) {
            for (int32_t s = L.n_pinned; s < L.n_slots; ++s) {
                L.slot_event[s] = ggml_backend_event_new(dev);
                if (!L.slot_event[s]) {
                    L.upload_backend = nullptr; // no events: admissions upload synchronously
                    break;
                }
            }
        }
    }
    for (const auto & [buft, c] : bctx) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
        if (!buf) {
            err = fmt("could not allocate %.3f GiB of expert banks on %s", need[buft] / 1073741824.0, ggml_backend_buft_name(buft));
            return LLAMA_EXPERT_CACHE_ERR_NO_MEMORY;
        }
        // NOTE: weights usage, so the scheduler keeps the expert matmuls on the bank's device
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_buffer_clear(buf, 0); // zeroed guard slices (and empty slots)
        device_bytes += ggml_backend_buffer_get_size(buf);
        bufs.emplace_back(buf);
    }

    // the CPU miss path's private backend (never the context's: its threads run the host nodes)
    cpu_backend = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    if (cpu_backend) {
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(ggml_backend_get_device(cpu_backend));
        auto set_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
        if (set_threads) {
            set_threads(cpu_backend, n_threads);
        }
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
            L.slot_state[j]  = LLAMA_EXPERT_CACHE_SLOT_READY;
            L.expert_slot[e] = j;
        }
    }
    if (trace_on) {
        trace.reserve((size_t) std::min<int64_t>(trace_max, (int64_t) 1 << 20));
    }
    return LLAMA_EXPERT_CACHE_OK;
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
    const int phase = n_ubatch_tokens == 1 ? LLAMA_EXPERT_CACHE_PHASE_DECODE : LLAMA_EXPERT_CACHE_PHASE_PREFILL;
    L->building_remap = L->building_partial = L->building_mask = L->building_count = nullptr;
    L->building_cur = cur;

    // NOTE: warm-up routes every expert (n_expert_used = n_expert): leave it stock and uncounted
    if (k != (int64_t) model.hparams.n_expert_used(il)) {
        return selected_experts;
    }

    if (L->n_slots > 0 && !L->compute_backend) {
        ggml_backend_dev_t dev = model.dev_layer(il);
        for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
            ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
            if (ggml_backend_get_device(b) == dev) {
                L->compute_backend = b;
            }
        }
    }

    // NOTE: decided when the graph is built. With the CPU miss path (known once a graph of this
    // layer was analysed, see finish) any ubatch is remapped: misses read filler slots and go to
    // the CPU. Without it, a step whose ids may not all fit the LRU slots takes the stock path.
    const bool fits   = n_tokens * k <= L->n_slots - L->n_pinned;
    const bool hybrid = L->cpu_ok == 1 && !L->recipe.empty() && cur != nullptr && cpu_backend != nullptr &&
                        down_exps && *down_exps;
    bool remap = can_remap && L->n_slots > 0 && (fits || hybrid);

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
            remap ? expert_cache_node_remap : expert_cache_node_count, 1, &L->nodes[phase][remap && hybrid]);
    ggml_format_name(node, "%s-%d", remap ? "spark_ec_remap" : "spark_ec_count", il);
    ggml_backend_sched_set_tensor_backend(sched, node, backend_cpu);

    if (!remap) {
        L->building_count = node;
        return selected_experts;
    }
    L->building_remap = node;
    if (hybrid) {
        ggml_tensor * pargs[3] = { node, cur, selected_experts };
        L->building_partial = ggml_custom_4d(ctx0, GGML_TYPE_F32, (*down_exps)->ne[1], k, n_tokens, 1, pargs, 3,
                expert_cache_node_partial, 1, &L->nodes[phase][1]);
        ggml_format_name(L->building_partial, "spark_ec_cpu-%d", il);
        ggml_backend_sched_set_tensor_backend(sched, L->building_partial, backend_cpu);
        // NOTE: 1 for an entry the device computed, 0 for one the CPU computed: a missed entry
        // reads a filler slot (no expert id twice in a token: device kernels assume that), and
        // its device output is dropped by this factor before the CPU's is added
        ggml_tensor * margs[1] = { node };
        L->building_mask = ggml_custom_4d(ctx0, GGML_TYPE_F32, 1, k, n_tokens, 1, margs, 1,
                expert_cache_node_mask, 1, &L->nodes[phase][1]);
        ggml_format_name(L->building_mask, "spark_ec_mask-%d", il);
        ggml_backend_sched_set_tensor_backend(sched, L->building_mask, backend_cpu);
        if ((int64_t) L->missed.size() < k * n_tokens) {
            L->missed.resize(k * n_tokens); // at graph build, never in a step
        }
    }
    for (int i = 0; i < 4; ++i) {
        if (swap[i]) {
            *wts[i] = swap[i];
        }
    }
    return node;
}

void llama_expert_cache::expand(ggml_cgraph * gf, int il) {
    llama_expert_cache_layer * L = layer(il);
    if (!L) {
        return;
    }
    // NOTE: one after the other, so the scheduler puts them in one CPU split: one stop per layer
    for (ggml_tensor * t : { L->building_count, L->building_remap, L->building_partial, L->building_mask }) {
        if (t) {
            ggml_build_forward_expand(gf, t);
        }
    }
}

ggml_tensor * llama_expert_cache::finish(ggml_context * ctx0, int il, ggml_tensor * experts) {
    llama_expert_cache_layer * L = layer(il);
    if (!L || L->n_slots == 0 || (!L->building_remap && !L->building_count)) {
        return experts; // not cached, warm-up, or not built through the cache
    }
    ggml_tensor * partial = L->building_partial;
    ggml_tensor * mask    = L->building_mask;
    if (L->cpu_ok < 0) {
        ggml_tensor * sel = (L->building_remap ? L->building_remap : L->building_count)->src[0];
        L->cpu_ok = analyse(*L, experts, sel, L->building_cur) ? 1 : 0;
        if (!L->cpu_ok) {
            LLAMA_LOG_WARN("expert cache: layer %d: its expert ops cannot run on the CPU miss path; misses are uploaded\n", il);
        }
    }
    L->building_remap = L->building_partial = L->building_mask = L->building_count = L->building_cur = nullptr;
    if (!partial) {
        return experts;
    }
    // one arena for every step of every layer: the graph, its tensors and each op's rows for k*T entries
    const int64_t n_max = partial->ne[1] * partial->ne[2];
    size_t need = ggml_graph_overhead_custom(RECIPE_MAX * 2, false) + ggml_tensor_overhead() * (RECIPE_MAX * 2 + 8) + 4096;
    need += GGML_PAD(ggml_row_size(GGML_TYPE_F32, partial->src[1]->ne[0]) * n_max, 64) + GGML_PAD(sizeof(int32_t) * n_max, 64) + 128;
    for (const auto & r : L->recipe) {
        if (r.op != GGML_OP_VIEW) {
            need += GGML_PAD(ggml_row_size(r.type, r.ne0) * n_max, 64) + 64;
        }
    }
    if (arena.size() < need || !arena_ctx) {
        // NOTE: at graph build; a step only resets this context (ggml_init allocates)
        if (arena_ctx) {
            ggml_free(arena_ctx);
        }
        arena.resize(std::max(arena.size(), need));
        ggml_init_params ip = { /*.mem_size =*/ arena.size(), /*.mem_buffer =*/ arena.data(), /*.no_alloc =*/ false };
        arena_ctx = ggml_init(ip);
        GGML_ASSERT(arena_ctx);
    }
    ggml_tensor * out = ggml_add(ctx0, ggml_mul(ctx0, experts, mask), partial);
    ggml_format_name(out, "spark_ec_join-%d", il);
    return out;
}

bool llama_expert_cache::analyse(llama_expert_cache_layer & L, ggml_tensor * experts, ggml_tensor * sel, ggml_tensor * cur) {
    const int64_t k = sel->ne[0];
    const int64_t T = sel->ne[1];
    if (!cur || cur->type != GGML_TYPE_F32 || cur->nb[0] != sizeof(float) || experts->op != GGML_OP_MUL_MAT_ID) {
        return false;
    }
    // the ops from the matmuls' input to the down projection, sources first
    std::vector<ggml_tensor *> order;
    std::unordered_set<const ggml_tensor *> visited;
    ggml_tensor * ids  = nullptr;
    ggml_tensor * x_in = nullptr;
    bool ok = true;

    auto host_of = [&](const ggml_tensor * t) -> ggml_tensor * { // expert weights: the host tensor
        for (auto & b : L.banks) {
            if (t == b.bank || t == b.src) {
                return b.src;
            }
        }
        return nullptr;
    };
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
            ok = ok && t->src[2] == ids && host_of(t->src[0]) != nullptr;
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
    ok = ok && ids != nullptr && x_in != nullptr && !order.empty() && order.back() == experts && order.size() <= RECIPE_MAX;
    if (!ok) {
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
            ggml_tensor * s = t->src[j];
            auto & rs = r.src[j];
            if (!s) {
                continue;
            }
            auto it = std::find(order.begin(), order.begin() + i, s);
            if (it != order.begin() + i) {
                rs.kind = LLAMA_EXPERT_CACHE_SRC_OP;
                rs.op   = (int32_t) (it - order.begin());
            } else if (t->op == GGML_OP_MUL_MAT_ID && j == 1) {
                rs.kind = LLAMA_EXPERT_CACHE_SRC_INPUT;
            } else if ((t->op == GGML_OP_MUL_MAT_ID || t->op == GGML_OP_ADD_ID) && j == 2) {
                rs.kind = LLAMA_EXPERT_CACHE_SRC_IDS;
            } else if (ggml_tensor * h = host_of(s)) {
                rs.kind   = LLAMA_EXPERT_CACHE_SRC_HOST;
                rs.tensor = h;
            } else if (s->op == GGML_OP_NONE && ggml_backend_buffer_is_host(s->buffer)) {
                rs.kind   = LLAMA_EXPERT_CACHE_SRC_HOST;
                rs.tensor = s;
            } else if (s->op == GGML_OP_NONE && ggml_nbytes(s) <= MIRROR_MAX && ggml_is_contiguous(s)) {
                // NOTE: small device weights (per-expert biases) are read from a host copy made once
                auto & m = host_mirror[s];
                m.resize(ggml_nbytes(s));
                ggml_backend_tensor_get(s, m.data(), 0, m.size());
                rs.kind   = LLAMA_EXPERT_CACHE_SRC_MIRROR;
                rs.tensor = s;
            } else {
                return false;
            }
        }
    }
    L.recipe = std::move(recipe);
    return true;
}

void llama_expert_cache::step(llama_expert_cache_node & n, const ggml_tensor * ids, ggml_tensor * dst, bool remap) {
    llama_expert_cache_layer & L = *n.layer;
    const int phase = n.phase;
    const int64_t k        = ids->ne[0];
    const int64_t n_tokens = ids->ne[1];

    auto id_at = [&](int64_t t, int64_t j) {
        return *(const int32_t *) ((const char *) ids->data + t * ids->nb[1] + j * ids->nb[0]);
    };

    std::unique_lock<std::mutex> lock(mutex);

    if (L.on_device) {
        L.stats.syncs++; // the scheduler waited for the device to copy the ids here
    }
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            const int32_t e = id_at(t, j);
            if (e >= 0 && e < n_expert) {
                L.counts[phase][e]++;
            }
        }
    }
    if (trace_on) {
        const int64_t len = 4 + n_tokens * k;
        if ((int64_t) trace.size() + len > trace_max) {
            trace_dropped++;
        } else {
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
    }

    if (!remap) {
        if (L.n_slots > 0) {
            L.stats.steps_stock++;
        }
        return;
    }
    L.stats.steps_cached++;

    const bool fits   = n_tokens * k <= L.n_slots - L.n_pinned;
    const bool hybrid = n.hybrid && !L.recipe.empty();
    // NOTE: misses go to the CPU on the CPU path, and on any step too large for the LRU slots
    const bool to_cpu = hybrid && (L.miss_path == LLAMA_EXPERT_CACHE_MISS_CPU || !fits);
    // NOTE: a multi-token step on the CPU path neither reorders nor admits: it must not flush
    // the decode working set
    const bool read_only = to_cpu && phase == LLAMA_EXPERT_CACHE_PHASE_PREFILL;
    GGML_ASSERT((to_cpu || fits) && "expert cache: step larger than the LRU slots without a CPU path");

    // admissions of earlier steps become readable at the layer's next step that may change the
    // slots (a decode step): order the device after their uploads
    for (int32_t s = L.n_pinned; s < L.n_slots && !read_only; ++s) {
        if (L.slot_state[s] == LLAMA_EXPERT_CACHE_SLOT_PENDING) {
            if (L.slot_event[s] && L.upload_backend) {
                if (L.compute_backend) {
                    ggml_backend_event_wait(L.compute_backend, L.slot_event[s]);
                } else {
                    ggml_backend_event_synchronize(L.slot_event[s]);
                }
            }
            L.slot_state[s] = LLAMA_EXPERT_CACHE_SLOT_READY;
            L.expert_slot[L.slot_expert[s]] = s;
        }
    }

    // distinct experts in order of first appearance
    int32_t n_distinct = 0;
    for (int64_t t = 0; t < n_tokens; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            const int32_t e = id_at(t, j);
            GGML_ASSERT(e >= 0 && e < n_expert);
            if (!L.seen[e]) {
                L.seen[e] = 1;
                L.distinct[n_distinct++] = e;
            }
        }
    }
    const bool counts = L.policy == LLAMA_EXPERT_CACHE_POLICY_LFU_AGED || L.policy == LLAMA_EXPERT_CACHE_POLICY_TINYLFU;
    if (counts && !read_only) {
        for (int32_t i = 0; i < n_distinct; ++i) {
            uint32_t & f = L.freq[L.distinct[i]];
            f += f < UINT32_MAX;
        }
    }

    // hits first, so that no expert this step needs can be evicted by its misses
    for (int32_t i = 0; i < n_distinct; ++i) {
        const int32_t s = L.expert_slot[L.distinct[i]];
        if (s >= 0) {
            L.stats.hits++;
            L.slot_step[s] = 1;
            if (s >= L.n_pinned && !read_only) {
                L.slot_tick[s] = ++tick;
                if (L.policy == LLAMA_EXPERT_CACHE_POLICY_SLRU && !L.slot_seg[s]) {
                    L.slot_seg[s] = 1;
                    if (++L.protected_n > L.protected_cap) {
                        // the least recent protected slot goes back to probation (not evicted)
                        int32_t d = -1;
                        for (int32_t u = L.n_pinned; u < L.n_slots; ++u) {
                            if (L.slot_seg[u] && (d < 0 || L.slot_tick[u] < L.slot_tick[d])) {
                                d = u;
                            }
                        }
                        L.slot_seg[d] = 0;
                        L.protected_n--;
                    }
                }
            }
        }
    }

    // the lowest free slot; else the evictable slot (ready, not used by this step) with the
    // smallest key: LRU tick; LFU (count, tick); SLRU (segment, tick)
    auto free_slot = [&]() {
        for (int32_t s = L.n_pinned; s < L.n_slots; ++s) {
            if (L.slot_state[s] == LLAMA_EXPERT_CACHE_SLOT_FREE) {
                return s;
            }
        }
        return -1;
    };
    auto victim_slot = [&]() {
        int32_t v = -1;
        for (int32_t s = L.n_pinned; s < L.n_slots; ++s) {
            if (L.slot_state[s] != LLAMA_EXPERT_CACHE_SLOT_READY || L.slot_step[s]) {
                continue;
            }
            if (v < 0) {
                v = s;
                continue;
            }
            bool less = L.slot_tick[s] < L.slot_tick[v];
            if (counts) {
                const uint32_t fs = L.freq[L.slot_expert[s]], fv = L.freq[L.slot_expert[v]];
                less = fs < fv || (fs == fv && less);
            } else if (L.policy == LLAMA_EXPERT_CACHE_POLICY_SLRU && L.slot_seg[s] != L.slot_seg[v]) {
                less = L.slot_seg[s] < L.slot_seg[v];
            }
            v = less ? s : v;
        }
        return v;
    };
    auto evict_into = [&](int32_t s, int32_t e) {
        if (L.slot_expert[s] >= 0 && L.slot_state[s] == LLAMA_EXPERT_CACHE_SLOT_READY) {
            L.expert_slot[L.slot_expert[s]] = -1;
        }
        if (L.slot_seg[s]) {
            L.protected_n--;
        }
        L.slot_seg[s]    = 0;
        L.slot_expert[s] = e;
        L.slot_tick[s]   = ++tick;
        L.slot_step[s]   = 1;
    };

    int32_t n_admit = 0;
    int32_t n_cpu   = 0;
    for (int32_t i = 0; i < n_distinct; ++i) {
        const int32_t e = L.distinct[i];
        if (L.expert_slot[e] >= 0) {
            continue;
        }
        L.stats.misses++;
        if (to_cpu) {
            n_cpu++;
            if (read_only) {
                continue; // no admission is tried
            }
            if (n_admit >= L.max_admit) {
                L.stats.admit_skipped++;
                continue;
            }
            int32_t s = free_slot();
            if (s < 0) {
                s = victim_slot();
                // TINYLFU: a miss displaces a resident expert only if it was routed more often
                if (s < 0 || (L.policy == LLAMA_EXPERT_CACHE_POLICY_TINYLFU && L.freq[e] <= L.freq[L.slot_expert[s]])) {
                    L.stats.admit_skipped++;
                    continue;
                }
            }
            evict_into(s, e);
            L.slot_state[s] = LLAMA_EXPERT_CACHE_SLOT_PENDING; // readable from the layer's next decode step
            L.admit[2 * n_admit]     = e;
            L.admit[2 * n_admit + 1] = s;
            n_admit++;
        } else {
            int32_t s = free_slot();
            s = s >= 0 ? s : victim_slot();
            GGML_ASSERT(s >= 0 && "expert cache: no evictable slot (step larger than the LRU slots)");
            evict_into(s, e);
            L.slot_state[s]  = LLAMA_EXPERT_CACHE_SLOT_READY;
            L.expert_slot[e] = s;
            L.admit[2 * n_admit]     = e;
            L.admit[2 * n_admit + 1] = s;
            n_admit++;
        }
    }
    if (counts && !read_only && policy_window > 0 && ++L.age >= policy_window) {
        for (uint32_t & f : L.freq) {
            f >>= 1;
        }
        L.age = 0;
    }
    L.stats.cpu_experts      += n_cpu;
    L.stats.cpu_expert_bytes += (uint64_t) n_cpu * L.expert_bytes;

    // slot ids for the expert matmuls (dst is contiguous [k, n_tokens]). An entry the CPU computes
    // reads a filler that no other entry of the token reads (device kernels assume an id at most
    // once per token: Vulkan's MUL_MAT_ID computes at most n_tokens rows of an id, CUDA's
    // mm_ids_helper keeps one); the mask node drops its device output. Fillers, in order: the
    // zeroed guard, a slot that is not pending (zeroed if never used, else a landed expert: finite
    // weights), and only if the token needs more, a pending slot, which the device then waits for.
    // n_slots >= k, so a filler exists.
    int32_t * out = (int32_t *) dst->data;
    uint8_t * missed = n.hybrid && (int64_t) L.missed.size() >= n_tokens * k ? L.missed.data() : nullptr;
    bool any_wait = false;
    auto filler_for = [&](const int32_t * row, bool allow_pending) {
        for (int32_t c = -1; c < L.n_slots; ++c) {
            const int32_t s = c < 0 ? L.n_slots : c;
            if (std::find(row, row + k, s) != row + k) {
                continue;
            }
            if (!allow_pending && s < L.n_slots && L.slot_state[s] == LLAMA_EXPERT_CACHE_SLOT_PENDING) {
                continue;
            }
            return s;
        }
        return (int32_t) -1;
    };
    for (int64_t t = 0; t < n_tokens; ++t) {
        int32_t * row = out + t * k;
        for (int64_t j = 0; j < k; ++j) {
            row[j] = L.expert_slot[id_at(t, j)];
            if (missed) {
                missed[t * k + j] = row[j] < 0;
            }
        }
        for (int64_t j = 0; j < k; ++j) {
            if (row[j] >= 0) {
                continue;
            }
            int32_t s = filler_for(row, false);
            if (s < 0) {
                s = filler_for(row, true);
                GGML_ASSERT(s >= 0 && s < L.n_slots);
                L.filler_wait[s] = 1;
                any_wait = true;
            }
            row[j] = s;
        }
    }
    for (int32_t i = 0; i < n_distinct; ++i) {
        L.seen[L.distinct[i]] = 0;
    }
    std::fill(L.slot_step.begin(), L.slot_step.end(), 0);

    // NOTE: uploads run without the lock; only this thread changes the slots
    lock.unlock();
    const bool background = to_cpu && L.upload_backend != nullptr;
    uint64_t bytes = 0;
    const int64_t t0 = ggml_time_us();
    for (int32_t a = 0; a < n_admit; ++a) {
        const int32_t e = L.admit[2 * a];
        const int32_t s = L.admit[2 * a + 1];
        for (auto & b : L.banks) {
            const size_t nb = b.src->nb[2];
            const void * src = (const char *) b.src->data + (size_t) e * nb;
            if (background) {
                ggml_backend_tensor_set_async(L.upload_backend, b.bank, src, (size_t) s * nb, nb);
            } else {
                ggml_backend_tensor_set(b.bank, src, (size_t) s * nb, nb);
            }
            bytes += nb;
        }
        if (background) {
            ggml_backend_event_record(L.slot_event[s], L.upload_backend);
        }
    }
    // a pending slot read as a filler: the device reads it after its upload (rare: a token needing
    // more fillers than the guard and the landed slots it does not read)
    for (int32_t s = L.n_pinned; any_wait && s < L.n_slots; ++s) {
        if (L.filler_wait[s]) {
            L.filler_wait[s] = 0;
            if (L.slot_event[s] && L.upload_backend && L.compute_backend) {
                ggml_backend_event_wait(L.compute_backend, L.slot_event[s]);
            }
        }
    }
    const int64_t dt = ggml_time_us() - t0;
    lock.lock();
    L.stats.uploads        += n_admit;
    L.stats.bytes_uploaded += bytes;
    if (background) {
        L.stats.async_uploads      += n_admit;
        L.stats.async_upload_bytes += bytes;
    } else {
        L.stats.blocking_upload_bytes += bytes;
        L.stats.upload_us             += dt;
    }
}

void llama_expert_cache::compute_partial(llama_expert_cache_node & n, ggml_tensor * dst) {
    llama_expert_cache_layer & L = *n.layer;
    const ggml_tensor * slots = dst->src[0]; // [k, n_tokens] contiguous, from the remap node
    const ggml_tensor * cur   = dst->src[1]; // [n_embd, n_tokens]
    const ggml_tensor * sel   = dst->src[2]; // [k, n_tokens], read by strides
    const int64_t k = slots->ne[0];
    const int64_t T = slots->ne[1];
    const int64_t n_embd_out = dst->ne[0];

    memset(dst->data, 0, ggml_nbytes(dst));
    const uint8_t * missed = L.missed.data(); // written by the remap node of this step
    GGML_ASSERT((int64_t) L.missed.size() >= k * T);
    int64_t n_miss = 0;
    for (int64_t i = 0; i < k * T; ++i) {
        n_miss += missed[i];
    }
    if (n_miss == 0 || L.recipe.empty() || !cpu_backend) {
        return;
    }
    const int64_t t0 = ggml_time_us();

    GGML_ASSERT(arena_ctx);
    ggml_context * pctx = arena_ctx;
    ggml_reset(pctx);

    // the missed entries, one row each: their input row and their expert id
    const int64_t n_embd_in = cur->ne[0];
    ggml_tensor * x  = ggml_new_tensor_3d(pctx, GGML_TYPE_F32, n_embd_in, n_miss, 1);
    ggml_tensor * xi = ggml_new_tensor_2d(pctx, GGML_TYPE_I32, n_miss, 1);
    {
        int64_t m = 0;
        for (int64_t t = 0; t < T; ++t) {
            for (int64_t j = 0; j < k; ++j) {
                if (!missed[t * k + j]) {
                    continue;
                }
                memcpy((char *) x->data + m * x->nb[1], (const char *) cur->data + t * cur->nb[1], n_embd_in * sizeof(float));
                ((int32_t *) xi->data)[m] = *(const int32_t *) ((const char *) sel->data + t * sel->nb[1] + j * sel->nb[0]);
                m++;
            }
        }
    }

    // the recipe's ops on [.., n_miss, 1] instead of [.., k, n_tokens]: per entry the same arithmetic
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
    ggml_tensor * res = ops[n_ops - 1]; // [n_embd, n_miss, 1]
    GGML_ASSERT(res->ne[0] == n_embd_out);

    ggml_cgraph * gf = ggml_new_graph_custom(pctx, RECIPE_MAX * 2, false);
    ggml_build_forward_expand(gf, res);
    const ggml_status st = ggml_backend_graph_compute(cpu_backend, gf);
    GGML_ASSERT(st == GGML_STATUS_SUCCESS);

    // each missed entry's output goes where the device wrote zero
    int64_t m = 0;
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            if (!missed[t * k + j]) {
                continue;
            }
            memcpy((char *) dst->data + t * dst->nb[2] + j * dst->nb[1], (const char *) res->data + m * res->nb[1],
                    n_embd_out * sizeof(float));
            m++;
        }
    }
    std::lock_guard<std::mutex> lock(mutex);
    L.stats.cpu_us += ggml_time_us() - t0;
}

void llama_expert_cache::compute_mask(llama_expert_cache_node & n, ggml_tensor * dst) {
    const llama_expert_cache_layer & L = *n.layer;
    const int64_t kT = dst->ne[1] * dst->ne[2]; // [1, k, n_tokens] contiguous
    GGML_ASSERT((int64_t) L.missed.size() >= kT);
    float * m = (float *) dst->data;
    for (int64_t i = 0; i < kT; ++i) {
        m[i] = L.missed[i] ? 0.0f : 1.0f;
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
    for (int32_t s = 0; s < std::min<int32_t>(n, L->n_slots); ++s) {
        const bool pending = L->slot_state[s] == LLAMA_EXPERT_CACHE_SLOT_PENDING;
        out[s] = pending ? -2 - L->slot_expert[s] : L->slot_expert[s];
    }
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
    if (miss_path != LLAMA_EXPERT_CACHE_MISS_UPLOAD && miss_path != LLAMA_EXPERT_CACHE_MISS_CPU) {
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    std::lock_guard<std::mutex> lock(L->owner->mutex);
    if (L->n_slots == 0) {
        return LLAMA_EXPERT_CACHE_ERR_LAYER;
    }
    if (miss_path == LLAMA_EXPERT_CACHE_MISS_CPU && L->cpu_ok == 0) {
        LLAMA_LOG_ERROR("%s: layer %d: its expert ops cannot run on the CPU miss path\n", __func__, il);
        return LLAMA_EXPERT_CACHE_ERR_PLACEMENT;
    }
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
