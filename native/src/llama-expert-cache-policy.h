// Spark expert cache: the policy core of one cached layer (std C++ only: no ggml, no llama).
// Which experts the slots hold, which routed ids of a step hit, where misses go, which are
// admitted, and the slot ids the expert matmuls read. spark_cli/simulator.py's LayerCache is
// its specification; tests/test_policy_core.py replays random steps through both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

// NOTE: the values of enum llama_expert_cache_policy and llama_expert_cache_miss_path
// (llama-expert-cache-api.h, which needs llama.h); llama-expert-cache.cpp checks they agree
enum llama_expert_cache_policy_id : int32_t {
    LLAMA_EXPERT_CACHE_POLICY_ID_LRU      = 0,
    LLAMA_EXPERT_CACHE_POLICY_ID_LFU_AGED = 1,
    LLAMA_EXPERT_CACHE_POLICY_ID_SLRU     = 2,
    LLAMA_EXPERT_CACHE_POLICY_ID_TINYLFU  = 3,
};

enum llama_expert_cache_miss_path_id : int32_t {
    LLAMA_EXPERT_CACHE_MISS_ID_UPLOAD = 0,
    LLAMA_EXPERT_CACHE_MISS_ID_CPU    = 1,
    LLAMA_EXPERT_CACHE_MISS_ID_AUTO   = 2,
};

enum llama_expert_cache_slot_state : uint8_t {
    LLAMA_EXPERT_CACHE_SLOT_FREE    = 0,
    LLAMA_EXPERT_CACHE_SLOT_READY   = 1,
    LLAMA_EXPERT_CACHE_SLOT_PENDING = 2, // a background admission that has not landed: neither read nor evicted
};

// The routed ids of one step, [k, n_tokens], read by byte strides (a view of the top-k).
struct llama_expert_cache_ids {
    const void * data = nullptr;
    int64_t k        = 0;
    int64_t n_tokens = 0;
    size_t  nb0      = sizeof(int32_t);
    size_t  nb1      = 0;

    int32_t at(int64_t t, int64_t j) const {
        return *(const int32_t *) ((const char *) data + t * nb1 + j * nb0);
    }
};

// How a step is served: decided before it touches the slots.
struct llama_expert_cache_mode {
    bool fits      = false; // n_tokens * k <= the LRU slots
    bool to_cpu    = false; // misses are computed on the CPU (admitted in the background)
    bool read_only = false; // nothing is touched or admitted, pending admissions do not land
    bool split     = false; // misses are staged (uploaded for this step only) or computed on the CPU, per expert
    bool by_cost   = false; // split: by the layer's costs (AUTO); else the misses with most entries, while staging lasts
};

// The per-expert split's costs: integer nanoseconds, so the simulator replays the split exactly.
struct llama_expert_cache_costs {
    int64_t cpu_expert_ns = 0;  // CPU time of a missed expert: cpu_expert_ns + cpu_ns per (token, expert) entry,
    int64_t cpu_ns     = 0;     // at the run's threads
    int64_t upload_ns  = 0;     // upload time of one expert into a staging slice
    bool    concurrent = false; // staged uploads run beside the CPU work (else before it)
};

// What one step did.
struct llama_expert_cache_outcome {
    int32_t hits     = 0; // distinct experts read from a ready slot
    int32_t misses   = 0; // the other distinct experts
    int32_t n_cpu    = 0; // misses computed on the CPU
    int32_t skipped  = 0; // CPU path: misses not admitted (max_admit, no victim, tinylfu)
    int32_t n_admit  = 0; // (expert, slot) pairs in admit: placed (upload path) or admitted
    int32_t n_staged = 0; // misses uploaded into staging slices for this step (not counted in n_cpu)
};

