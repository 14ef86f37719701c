// Spark expert cache: a narrow C API over llama_context.
//
// For the MoE layers the caller names, expert weights stay in host memory and the
// layer's device gets a bank of n_slots expert slices: n_pinned hot experts uploaded
// at start and never evicted, the rest managed LRU. A routed expert that is not
// resident (a miss) is either uploaded into a slot before the step's matmuls
// (LLAMA_EXPERT_CACHE_MISS_UPLOAD) or computed on the CPU from the host weights while
// the resident ones run on the device (LLAMA_EXPERT_CACHE_MISS_CPU); in the CPU mode a
// miss may be admitted into a slot by a background upload, usable from a later step. In
// the auto mode (LLAMA_EXPERT_CACHE_MISS_AUTO) each step splits its misses per expert: the
// ones with most tokens are uploaded into staging slices for that step while that ends it
// sooner, by the layer's costs, and the rest are computed on the CPU.
// Routed ids are remapped to slot ids for the expert matmuls only, so results are exact.
// The file tier (params.file_path): layers that run on the CPU keep their slots in RAM (banks on
// the CPU buffer type) and read each miss from the model file with pread, a step's reads in
// flight together, instead of faulting the mapping in; their misses are always uploaded. A layer on a
// GPU-type device joins the file tier with in_ram (three tiers: device slots, RAM slots, the file): its
// expert tensors stay on the CPU (as stock's --n-cpu-moe), its slots in RAM.
// Without a cache (llama_expert_cache_init never called) the graph is stock.
#pragma once

#include "llama.h"

#include <stddef.h>
#include <stdint.h>

// NOTE: bump when a struct or a function below changes; bindings check it at load
#define LLAMA_EXPERT_CACHE_API_VERSION 8

