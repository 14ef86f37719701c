// Spark expert cache: internal C++ side (see include/llama-expert-cache-api.h).
#pragma once

#include "llama-expert-cache-api.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <memory>
#include <mutex>
#include <string>
#include <vector>

struct llama_model;
struct llama_expert_cache;

// One expert tensor of a cached layer and its device bank.
struct llama_expert_cache_bank {
    ggml_tensor * src  = nullptr; // host tensor [ne0, ne1, n_expert]
    ggml_tensor * bank = nullptr; // device tensor [ne0, ne1, n_slots + 1]; the last slice is a zeroed guard
};

struct llama_expert_cache_layer;

// Userdata of a host node: the layer and the phase of the ubatch it was built for.
struct llama_expert_cache_node {
    llama_expert_cache_layer * layer = nullptr;
    int32_t phase = LLAMA_EXPERT_CACHE_PHASE_PREFILL;
};

struct llama_expert_cache_layer {
    llama_expert_cache * owner = nullptr;
    int32_t il       = -1;
    int32_t n_slots  = 0; // 0: counting only
    int32_t n_pinned = 0;
    int32_t miss_path = LLAMA_EXPERT_CACHE_MISS_UPLOAD;
    int32_t max_admit = 0;

    std::vector<llama_expert_cache_bank> banks;

    std::vector<int32_t>  slot_expert; // [n_slots] expert in slot, -1 free
    std::vector<int32_t>  expert_slot; // [n_expert] slot of expert, -1 not resident
    std::vector<uint64_t> slot_tick;   // [n_slots] last use, for LRU
    std::vector<uint8_t>  slot_step;   // [n_slots] used by the current step
    std::vector<uint8_t>  seen;        // [n_expert] scratch: already listed in this step

    std::vector<uint64_t> counts[2];   // [phase][n_expert] routed occurrences
    llama_expert_cache_node nodes[2];  // [phase] host-node userdata
    llama_expert_cache_stats stats = {};
};

struct llama_expert_cache {
    llama_expert_cache(const llama_model & model);

    // Validate params, allocate and fill the banks. Returns a status and sets err.
    int32_t init(const llama_expert_cache_params & params, std::string & err);

    // Graph hook, called from build_moe_ffn after the experts are selected. Adds a host node
    // that counts (and, for a cached layer whose step fits, plans and uploads) and returns the
    // ids the expert matmuls must use; swaps the expert tensors for their banks when remapped.
    ggml_tensor * build(
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
            ggml_tensor        ** gate_up_exps);

    // Run by the host node: count, trace, and (remap) plan the step and write slot ids to dst.
    // NOTE: the phase comes from the ubatch, not from ids: the last layer of a prompt may route
    // only its output tokens, and a one-row step there is still prefill.
    void step(llama_expert_cache_layer & L, int phase, const ggml_tensor * ids, ggml_tensor * dst, bool remap);

    llama_expert_cache_layer * layer(int32_t il);

    const llama_model & model;
    int32_t n_expert = 0;

    std::vector<std::unique_ptr<llama_expert_cache_layer>> layers; // [n_layer], null for dense layers
    std::vector<ggml_context_ptr>        ctxs;
    std::vector<ggml_backend_buffer_ptr> bufs;
    size_t device_bytes = 0;

    bool trace_on = false;
    std::vector<int32_t> trace;
    int64_t trace_max = 0;
    int64_t trace_dropped = 0;

    uint64_t tick = 0;
    mutable std::mutex mutex; // guards counters and slot tables against readers during compute
};
