// Spark expert cache: the policy core of one cached layer (see llama-expert-cache-policy.h).
#include "llama-expert-cache-policy.h"

#include <algorithm>

void llama_expert_cache_slots::init(int32_t n_expert_, int32_t n_slots_, int32_t n_pinned_, int32_t policy_,
        int32_t miss_path_, int32_t max_admit_, int32_t window_, int32_t protected_num, int32_t protected_den, int32_t n_stage_) {
    n_expert      = n_expert_;
    n_slots       = n_slots_;
    n_pinned      = n_pinned_;
    policy        = policy_;
    miss_path     = miss_path_;
    max_admit     = max_admit_;
    window        = window_ > 0 ? window_ : 0;
    protected_cap = (n_slots - n_pinned) * protected_num / protected_den;
    protected_n   = 0;
    age           = 0;
    n_distinct    = 0;
    tick          = 0;
    slot_expert.assign(n_slots, -1);
    slot_state.assign(n_slots, LLAMA_EXPERT_CACHE_SLOT_FREE);
    expert_slot.assign(n_expert, -1);
    slot_tick.assign(n_slots, 0);
    slot_step.assign(n_slots, 0);
    slot_seg.assign(n_slots, 0);
    freq.assign(n_expert, 0);
    filler_wait.assign(n_slots, 0);
    seen.assign(n_expert, 0);
    distinct.assign(n_expert, 0);
    admit.assign(2 * (size_t) n_expert, 0);
    n_stage    = n_stage_ > 0 ? n_stage_ : 0;
    stage_base = n_slots + 1;
    n_staged   = 0;
    expert_stage.assign(n_expert, -1);
    stage_expert.assign(n_stage, -1);
    entries.assign(n_expert, 0);
    order.assign(n_expert, 0);
}

void llama_expert_cache_slots::pin(int32_t slot, int32_t e) {
    slot_expert[slot] = e;
    slot_state[slot]  = LLAMA_EXPERT_CACHE_SLOT_READY;
    expert_slot[e]    = slot;
}

bool llama_expert_cache_slots::counts() const {
    return policy == LLAMA_EXPERT_CACHE_POLICY_ID_LFU_AGED || policy == LLAMA_EXPERT_CACHE_POLICY_ID_TINYLFU;
}

llama_expert_cache_mode llama_expert_cache_slots::mode(int64_t n_tokens, int64_t k, bool decode, bool hybrid) const {
    llama_expert_cache_mode m;
    m.fits = n_tokens * k <= n_slots - n_pinned;
    const bool per_expert = miss_path == LLAMA_EXPERT_CACHE_MISS_ID_AUTO;
    // NOTE: misses go to the CPU on the CPU and auto paths, and on any step too large for the LRU slots
    m.to_cpu = hybrid && (miss_path == LLAMA_EXPERT_CACHE_MISS_ID_CPU || per_expert || !m.fits);
    // NOTE: a multi-token step on the CPU path neither reorders nor admits: it must not flush
    // the decode working set
    m.read_only = m.to_cpu && !decode;
    // NOTE: the auto path splits every step's misses by cost; the upload path stages the misses
    // of a step too large for its slots (most entries first) while staging slices last
    m.split   = m.to_cpu && n_stage > 0 && (per_expert || miss_path == LLAMA_EXPERT_CACHE_MISS_ID_UPLOAD);
    m.by_cost = m.split && per_expert;
    return m;
}

// admissions of earlier steps become readable at the layer's next step that may change the slots
void llama_expert_cache_slots::land() {
    for (int32_t s = n_pinned; s < n_slots; ++s) {
        if (slot_state[s] == LLAMA_EXPERT_CACHE_SLOT_PENDING) {
            slot_state[s] = LLAMA_EXPERT_CACHE_SLOT_READY;
            expert_slot[slot_expert[s]] = s;
        }
    }
}

int32_t llama_expert_cache_slots::collect(const llama_expert_cache_ids & ids) {
    n_distinct = 0;
    for (int64_t t = 0; t < ids.n_tokens; ++t) {
        for (int64_t j = 0; j < ids.k; ++j) {
            const int32_t e = ids.at(t, j);
            if (e < 0 || e >= n_expert) {
                for (int32_t i = 0; i < n_distinct; ++i) {
                    seen[distinct[i]] = 0;
                }
                n_distinct = 0;
                return -1;
            }
            if (!seen[e]) {
                seen[e] = 1;
                distinct[n_distinct++] = e;
            }
        }
    }
    return n_distinct;
}

