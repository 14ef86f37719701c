// Spark expert cache: a narrow C API over llama_context.
//
// For the MoE layers the caller names, expert weights stay in host memory and the
// layer's device gets a bank of n_slots expert slices: n_pinned hot experts uploaded
// at start and never evicted, the rest managed LRU and filled on demand. Routed ids
// are remapped to slot ids for the expert matmuls only, so results are exact.
// Without a cache (llama_expert_cache_init never called) the graph is stock.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

    enum llama_expert_cache_status {
        LLAMA_EXPERT_CACHE_OK            =  0,
        LLAMA_EXPERT_CACHE_ERR_ARG       = -1, // null pointer or negative count
        LLAMA_EXPERT_CACHE_ERR_NOT_MOE   = -2, // the layer (or model) has no routed experts
        LLAMA_EXPERT_CACHE_ERR_SLOTS     = -3, // n_slots - n_pinned < experts used per token, or n_slots > n_expert
        LLAMA_EXPERT_CACHE_ERR_EXPERT_ID = -4, // a pinned expert id out of range or repeated
        LLAMA_EXPERT_CACHE_ERR_NO_MEMORY = -5, // the banks do not fit the device budget or allocation failed
        LLAMA_EXPERT_CACHE_ERR_PLACEMENT = -6, // experts not in plain host memory, or layer not on a GPU-type device
        LLAMA_EXPERT_CACHE_ERR_LAYER     = -7, // layer index out of range or listed twice
        LLAMA_EXPERT_CACHE_ERR_INTERNAL  = -8, // unexpected exception (see the log)
    };

    enum llama_expert_cache_phase {
        LLAMA_EXPERT_CACHE_PHASE_PREFILL = 0, // ubatch of more than one token (all its layers)
        LLAMA_EXPERT_CACHE_PHASE_DECODE  = 1, // ubatch of one token
    };

    struct llama_expert_cache_layer_params {
        int32_t         il;       // layer index
        int32_t         n_slots;  // bank size S (pinned + LRU); S - n_pinned >= experts used per token
        int32_t         n_pinned; // experts pinned in the first slots
        const int32_t * pinned;   // [n_pinned] expert ids, distinct
    };

    struct llama_expert_cache_params {
        const struct llama_expert_cache_layer_params * layers; // cached layers
        int32_t n_layers;      // 0: counting only, no bank is allocated
        size_t  device_budget; // bytes the banks may take per device; 0: the device's free memory
        bool    trace;         // record the routed ids of every step (llama_expert_cache_get_trace)
    };

    struct llama_expert_cache_stats {
        uint64_t hits;           // distinct experts per step found resident
        uint64_t misses;         // distinct experts per step uploaded on demand
        uint64_t uploads;        // expert uploads, misses plus pinned uploads at init
        uint64_t bytes_uploaded; // bytes copied host -> device
        uint64_t upload_us;      // time the steps waited on uploads
        uint64_t steps_cached;   // steps served from the bank
        uint64_t steps_stock;    // steps of a cached layer that took the stock path (batch larger than the LRU slots)
    };

    LLAMA_API struct llama_expert_cache_params llama_expert_cache_default_params(void);

    // Attach a cache (replacing any previous one) to ctx. Returns a llama_expert_cache_status;
    // on error a one-line reason is written to err (if err_len > 0) and ctx is unchanged.
    LLAMA_API int32_t llama_expert_cache_init(
            struct llama_context                   * ctx,
            const struct llama_expert_cache_params * params,
            char                                   * err,
            size_t                                   err_len);

    // Detach and free the cache; the graph is stock again.
    LLAMA_API void llama_expert_cache_free(struct llama_context * ctx);

    LLAMA_API bool llama_expert_cache_enabled(const struct llama_context * ctx);

    // Per-layer counters; zeros for a MoE layer that is not cached. Returns a status.
    LLAMA_API int32_t llama_expert_cache_get_stats(
            const struct llama_context      * ctx,
            int32_t                           il,
            struct llama_expert_cache_stats * out);

    // Routing counts of layer il for one phase into out[0..n_expert). Returns n_expert or a status.
    LLAMA_API int32_t llama_expert_cache_get_counts(
            const struct llama_context * ctx,
            int32_t                      il,
            int32_t                      phase,
            uint64_t                   * out,
            int32_t                      n);

    // Expert held by each slot of layer il (-1: free) into out[0..n_slots). Returns n_slots or a status.
    LLAMA_API int32_t llama_expert_cache_get_slots(
            const struct llama_context * ctx,
            int32_t                      il,
            int32_t                    * out,
            int32_t                      n);

    // The trace: records [il, n_tokens, k, phase, ids...] in step order. Copies at most n values
    // into out (may be null) and returns the trace's full length.
    LLAMA_API int64_t llama_expert_cache_get_trace(
            const struct llama_context * ctx,
            int32_t                    * out,
            int64_t                      n);

    // Zero the counters, the routing counts and the trace; the slots keep their experts.
    LLAMA_API void llama_expert_cache_reset_stats(struct llama_context * ctx);

    // Bytes of device memory held by the banks.
    LLAMA_API size_t llama_expert_cache_device_bytes(const struct llama_context * ctx);

#ifdef __cplusplus
}
#endif
