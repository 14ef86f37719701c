// Spark expert cache: the CPU miss path: non-resident experts computed from the host weights with
// the ggml CPU kernels, on private one-thread workers.
#include "llama-expert-cache-impl.h"

using namespace llama_expert_cache_impl;

void llama_expert_cache::size_workers(const llama_expert_cache_layer & L, int64_t n_entries, int64_t n_embd_in) {
    // NOTE: at graph build; a step only resets these contexts (ggml_init allocates). A worker's share
    // of a step's entries is at most ceil(n_entries / W): one pass holds it.
    const int64_t W = (int64_t) workers.size();
    const int64_t rows = std::max<int64_t>(1, (n_entries + W - 1) / W);
    size_t need = ggml_graph_overhead_custom(RECIPE_MAX * 2, false) + ggml_tensor_overhead() * (RECIPE_MAX * 2 + 8) + 4096;
    need += GGML_PAD(ggml_row_size(GGML_TYPE_F32, n_embd_in) * rows, 64) + GGML_PAD(sizeof(int32_t) * rows, 64) + 128;
    for (const auto & r : L.recipe) {
        if (r.op != GGML_OP_VIEW) {
            need += GGML_PAD(ggml_row_size(r.type, r.ne0) * rows, 64) + 64;
        }
    }
    for (auto & w : workers) {
        if (w.arena.size() >= need && w.ctx) {
            w.rows = std::max(w.rows, rows);
            continue;
        }
        if (w.ctx) {
            ggml_free(w.ctx);
        }
        w.arena.resize(std::max(w.arena.size(), need));
        ggml_init_params ip = { /*.mem_size =*/ w.arena.size(), /*.mem_buffer =*/ w.arena.data(), /*.no_alloc =*/ false };
        w.ctx = ggml_init(ip);
        GGML_ASSERT(w.ctx);
        w.rows = std::max(w.rows, rows);
    }
}

void llama_expert_cache::compute_partial(llama_expert_cache_node & n, ggml_tensor * dst, int ith, int nth) {
    llama_expert_cache_layer & L = *n.layer;
    const ggml_tensor * slots = dst->src[0]; // [k, n_tokens] contiguous, from the remap node
    const int32_t * sel = L.sel.data();      // [k * n_tokens], the routed ids the remap node read
    const int64_t k  = slots->ne[0];
    const int64_t kT = k * slots->ne[1];
    const int64_t n_embd_out = dst->ne[0];
    const uint8_t * missed = L.missed.data(); // written by the remap node of this step
    GGML_ASSERT((int64_t) L.missed.size() >= kT);
    int64_t zero = 0;
    cpu_t0.compare_exchange_strong(zero, ggml_time_us());
    const bool cpu = !L.recipe.empty() && !workers.empty();
    int64_t n_miss = 0;
    for (int64_t i = 0; i < kT; ++i) {
        n_miss += missed[i];
    }
    // the node's last thread to finish (also on an exception) adds the wall time from the first start
    struct last_out {
        llama_expert_cache & ec; llama_expert_cache_layer & L; int nth; bool timed; int64_t entries;
        ~last_out() {
            if (ec.cpu_done.fetch_add(1) + 1 == nth) {
                const int64_t us = ggml_time_us() - ec.cpu_t0.exchange(0);
                ec.cpu_done.store(0);
                if (timed) {
                    std::lock_guard<std::mutex> lock(ec.mutex);
                    L.stats.cpu_us      += us;
                    L.stats.cpu_entries += entries;
                }
            }
        }
    } out_guard{*this, L, nth, cpu && n_miss > 0, n_miss};

    // each thread zeroes its range of the device's entries (row t*k + j); a missed entry is written by
    // its expert's worker
    for (int64_t i = kT * ith / nth; i < kT * (ith + 1) / nth; ++i) {
        if (!missed[i] || !cpu) {
            memset((char *) dst->data + i * dst->nb[1], 0, n_embd_out * sizeof(float));
        }
    }
    if (ith == nth - 1) {
        write_tail(L, dst);
    }
    const int64_t W = std::min<int64_t>(nth, (int64_t) workers.size());
    if (cpu && n_miss > 0 && ith < W) {
        // the missed entries in (expert, entry) order, split evenly by count; every thread derives the
        // same order. An expert's entries may span two workers: the CPU kernel's output for an entry is
        // its own dot products with the expert's rows, whatever other entries share the pass.
        auto & w = workers[ith];
        auto id_of = [&](int64_t i) { return sel[i]; };
        std::fill(w.expert_rows.begin(), w.expert_rows.end(), 0);
        for (int64_t i = 0; i < kT; ++i) {
            if (missed[i]) {
                w.expert_rows[id_of(i)]++;
            }
        }
        int64_t at = 0;
        for (int64_t e = 0; e < n_expert; ++e) { // counts -> each expert's first position
            const int64_t c = w.expert_rows[e];
            w.expert_rows[e] = at;
            at += c;
        }
        const int64_t r0 = n_miss * ith / W, r1 = n_miss * (ith + 1) / W;
        w.order.resize(r1 - r0);
        for (int64_t i = 0; i < kT; ++i) {
            if (missed[i]) {
                const int64_t pos = w.expert_rows[id_of(i)]++;
                if (pos >= r0 && pos < r1) {
                    w.order[pos - r0] = i;
                }
            }
        }
        compute_entries(w, L, dst);
    }
}

