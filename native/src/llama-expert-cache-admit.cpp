// Spark expert cache: a step's uploads: staged misses into staging slices, and admissions into slots
// (blocking, or on the device's second backend in the background).
#include "llama-expert-cache-impl.h"

using namespace llama_expert_cache_impl;

// the step's staged misses into its staging slices: on the upload queue, the device's compute
// waiting only for their event, or blocking. NOTE: a slice is reused by the layer's next step only
// after its host node saw this step's ids, so after the device finished the matmuls reading it.
void llama_expert_cache::upload_staged(llama_expert_cache_layer & L, int32_t n_staged) {
    if (n_staged == 0) {
        return;
    }
    const bool background = !L.file_tier && L.slots.costs.concurrent && L.compute_backend != nullptr;
    uint64_t bytes = 0, blocking = 0;
    if (L.file_tier) {
        std::vector<int32_t> ss(n_staged);
        for (int32_t i = 0; i < n_staged; ++i) {
            ss[i] = L.slots.stage_base + i;
        }
        read_experts(L, L.slots.stage_expert.data(), ss.data(), n_staged);
    }
    for (int32_t i = 0; i < n_staged; ++i) {
        const int32_t e = L.slots.stage_expert[i];
        const size_t  s = (size_t) (L.slots.stage_base + i);
        for (auto & b : L.banks) {
            const size_t nb = b.src->nb[2];
            const void * src = (const char *) b.src->data + (size_t) e * nb;
            if (L.file_tier) {
                blocking++;
            } else if (background) {
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
    if (L.file_tier && n_admit > 0) { // NOTE: every miss of the step in flight at once
        read_experts(L, &L.slots.admit[0], &L.slots.admit[1], n_admit, 2);
    }
    for (int32_t a = 0; a < n_admit; ++a) {
        const int32_t e = L.slots.admit[2 * a];
        const int32_t s = L.slots.admit[2 * a + 1];
        for (auto & b : L.banks) {
            const size_t nb = b.src->nb[2];
            const void * src = (const char *) b.src->data + (size_t) e * nb;
            if (L.file_tier) {
                blocking++;
            } else if (background) {
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