void llama_expert_cache_slots::touch(int32_t s) {
    slot_tick[s] = ++tick;
    if (policy == LLAMA_EXPERT_CACHE_POLICY_ID_SLRU && !slot_seg[s]) {
        slot_seg[s] = 1;
        if (++protected_n > protected_cap) {
            // the least recent protected slot goes back to probation (not evicted)
            int32_t d = -1;
            for (int32_t u = n_pinned; u < n_slots; ++u) {
                if (slot_seg[u] && (d < 0 || slot_tick[u] < slot_tick[d])) {
                    d = u;
                }
            }
            slot_seg[d] = 0;
            protected_n--;
        }
    }
}

// hits first, so that no expert this step needs can be evicted by its misses
void llama_expert_cache_slots::touch_hits(bool read_only, llama_expert_cache_outcome & out) {
    for (int32_t i = 0; i < n_distinct; ++i) {
        const int32_t s = expert_slot[distinct[i]];
        if (s >= 0) {
            out.hits++;
            slot_step[s] = 1;
            if (s >= n_pinned && !read_only) {
                touch(s);
            }
        }
    }
}

int32_t llama_expert_cache_slots::free_slot() const {
    for (int32_t s = n_pinned; s < n_slots; ++s) {
        if (slot_state[s] == LLAMA_EXPERT_CACHE_SLOT_FREE) {
            return s;
        }
    }
    return -1;
}

// the evictable slot (ready, not used by this step) with the smallest key: LRU tick;
// LFU (count, tick); SLRU (segment, tick)
int32_t llama_expert_cache_slots::victim_slot() const {
    const bool by_count = counts();
    int32_t v = -1;
    for (int32_t s = n_pinned; s < n_slots; ++s) {
        if (slot_state[s] != LLAMA_EXPERT_CACHE_SLOT_READY || slot_step[s]) {
            continue;
        }
        if (v < 0) {
            v = s;
            continue;
        }
        bool less = slot_tick[s] < slot_tick[v];
        if (by_count) {
            const uint32_t fs = freq[slot_expert[s]], fv = freq[slot_expert[v]];
            less = fs < fv || (fs == fv && less);
        } else if (policy == LLAMA_EXPERT_CACHE_POLICY_ID_SLRU && slot_seg[s] != slot_seg[v]) {
            less = slot_seg[s] < slot_seg[v];
        }
        v = less ? s : v;
    }
    return v;
}

void llama_expert_cache_slots::evict_into(int32_t s, int32_t e) {
    if (slot_expert[s] >= 0 && slot_state[s] == LLAMA_EXPERT_CACHE_SLOT_READY) {
        expert_slot[slot_expert[s]] = -1;
    }
    if (slot_seg[s]) {
        protected_n--;
    }
    slot_seg[s]    = 0;
    slot_expert[s] = e;
    slot_tick[s]   = ++tick;
    slot_step[s]   = 1;
}

const char * llama_expert_cache_slots::place_misses(const llama_expert_cache_mode & m, llama_expert_cache_outcome & out) {
    for (int32_t i = 0; i < n_distinct; ++i) {
        const int32_t e = distinct[i];
        if (expert_slot[e] >= 0) {
            continue;
        }
        out.misses++;
        int32_t s = -1;
        if (m.to_cpu) {
            out.n_cpu++;
            if (m.read_only) {
                continue; // no admission is tried
            }
            if (out.n_admit >= max_admit) {
                out.skipped++;
                continue;
            }
            s = free_slot();
            if (s < 0) {
                s = victim_slot();
                // TINYLFU: a miss displaces a resident expert only if it was routed more often
                if (s < 0 || (policy == LLAMA_EXPERT_CACHE_POLICY_ID_TINYLFU && freq[e] <= freq[slot_expert[s]])) {
                    out.skipped++;
                    continue;
                }
            }
            evict_into(s, e);
            slot_state[s] = LLAMA_EXPERT_CACHE_SLOT_PENDING; // readable from the layer's next decode step
        } else {
            s = free_slot();
            s = s >= 0 ? s : victim_slot();
            if (s < 0) {
                return "no evictable slot (step larger than the LRU slots)";
            }
            evict_into(s, e);
            slot_state[s]  = LLAMA_EXPERT_CACHE_SLOT_READY;
            expert_slot[e] = s;
        }
        admit[2 * out.n_admit]     = e;
        admit[2 * out.n_admit + 1] = s;
        out.n_admit++;
    }
    return nullptr;
}