struct llama_expert_cache_slots {
    int32_t n_expert      = 0;
    int32_t n_slots       = 0; // 0: counting only
    int32_t n_pinned      = 0;
    int32_t policy        = LLAMA_EXPERT_CACHE_POLICY_ID_LRU;
    int32_t miss_path     = LLAMA_EXPERT_CACHE_MISS_ID_UPLOAD;
    int32_t max_admit     = 0;
    int32_t window        = 0; // LFU_AGED, TINYLFU: halve the counts every window steps (0: never)
    int32_t protected_cap = 0; // SLRU: protected slots at most
    int32_t protected_n   = 0; // SLRU: protected slots now
    int32_t age           = 0; // steps since the counts were last halved
    int32_t n_distinct    = 0; // of the current step
    int32_t n_stage       = 0; // staging slices the layer may use this step
    int32_t stage_base    = 0; // the slot id of staging slice 0 (n_slots + 1: right after the guard)
    int32_t n_staged      = 0; // of the current step
    uint64_t tick         = 0;
    llama_expert_cache_costs costs;

    std::vector<int32_t>  slot_expert; // [n_slots] expert in slot, -1 free
    std::vector<uint8_t>  slot_state;  // [n_slots] llama_expert_cache_slot_state
    std::vector<int32_t>  expert_slot; // [n_expert] slot of a READY expert, -1 otherwise
    std::vector<uint64_t> slot_tick;   // [n_slots] last use, for LRU
    std::vector<uint8_t>  slot_step;   // [n_slots] used by the current step
    std::vector<uint8_t>  slot_seg;    // [n_slots] SLRU: 1 protected, 0 probation
    std::vector<uint32_t> freq;        // [n_expert] LFU_AGED, TINYLFU: routed steps, aged
    std::vector<uint8_t>  filler_wait; // [n_slots] a pending slot read as a filler this step (cleared by the reader)
    std::vector<uint8_t>  seen;        // [n_expert] scratch: already listed in this step
    std::vector<int32_t>  distinct;    // [n_expert] scratch: distinct experts of the step
    std::vector<int32_t>  admit;       // [2 * n_expert] (expert, slot) placements of the step
    std::vector<int32_t>  expert_stage; // [n_expert] staging slice of a miss staged this step, -1 otherwise
    std::vector<int32_t>  stage_expert; // [n_stage] the expert staged in each slice this step
    std::vector<int32_t>  entries;      // [n_expert] scratch: a step's entries per missed expert
    std::vector<int32_t>  order;        // [n_expert] scratch: the misses, most entries first

    // protected_num / protected_den: the SLRU protected share of the LRU slots
    void init(int32_t n_expert, int32_t n_slots, int32_t n_pinned, int32_t policy, int32_t miss_path,
              int32_t max_admit, int32_t window, int32_t protected_num, int32_t protected_den, int32_t n_stage = 0);
    void pin(int32_t slot, int32_t e); // a pinned expert in one of the first n_pinned slots

    llama_expert_cache_mode mode(int64_t n_tokens, int64_t k, bool decode, bool hybrid) const;

    // One step: pending admissions land (unless read-only; the caller orders the device after
    // their uploads first), then hits, misses and placements. Returns an error or nullptr.
    const char * step(const llama_expert_cache_ids & ids, const llama_expert_cache_mode & m, llama_expert_cache_outcome & out);

    // Slot ids for the expert matmuls ([k, n_tokens] contiguous) after step(); missed (may be
    // null): 1 for an entry the CPU computes. Sets filler_wait; any_wait: some slot was set.
    // A staged miss reads its staging slice (stage_base + i).
    const char * remap(const llama_expert_cache_ids & ids, int32_t * dst, uint8_t * missed, bool & any_wait);

    void land();
    int32_t collect(const llama_expert_cache_ids & ids); // distinct ids in order of first appearance; -1: an id out of range
    void touch_hits(bool read_only, llama_expert_cache_outcome & out);
    void touch(int32_t s);
    int32_t free_slot() const;
    int32_t victim_slot() const;
    void evict_into(int32_t s, int32_t e);
    const char * place_misses(const llama_expert_cache_mode & m, llama_expert_cache_outcome & out);
    void stage_misses(const llama_expert_cache_ids & ids, const llama_expert_cache_mode & m, llama_expert_cache_outcome & out);
    void clear_stage();
    // A step too large for the LRU slots (the file tier's prefill) fills the free ones: see the .cpp
    int32_t fill_free(const llama_expert_cache_ids & ids);
    int32_t filler_for(const int32_t * row, int64_t k, bool allow_pending) const;
    bool counts() const;
};
