// Spark expert cache: banks of expert slots on the device, host graph nodes that run the
// policy core (llama-expert-cache-policy.cpp) on each step and remap routed ids to slot ids,
// uploads, and a CPU miss path that computes non-resident experts from the host weights with
// the ggml CPU kernels. This file: set-up (checks, layers, workers, pinned experts) and teardown.
// The others: -banks (arenas and banks), -graph (the cached layer's nodes), -step (a host node's
// step), -admit (uploads and admissions), -miss (the CPU miss path), -api (the C API).
#include "llama-expert-cache-impl.h"

using namespace llama_expert_cache_impl;

static_assert((int) LLAMA_EXPERT_CACHE_POLICY_LRU      == (int) LLAMA_EXPERT_CACHE_POLICY_ID_LRU &&
              (int) LLAMA_EXPERT_CACHE_POLICY_LFU_AGED == (int) LLAMA_EXPERT_CACHE_POLICY_ID_LFU_AGED &&
              (int) LLAMA_EXPERT_CACHE_POLICY_SLRU     == (int) LLAMA_EXPERT_CACHE_POLICY_ID_SLRU &&
              (int) LLAMA_EXPERT_CACHE_POLICY_TINYLFU  == (int) LLAMA_EXPERT_CACHE_POLICY_ID_TINYLFU &&
              (int) LLAMA_EXPERT_CACHE_MISS_UPLOAD     == (int) LLAMA_EXPERT_CACHE_MISS_ID_UPLOAD &&
              (int) LLAMA_EXPERT_CACHE_MISS_CPU        == (int) LLAMA_EXPERT_CACHE_MISS_ID_CPU &&
              (int) LLAMA_EXPERT_CACHE_MISS_AUTO       == (int) LLAMA_EXPERT_CACHE_MISS_ID_AUTO,
              "the policy core's ids must be the C API's values");

namespace llama_expert_cache_impl {

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

} // namespace llama_expert_cache_impl

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
    int32_t rc = open_file_tier(params, err);
    if (rc == LLAMA_EXPERT_CACHE_OK) {
        rc = open_ahead(params, err);
    }
    if (rc == LLAMA_EXPERT_CACHE_OK) {
        rc = plan_arenas(need, err);
    }
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
    if (!dry) {
        release_mapping();
        keep_resident();
    }
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
int32_t llama_expert_cache::check_layer_tensors(const llama_expert_cache_layer_params & lp, bool file_tier,
        llama_expert_cache_bank_needs & need, size_t & expert_bytes, std::string & err) {
    ggml_backend_dev_t dev = model.dev_layer(lp.il);
    if (lp.in_ram != 0 && !file_tier) {
        err = fmt("layer %d: in_ram keeps its slots in RAM and reads misses from the file: give the file tier a file_path", lp.il);
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    if (!is_gpu(dev) && !(file_tier && dev)) {
        err = fmt("layer %d runs on %s, not on a GPU-type device: offload the layer (n_gpu_layers) to cache it, "
                "or give the file tier a file_path", lp.il, dev ? ggml_backend_dev_name(dev) : "the CPU");
        return LLAMA_EXPERT_CACHE_ERR_PLACEMENT;
    }
    const bool ram = !is_gpu(dev) || lp.in_ram != 0;
    if (ram && lp.miss_path != LLAMA_EXPERT_CACHE_MISS_UPLOAD) {
        err = fmt("layer %d is in the file tier: its misses are read into slots, miss path %d is not one",
                lp.il, lp.miss_path);
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    ggml_backend_dev_t bank_dev = ram ? ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU) : dev;
    if (!bank_dev) {
        err = fmt("layer %d: no CPU device to hold its RAM slots", lp.il);
        return LLAMA_EXPERT_CACHE_ERR_PLACEMENT;
    }
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(bank_dev);
    need.dev[buft] = bank_dev;
    ggml_backend_buffer_type_t host_buft = ram ? nullptr : ggml_backend_dev_host_buffer_type(dev);

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
        // NOTE: the file tier drops the tensor's pages after load (release_mapping): the CPU's memory only
        ggml_backend_dev_t held_by = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(t->buffer));
        if (ram && held_by && ggml_backend_dev_type(held_by) != GGML_BACKEND_DEVICE_TYPE_CPU) { // a device's pinned memory
            err = fmt("layer %d: %s is in %s: a layer in RAM keeps its experts on the CPU (override them to CPU)",
                    lp.il, t->name, ggml_backend_buffer_name(t->buffer));
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
        rc = check_layer_tensors(lp, params.file_path != nullptr, need, expert_bytes, err);
    }
    if (rc != LLAMA_EXPERT_CACHE_OK) {
        return rc;
    }
    llama_expert_cache_layer & L = *layer(lp.il);
    L.file_tier = !L.on_device || lp.in_ram != 0;
    L.bank_dev  = L.file_tier ? ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU) : model.dev_layer(lp.il);
    const int32_t k = (int32_t) model.hparams.n_expert_used(lp.il);
    // NOTE: the file tier stages every miss of a prefill ubatch: its arenas hold a layer's worth
    L.slots.init(n_expert, lp.n_slots, lp.n_pinned, lp.policy, lp.miss_path, lp.max_admit < 0 ? k : lp.max_admit,
            params.policy_window, params.slru_protected_num, params.slru_protected_den,
            L.file_tier ? n_expert : params.n_stage);
    L.expert_bytes = expert_bytes;
    return LLAMA_EXPERT_CACHE_OK;
}

int32_t llama_expert_cache::check_budget(const llama_expert_cache_params & params, llama_expert_cache_bank_needs & need, std::string & err) {
    for (const auto & [buft, bytes] : need.bytes) {
        size_t budget = params.device_budget;
        if (ggml_backend_buft_is_host(buft)) { // the file tier's RAM banks
            if (params.host_budget > 0 && bytes > params.host_budget) {
                err = fmt("the file tier's RAM banks need %.3f GiB but the RAM budget leaves them %.3f GiB",
                        bytes / 1073741824.0, params.host_budget / 1073741824.0);
                return LLAMA_EXPERT_CACHE_ERR_NO_MEMORY;
            }
            continue;
        }
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

// background admissions: a second backend on the device (its own stream) and an event per slot
void llama_expert_cache::init_admissions(llama_expert_cache_layer & L, ggml_backend_dev_t dev) {
    L.slot_event.assign(L.slots.n_slots, nullptr);
    if (L.file_tier) {
        return; // NOTE: reads land before the step's matmuls; nothing is uploaded in the background
    }
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
            if (L.file_tier) {
                read_experts(L, &e, &j, 1);
            }
            for (auto & b : L.banks) {
                const size_t nb = b.src->nb[2];
                if (!L.file_tier) {
                    ggml_backend_tensor_set(b.bank, (const char *) b.src->data + (size_t) e * nb, (size_t) j * nb, nb);
                }
                L.stats.bytes_uploaded += nb;
            }
            L.stats.upload_us += ggml_time_us() - t0;
            L.stats.uploads++;
            L.slots.pin(j, e);
        }
    }
}