// A step too large for the LRU slots, while some are free (a cold start): the misses with most
// entries (then lower id), as many as there are free slots, are placed in them READY, the one with
// most entries last (the most recent). Hits are not touched and no count changes, as in a step too
// large for the slots. Returns how many were placed (their (expert, slot) pairs in admit), or -1 for
// an id out of range. simulator.py's LayerCache.fill_free is its specification.
int32_t llama_expert_cache_slots::fill_free(const llama_expert_cache_ids & ids) {
    int32_t n_free = 0;
    for (int32_t s = n_pinned; s < n_slots; ++s) {
        n_free += slot_state[s] == LLAMA_EXPERT_CACHE_SLOT_FREE;
    }
    if (collect(ids) < 0) {
        return -1;
    }
    int32_t n_miss = 0;
    for (int32_t i = 0; i < n_distinct; ++i) {
        const int32_t e = distinct[i];
        seen[e] = 0;
        if (expert_slot[e] < 0) {
            entries[e] = 0;
            order[n_miss++] = e;
        }
    }
    if (n_free == 0 || n_miss == 0) {
        return 0;
    }
    for (int64_t t = 0; t < ids.n_tokens; ++t) {
        for (int64_t j = 0; j < ids.k; ++j) {
            const int32_t e = ids.at(t, j);
            entries[e] += expert_slot[e] < 0;
        }
    }
    std::sort(order.begin(), order.begin() + n_miss, [&](int32_t a, int32_t b) {
        return entries[a] > entries[b] || (entries[a] == entries[b] && a < b);
    });
    const int32_t n = std::min(n_free, n_miss);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t e = order[n - 1 - i];
        const int32_t s = free_slot();
        evict_into(s, e);
        slot_step[s]   = 0;
        slot_state[s]  = LLAMA_EXPERT_CACHE_SLOT_READY;
        expert_slot[e] = s;
        admit[2 * i]     = e;
        admit[2 * i + 1] = s;
    }
    return n;
}

void llama_expert_cache_slots::clear_stage() {
    for (int32_t i = 0; i < n_staged; ++i) {
        expert_stage[stage_expert[i]] = -1;
    }
    n_staged = 0;
}

// The step's misses that are not admitted in it (an admitted one is computed on the CPU while its
// upload runs: never uploaded twice in a step), most entries first (then lower id), go to staging
// slices while that ends the step sooner: the upload queue and the CPU queue run side by side
// (concurrent) or one after the other. The split changes no slot.
void llama_expert_cache_slots::stage_misses(const llama_expert_cache_ids & ids, const llama_expert_cache_mode & m,
        llama_expert_cache_outcome & out) {
    auto admitted = [&](int32_t e) {
        for (int32_t a = 0; a < out.n_admit; ++a) {
            if (admit[2 * a] == e) {
                return true;
            }
        }
        return false;
    };
    int32_t n_miss = 0;
    for (int32_t i = 0; i < n_distinct; ++i) {
        const int32_t e = distinct[i];
        if (expert_slot[e] < 0 && !admitted(e)) {
            entries[e] = 0;
            order[n_miss++] = e;
        }
    }
    for (int64_t t = 0; t < ids.n_tokens; ++t) {
        for (int64_t j = 0; j < ids.k; ++j) {
            const int32_t e = ids.at(t, j);
            entries[e] += expert_slot[e] < 0;
        }
    }
    std::sort(order.begin(), order.begin() + n_miss, [&](int32_t a, int32_t b) {
        return entries[a] > entries[b] || (entries[a] == entries[b] && a < b);
    });
    int64_t cpu_left = 0, up = 0;
    auto cpu_of = [&](int32_t e) { return costs.cpu_expert_ns + (int64_t) entries[e] * costs.cpu_ns; };
    for (int32_t i = 0; i < n_miss; ++i) {
        cpu_left += cpu_of(order[i]);
    }
    auto ends = [&](int64_t u, int64_t c) { return costs.concurrent ? std::max(u, c) : u + c; };
    for (int32_t i = 0; i < n_miss && n_staged < n_stage; ++i) {
        const int32_t e = order[i];
        if (m.by_cost) {
            // NOTE: entries only fall along the order, so once moving one does not help, none does
            const int64_t c = cpu_of(e);
            if (ends(up + costs.upload_ns, cpu_left - c) >= ends(up, cpu_left)) {
                break;
            }
            up       += costs.upload_ns;
            cpu_left -= c;
        }
        expert_stage[e] = n_staged;
        stage_expert[n_staged++] = e;
    }
    out.n_staged = n_staged;
    out.n_cpu   -= n_staged;
}

