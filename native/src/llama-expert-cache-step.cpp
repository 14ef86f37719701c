// Spark expert cache: one host node's step: the routed ids, the policy's plan, the remap, the counts
// and the trace.
#include "llama-expert-cache-impl.h"

using namespace llama_expert_cache_impl;

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

} // namespace

namespace llama_expert_cache_impl {

void node_remap(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith == 0) {
        auto * n = (llama_expert_cache_node *) userdata;
        guarded(n->layer->owner, "remap", [&] { n->layer->owner->step(*n, dst->src[0], dst, true); });
    }
}

void node_count(ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) nth;
    if (ith == 0) {
        auto * n = (llama_expert_cache_node *) userdata;
        guarded(n->layer->owner, "count", [&] { n->layer->owner->step(*n, dst->src[0], dst, false); });
    }
}

void node_partial(ggml_tensor * dst, int ith, int nth, void * userdata) {
    auto * n = (llama_expert_cache_node *) userdata;
    guarded(n->layer->owner, "cpu miss path", [&] { n->layer->owner->compute_partial(*n, dst, ith, nth); });
}

} // namespace llama_expert_cache_impl

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
    const bool ahead_on = ahead_step(L, n, v, remap);
    if (ahead_pending >= 0 && !(ahead_on && ahead_pending == L.il)) {
        ahead_drain(); // NOTE: another step may use the staging slices the reads ahead land in
    }
    if (L.file_tier && !ahead_on) {
        ahead_last = -1;
    }

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
    if (L.file_tier && v.n_tokens * v.k > L.slots.n_slots - L.slots.n_pinned) {
        stage_file_step(L, v, (int32_t *) dst->data, lock);
        return;
    }

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
    if (L.file_tier) { // NOTE: its bank has no guard slice: slot n_slots is the next layer's slot 0
        const int32_t * ids = (const int32_t *) dst->data;
        for (int64_t i = 0; i < v.n_tokens * v.k; ++i) {
            GGML_ASSERT(ids[i] < L.slots.n_slots && "a file-tier entry without its expert in a slot");
        }
    }

    // NOTE: uploads run without the lock; only this thread changes the slots
    lock.unlock();
    const int32_t n_admit = ahead_on ? ahead_take(L, o.n_admit) : o.n_admit;
    upload_staged(L, o.n_staged);
    upload_admissions(L, n_admit, m.to_cpu && L.upload_backend != nullptr, any_wait);
    if (ahead_on) {
        ahead_issue(L, v);
    }
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