// One worker's missed entries (w.order: index t*k + j, grouped by expert), in passes that fit its arena.
void llama_expert_cache::compute_entries(llama_expert_cache_worker & w, llama_expert_cache_layer & L, ggml_tensor * dst) {
    const ggml_tensor * cur = dst->src[1]; // [n_embd + k, n_tokens]: the input rows, then the routed ids
    const int64_t k = dst->src[0]->ne[0];
    const int64_t n_embd_in  = cur->ne[0] - k;
    const int64_t n_embd_out = dst->ne[0];
    const int64_t n = (int64_t) w.order.size();
    GGML_ASSERT(w.rows > 0);
    for (int64_t p0 = 0; p0 < n; p0 += w.rows) {
        const int64_t rows = std::min(w.rows, n - p0);
        ggml_context * pctx = w.ctx;
        ggml_reset(pctx);

        // the pass's entries, one row each: their input row and their expert id
        ggml_tensor * x  = ggml_new_tensor_3d(pctx, GGML_TYPE_F32, n_embd_in, rows, 1);
        ggml_tensor * xi = ggml_new_tensor_2d(pctx, GGML_TYPE_I32, rows, 1);
        for (int64_t m = 0; m < rows; ++m) {
            const int64_t i = w.order[p0 + m], t = i / k, j = i % k;
            memcpy((char *) x->data + m * x->nb[1], (const char *) cur->data + t * cur->nb[1], n_embd_in * sizeof(float));
            ((int32_t *) xi->data)[m] = L.sel[t * k + j];
        }
        ggml_tensor * res = build_recipe(L, pctx, x, xi, rows); // [n_embd, rows, 1]
        GGML_ASSERT(res->ne[0] == n_embd_out);
        ggml_cgraph * gf = ggml_new_graph_custom(pctx, RECIPE_MAX * 2, false);
        ggml_build_forward_expand(gf, res);
        const ggml_status st = ggml_backend_graph_compute(w.backend, gf);
        GGML_ASSERT(st == GGML_STATUS_SUCCESS);

        // each entry's output goes where the device's is dropped
        for (int64_t m = 0; m < rows; ++m) {
            const int64_t i = w.order[p0 + m], t = i / k, j = i % k;
            memcpy((char *) dst->data + (t * k + j) * dst->nb[1], (const char *) res->data + m * res->nb[1],
                   n_embd_out * sizeof(float));
        }
    }
}

// the recipe's ops on [.., n_miss, 1] instead of [.., k, n_tokens]: per entry the same arithmetic
ggml_tensor * llama_expert_cache::build_recipe(const llama_expert_cache_layer & L, ggml_context * pctx, ggml_tensor * x,
        ggml_tensor * xi, int64_t n_miss) {
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
    return ops[n_ops - 1];
}

// after the entries' rows of the packed output: the mask, then the slot ids as F32 (build_cpu_nodes)
void llama_expert_cache::write_tail(const llama_expert_cache_layer & L, ggml_tensor * dst) {
    const ggml_tensor * slots = dst->src[0]; // [k, n_tokens] contiguous
    const int64_t kT   = slots->ne[0] * slots->ne[1];
    const int64_t rows = (kT + dst->ne[0] - 1) / dst->ne[0];
    GGML_ASSERT((int64_t) L.missed.size() >= kT && dst->ne[1] == kT + 2 * rows);
    float * mask = (float *) ((char *) dst->data + kT * dst->nb[1]);
    float * ids  = (float *) ((char *) dst->data + (kT + rows) * dst->nb[1]);
    const int32_t * s = (const int32_t *) slots->data;
    for (int64_t i = 0; i < kT; ++i) {
        mask[i] = L.missed[i] ? 0.0f : 1.0f;
        ids[i]  = (float) s[i];
    }
}