const char * llama_expert_cache_slots::step(const llama_expert_cache_ids & ids, const llama_expert_cache_mode & m,
        llama_expert_cache_outcome & out) {
    out = {};
    clear_stage();
    if (!m.to_cpu && !m.fits) {
        return "step larger than the LRU slots without a CPU path";
    }
    if (!m.read_only) {
        land();
    }
    if (collect(ids) < 0) {
        return "routed expert id out of range";
    }
    const bool by_count = counts();
    if (by_count && !m.read_only) {
        for (int32_t i = 0; i < n_distinct; ++i) {
            uint32_t & f = freq[distinct[i]];
            f += f < UINT32_MAX;
        }
    }
    touch_hits(m.read_only, out);
    const char * err = place_misses(m, out);
    if (!err && m.split) {
        stage_misses(ids, m, out);
    }
    if (by_count && !m.read_only && window > 0 && ++age >= window) {
        for (uint32_t & f : freq) {
            f >>= 1;
        }
        age = 0;
    }
    for (int32_t i = 0; i < n_distinct; ++i) {
        seen[distinct[i]] = 0;
    }
    std::fill(slot_step.begin(), slot_step.end(), 0);
    return err;
}

// a filler for an entry the CPU computes: a slot no other entry of the token reads (see remap)
int32_t llama_expert_cache_slots::filler_for(const int32_t * row, int64_t k, bool allow_pending) const {
    for (int32_t c = -1; c < n_slots; ++c) {
        const int32_t s = c < 0 ? n_slots : c;
        if (std::find(row, row + k, s) != row + k) {
            continue;
        }
        if (!allow_pending && s < n_slots && slot_state[s] == LLAMA_EXPERT_CACHE_SLOT_PENDING) {
            continue;
        }
        return s;
    }
    return -1;
}

// NOTE: an entry the CPU computes reads a filler that no other entry of the token reads (device
// kernels assume an id at most once per token: Vulkan's MUL_MAT_ID computes at most n_tokens rows
// of an id, CUDA's mm_ids_helper keeps one); the mask node drops its device output. Fillers, in
// order: the zeroed guard, a slot that is not pending (zeroed if never used, else a landed expert:
// finite weights), and only if the token needs more, a pending slot, which the device then waits
// for. n_slots >= k, so a filler exists.
const char * llama_expert_cache_slots::remap(const llama_expert_cache_ids & ids, int32_t * dst, uint8_t * missed, bool & any_wait) {
    const int64_t k = ids.k;
    any_wait = false;
    for (int64_t t = 0; t < ids.n_tokens; ++t) {
        int32_t * row = dst + t * k;
        for (int64_t j = 0; j < k; ++j) {
            const int32_t e = ids.at(t, j);
            row[j] = expert_slot[e];
            if (row[j] < 0 && expert_stage[e] >= 0) {
                row[j] = stage_base + expert_stage[e];
            }
            if (missed) {
                missed[t * k + j] = row[j] < 0;
            }
        }
        for (int64_t j = 0; j < k; ++j) {
            if (row[j] >= 0) {
                continue;
            }
            int32_t s = filler_for(row, k, false);
            if (s < 0) {
                s = filler_for(row, k, true);
                if (s < 0 || s >= n_slots) {
                    return "no filler slot";
                }
                filler_wait[s] = 1;
                any_wait = true;
            }
            row[j] = s;
        }
    }
    return nullptr;
}