#ifdef __cplusplus
extern "C" {
#endif

    enum llama_expert_cache_status {
        LLAMA_EXPERT_CACHE_OK            =  0,
        LLAMA_EXPERT_CACHE_ERR_ARG       = -1, // null pointer, negative count or unknown enum value
        LLAMA_EXPERT_CACHE_ERR_NOT_MOE   = -2, // the layer (or model) has no routed experts
        LLAMA_EXPERT_CACHE_ERR_SLOTS     = -3, // n_slots - n_pinned < experts used per token, or n_slots > n_expert
        LLAMA_EXPERT_CACHE_ERR_EXPERT_ID = -4, // a pinned expert id out of range or repeated
        LLAMA_EXPERT_CACHE_ERR_NO_MEMORY = -5, // the banks do not fit the device budget or allocation failed
        LLAMA_EXPERT_CACHE_ERR_PLACEMENT = -6, // experts not in plain host memory, or layer not on a GPU-type device
                                               // (nor a file tier), or the file tier's file cannot be read
        LLAMA_EXPERT_CACHE_ERR_LAYER     = -7, // layer index out of range or listed twice
        LLAMA_EXPERT_CACHE_ERR_INTERNAL  = -8, // unexpected exception (see the log)
        LLAMA_EXPERT_CACHE_ERR_VERSION   = -9, // params.size does not match this library's struct
    };

    enum llama_expert_cache_phase {
        LLAMA_EXPERT_CACHE_PHASE_PREFILL = 0, // ubatch of more than one token (all its layers)
        LLAMA_EXPERT_CACHE_PHASE_DECODE  = 1, // ubatch of one token
    };

    enum llama_expert_cache_miss_path {
        LLAMA_EXPERT_CACHE_MISS_UPLOAD = 0, // upload the miss into a slot and wait for it (blocking)
        LLAMA_EXPERT_CACHE_MISS_CPU    = 1, // compute the miss on the CPU; admit it in the background
        LLAMA_EXPERT_CACHE_MISS_AUTO   = 2, // per expert and step: upload into a staging slice or compute on the CPU,
                                             // whichever ends the step sooner (set_miss_costs); admit as MISS_CPU
    };

    // Which slot a miss evicts (upload path), and whether a miss is admitted at all (CPU path).
    // Integer arithmetic only, so Spark's simulator replays it exactly (spark_cli/simulator.py).
    enum llama_expert_cache_policy {
        LLAMA_EXPERT_CACHE_POLICY_LRU      = 0, // least recently used
        LLAMA_EXPERT_CACHE_POLICY_LFU_AGED = 1, // lowest routed-step count (halved every policy_window steps), then LRU
        LLAMA_EXPERT_CACHE_POLICY_SLRU     = 2, // segmented LRU: probation before protected (slru_protected share)
        LLAMA_EXPERT_CACHE_POLICY_TINYLFU  = 3, // LFU_AGED eviction; CPU path: admit only if the miss's count beats the victim's
    };

    struct llama_expert_cache_layer_params {
        int32_t         il;        // layer index
        int32_t         n_slots;   // bank size S (pinned + LRU); S - n_pinned >= experts used per token
        int32_t         n_pinned;  // experts pinned in the first slots
        const int32_t * pinned;    // [n_pinned] expert ids, distinct
        int32_t         miss_path; // enum llama_expert_cache_miss_path (changeable later with set_miss_path)
        int32_t         max_admit; // CPU miss path: background admissions per decode step at most (<0: experts used per token)
        int32_t         policy;    // enum llama_expert_cache_policy
        int32_t         in_ram;    // file tier (params.file_path): 1 keeps a GPU-type device's layer's slots in RAM (the
                                   // CPU's buffer type: its expert matmuls run on the CPU) and reads its misses from
                                   // the file; its expert tensors must be on the CPU's buffer type. 0: the layer's device
    };

    struct llama_expert_cache_params {
        size_t size;           // sizeof(struct llama_expert_cache_params); set by default_params
        const struct llama_expert_cache_layer_params * layers; // cached layers
        int32_t n_layers;      // 0: counting only, no bank is allocated
        size_t  device_budget; // bytes the banks may take per device; 0: the device's free memory less device_margin
        size_t  device_margin; // bytes left free per device for compute buffers, pools and graphs (budget 0 only)
        bool    trace;         // record the routed ids of every step (llama_expert_cache_get_trace)
        int64_t trace_max;     // trace capacity in int32 values; recording stops when full (get_trace_dropped)
        int32_t n_threads;     // CPU miss path workers (<= 0: 1): its host node runs on the graph's threads, and
                               // each of the first n_threads computes whole experts (give the larger of -t, -tb)
        int32_t policy_window; // LFU_AGED, TINYLFU: halve every count each this many steps of a layer (0: never)
        int32_t slru_protected_num; // SLRU: protected slots at most (S - P) * num / den
        int32_t slru_protected_den;
        int32_t n_stage;       // staging slices for misses uploaded for one step only (MISS_AUTO, and MISS_UPLOAD
                               // steps larger than the LRU slots), shared by the cached layers whose expert
                               // tensors have the same types and shapes (0: none; at most the expert count). The
                               // file tier's RAM banks always hold the expert count (a prefill reads every miss)
        bool    count_uncached; // MoE layers that are not cached get a counting node too (their routing counts
                                // and trace), at one device -> host stop per layer and step; false: they keep
                                // the stock graph (no stop). Counting only (n_layers 0) counts every layer.
        const char * file_path; // the file tier: the model's GGUF (one file), from which cached layers that run
                                // on the CPU read their misses; null: only layers on a GPU-type device are cached
        int32_t n_readers;      // file tier: preads in flight at most (<= 0: 4)
        size_t  host_budget;    // file tier: bytes the RAM banks may take (0: not checked)
        int32_t ahead;          // file tier read-ahead: while a layer's decode step runs, read up to this many experts
                                // of the next file-tier layer that it predicts (co-routing counts learned online)
                                // and that are not in that layer's RAM slots, into staging slices (0: off)
        int32_t ahead_min_prob; // read an expert ahead only when its predicted chance is at least this (1 << 16 = 1)
    };

    struct llama_expert_cache_stats {
        uint64_t hits;                  // distinct experts per step found resident
        uint64_t misses;                // distinct experts per step not resident (uploaded or computed on the CPU)
        uint64_t uploads;               // expert uploads: blocking misses, admissions and pinned uploads at init
        uint64_t bytes_uploaded;        // bytes copied host -> device
        uint64_t upload_us;             // time the steps waited on blocking uploads
        uint64_t steps_cached;          // steps served from the bank
        uint64_t steps_stock;           // steps of a cached layer that took the stock path
        uint64_t syncs;                 // steps whose host node waited for the device (device -> host stops)
        uint64_t blocking_upload_bytes; // bytes of uploads a step waited for (not counting pinned uploads at init)
        uint64_t async_uploads;         // admissions uploaded in the background
        uint64_t async_upload_bytes;    // their bytes
        uint64_t cpu_experts;           // distinct experts per step computed on the CPU
        uint64_t cpu_expert_bytes;      // host expert bytes those CPU computations read
        uint64_t cpu_us;                // time spent computing misses on the CPU
        uint64_t cpu_entries;           // (token, expert) entries of those misses
        uint64_t admit_skipped;         // CPU-path misses not admitted (bound reached or no evictable slot)
        uint64_t staged_uploads;        // misses uploaded into staging slices for their step (not in uploads)
        uint64_t staged_upload_bytes;   // their bytes
        uint64_t stop_reads;            // device -> host copies the steps' stops made (the scheduler's, one per
                                        // device tensor the host nodes read: the routed ids, packed with the
                                        // matmuls' input on the CPU miss path)
        uint64_t stop_writes;           // host -> device copies of the host nodes' outputs (slot ids, packed with
                                        // the CPU miss path's mask and partial result)
        uint64_t blocking_calls;        // the steps' own blocking device calls: synchronous uploads, event waits on the host
        uint64_t ahead_reads;           // file tier: experts of this layer read ahead (during the layer before it)
        uint64_t ahead_used;            // of those, misses of this layer's step (no read at the step; not in uploads)
        uint64_t ahead_bytes;           // the bytes read ahead
    };

    // Memory of one buffer type (llama_expert_cache_memory_breakdown).
    struct llama_expert_cache_mem_entry {
        char     buft[64];   // buffer type name (ggml_backend_buft_name), truncated
        char     device[64]; // its device's name (ggml_backend_dev_name); "" when it has none
        int32_t  is_host;    // 1: host memory (the CPU's, or a device's pinned host memory)
        uint64_t model;      // weights
        uint64_t context;    // KV cache and recurrent state
        uint64_t compute;    // compute buffers of the graph in effect
        uint64_t banks;      // the expert cache's banks
    };

    // LLAMA_EXPERT_CACHE_API_VERSION of the library.
    LLAMA_API int32_t llama_expert_cache_api_version(void);

    LLAMA_API struct llama_expert_cache_params llama_expert_cache_default_params(void);

    // Attach a cache (replacing any previous one) to ctx. Returns a llama_expert_cache_status;
    // on error a one-line reason is written to err (if err_len > 0) and ctx is unchanged.
    // On a model loaded with llama_model_params.no_alloc (a dry run) nothing is allocated or
    // uploaded and the device budget is not checked: the banks are sized, the graph is the cached
    // one, and llama_expert_cache_memory_breakdown reports what a real load would allocate.
    LLAMA_API int32_t llama_expert_cache_init(
            struct llama_context                   * ctx,
            const struct llama_expert_cache_params * params,
            char                                   * err,
            size_t                                   err_len);

    // Detach and free the cache; the graph is stock again.
    LLAMA_API void llama_expert_cache_free(struct llama_context * ctx);

    LLAMA_API bool llama_expert_cache_enabled(const struct llama_context * ctx);

    // Switch the miss path of cached layer il (the graph is unchanged). Returns a status;
    // ERR_PLACEMENT when the layer cannot compute misses on the CPU (see the log).
    LLAMA_API int32_t llama_expert_cache_set_miss_path(
            struct llama_context * ctx,
            int32_t                il,
            int32_t                miss_path);

    // The per-expert split's costs for layer il (MISS_AUTO), in ns: a missed expert with t routed
    // entries in a step takes cpu_expert_ns + t * cpu_entry_ns on the CPU, upload_ns to upload into a
    // staging slice. Whether the uploads run beside the CPU work (a second device queue) is the
    // cache's own knowledge. Returns a status.
    LLAMA_API int32_t llama_expert_cache_set_miss_costs(
            struct llama_context * ctx,
            int32_t                il,
            int64_t                cpu_expert_ns,
            int64_t                cpu_entry_ns,
            int64_t                upload_ns);

    // Miss path in effect for layer il (enum llama_expert_cache_miss_path), or a status.
    LLAMA_API int32_t llama_expert_cache_get_miss_path(
            const struct llama_context * ctx,
            int32_t                      il);

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

    // Expert held by each slot of layer il (-1: free) into out[0..n_slots). A slot whose
    // background admission has not landed yet holds -2 - expert. Returns n_slots or a status.
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

    // Steps not recorded because the trace was full.
    LLAMA_API int64_t llama_expert_cache_get_trace_dropped(const struct llama_context * ctx);

    // Zero the counters, the routing counts and the trace; the slots keep their experts.
    LLAMA_API void llama_expert_cache_reset_stats(struct llama_context * ctx);

    // Bytes of device memory held by the banks (a dry run: the bytes they would hold).
    LLAMA_API size_t llama_expert_cache_device_bytes(const struct llama_context * ctx);

    // llama.cpp's memory breakdown of ctx per buffer type (weights, context, compute) plus the
    // banks of its cache. Reserves the graph first if it changed (a cache attached since the
    // last decode), so the compute bytes are those of the graph in effect. With a no_alloc model
    // nothing is allocated and reading no tensor data: the bytes a real load would allocate.
    // Copies at most n_max entries into out (may be null when n_max is 0); returns the number of
    // buffer types, or a status.
    LLAMA_API int32_t llama_expert_cache_memory_breakdown(
            struct llama_context                * ctx,
            struct llama_expert_cache_mem_entry * out,
            int32_t                               n_max);

#ifdef __cplusplus
}
#endif
