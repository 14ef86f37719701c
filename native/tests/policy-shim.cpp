// A C wrapper of the policy core for tests/test_policy_core.py (not part of the library).
#include "llama-expert-cache-policy.h"

#include <cstdio>
#include <cstring>

extern "C" {

void * ecp_new(int32_t n_expert, int32_t n_slots, const int32_t * pinned, int32_t n_pinned, int32_t policy,
        int32_t miss_path, int32_t max_admit, int32_t window, int32_t protected_num, int32_t protected_den, int32_t n_stage) {
    auto * c = new llama_expert_cache_slots();
    c->init(n_expert, n_slots, n_pinned, policy, miss_path, max_admit, window, protected_num, protected_den, n_stage);
    for (int32_t j = 0; j < n_pinned; ++j) {
        c->pin(j, pinned[j]);
    }
    return c;
}

void ecp_set_costs(void * h, int64_t cpu_expert_ns, int64_t cpu_ns, int64_t upload_ns, int32_t concurrent) {
    auto & c = *(llama_expert_cache_slots *) h;
    c.costs.cpu_expert_ns = cpu_expert_ns;
    c.costs.cpu_ns     = cpu_ns;
    c.costs.upload_ns  = upload_ns;
    c.costs.concurrent = concurrent != 0;
}

void ecp_free(void * h) {
    delete (llama_expert_cache_slots *) h;
}

// One step as the host node runs it. ids: [n_tokens, k] token-major. out: hits, misses, n_cpu,
// skipped, n_admit, fits, to_cpu, read_only, n_staged, split. admit: [2 * n_expert]; dst, missed: [n_tokens * k];
// waits: [n_slots] the pending slots read as fillers. Returns 0, or -1 and a message in err.
int32_t ecp_step(void * h, const int32_t * ids, int64_t n_tokens, int64_t k, int32_t decode, int32_t hybrid,
        int32_t * out, int32_t * admit, int32_t * dst, uint8_t * missed, uint8_t * waits, char * err, size_t err_len) {
    auto & c = *(llama_expert_cache_slots *) h;
    llama_expert_cache_ids v;
    v.data     = ids;
    v.k        = k;
    v.n_tokens = n_tokens;
    v.nb0      = sizeof(int32_t);
    v.nb1      = k * sizeof(int32_t);
    const llama_expert_cache_mode m = c.mode(n_tokens, k, decode != 0, hybrid != 0);
    llama_expert_cache_outcome o;
    const char * e = c.step(v, m, o);
    bool any_wait = false;
    if (!e) {
        e = c.remap(v, dst, missed, any_wait);
    }
    if (e) {
        snprintf(err, err_len, "%s", e);
        return -1;
    }
    const int32_t r[10] = { o.hits, o.misses, o.n_cpu, o.skipped, o.n_admit, m.fits, m.to_cpu, m.read_only, o.n_staged, m.split };
    memcpy(out, r, sizeof(r));
    memcpy(admit, c.admit.data(), 2 * (size_t) o.n_admit * sizeof(int32_t));
    for (int32_t s = 0; s < c.n_slots; ++s) {
        waits[s] = c.filler_wait[s];
        c.filler_wait[s] = 0;
    }
    return 0;
}

// The RAM tier's step too large for its LRU slots: the free slots filled (slots.fill_free). ids:
// [n_tokens, k] token-major; admit: [2 * n_expert]. Returns the placements, or -1 for a bad id.
int32_t ecp_fill_free(void * h, const int32_t * ids, int64_t n_tokens, int64_t k, int32_t * admit) {
    auto & c = *(llama_expert_cache_slots *) h;
    llama_expert_cache_ids v;
    v.data     = ids;
    v.k        = k;
    v.n_tokens = n_tokens;
    v.nb0      = sizeof(int32_t);
    v.nb1      = k * sizeof(int32_t);
    const int32_t n = c.fill_free(v);
    if (n > 0) {
        memcpy(admit, c.admit.data(), 2 * (size_t) n * sizeof(int32_t));
    }
    return n;
}

// slot_expert (-2 - e: pending), slot_tick, slot_seg: [n_slots]; expert_slot, freq: [n_expert];
// scalars: protected_n, age, tick
void ecp_state(void * h, int32_t * slot_expert, uint64_t * slot_tick, uint8_t * slot_seg, int32_t * expert_slot,
        uint32_t * freq, int64_t * scalars) {
    const auto & c = *(const llama_expert_cache_slots *) h;
    for (int32_t s = 0; s < c.n_slots; ++s) {
        const bool pending = c.slot_state[s] == LLAMA_EXPERT_CACHE_SLOT_PENDING;
        slot_expert[s] = pending ? -2 - c.slot_expert[s] : c.slot_expert[s];
        slot_tick[s]   = c.slot_tick[s];
        slot_seg[s]    = c.slot_seg[s];
    }
    for (int32_t e = 0; e < c.n_expert; ++e) {
        expert_slot[e] = c.expert_slot[e];
        freq[e]        = c.freq[e];
    }
    scalars[0] = c.protected_n;
    scalars[1] = c.age;
    scalars[2] = (int64_t) c.tick;
}

}
