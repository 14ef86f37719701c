// Spark expert cache: the nodes a cached layer adds to the graph (remap, count, the hybrid stop's
// packed input, the CPU miss path's node) and the analysis of the ops the miss path rebuilds.
#include "llama-expert-cache-impl.h"

using namespace llama_expert_cache_impl;

namespace {

// ops the CPU miss path may rebuild between the expert matmuls and the down projection
bool recipe_op_ok(ggml_op op) {
    switch (op) {
        case GGML_OP_MUL_MAT_ID:
        case GGML_OP_ADD_ID:
        case GGML_OP_VIEW:
        case GGML_OP_GLU:
        case GGML_OP_UNARY:
        case GGML_OP_CLAMP:
        case GGML_OP_SCALE:
        case GGML_OP_ADD:
        case GGML_OP_SUB:
        case GGML_OP_MUL:
        case GGML_OP_DIV:
        case GGML_OP_SQR:
        case GGML_OP_SQRT:
            return true;
        default:
            return false;
    }
}

// expert weights (a bank or its host tensor): the host tensor
ggml_tensor * host_of(const llama_expert_cache_layer & L, const ggml_tensor * t) {
    for (const auto & b : L.banks) {
        if (t == b.bank || t == b.src) {
            return b.src;
        }
    }
    return nullptr;
}

const size_t MIRROR_MAX = (size_t) 64 << 20; // device leaves (biases) copied to the host at most this big
} // namespace

ggml_tensor * llama_expert_cache::build(
        ggml_context        * ctx0,
        ggml_backend_sched_t  sched,
        ggml_backend_t        backend_cpu,
        int                   il,
        int64_t               n_ubatch_tokens,
        ggml_tensor         * cur,
        ggml_tensor         * selected_experts,
        bool                  can_remap,
        ggml_tensor        ** up_exps,
        ggml_tensor        ** gate_exps,
        ggml_tensor        ** down_exps,
        ggml_tensor        ** gate_up_exps) {
    llama_expert_cache_layer * L = layer(il);
    if (!L || !backend_cpu) {
        return selected_experts;
    }
    const int64_t k        = selected_experts->ne[0];
    const int64_t n_tokens = selected_experts->ne[1];
    // NOTE: the hook passes 1 for a decode step, one token per sequence (several with -np)
    const int phase = n_ubatch_tokens == 1 ? LLAMA_EXPERT_CACHE_PHASE_DECODE : LLAMA_EXPERT_CACHE_PHASE_PREFILL;
    L->building_remap = L->building_partial = L->building_count = L->building_part = L->building_mask = nullptr;
    L->building_node = nullptr;
    L->building_cur = cur;
    L->building_sel = selected_experts;

    // NOTE: warm-up routes every expert (n_expert_used = n_expert): leave it stock and uncounted; an
    // uncached layer stays stock unless its routing is counted (a stop per step)
    if (k != (int64_t) model.hparams.n_expert_used(il) || (L->slots.n_slots == 0 && !count_uncached)) {
        return selected_experts;
    }
    if (L->slots.n_slots > 0 && !L->compute_backend) {
        L->compute_backend = backend_of(sched, model.dev_layer(il));
    }

    // NOTE: decided when the graph is built. With the CPU miss path (known once a graph of this
    // layer was analysed, see finish) any ubatch is remapped: misses read filler slots and go to
    // the CPU. Without it, a step whose ids may not all fit the LRU slots takes the stock path.
    const bool fits   = n_tokens * k <= L->slots.n_slots - L->slots.n_pinned;
    // NOTE: the file tier never computes a miss from the mapping: its misses are read into slots
    const bool hybrid = !L->file_tier && L->cpu_ok == 1 && !L->recipe.empty() && cur != nullptr && !workers.empty() &&
                        down_exps && *down_exps && cur->ne[1] == n_tokens && cur->ne[2] == 1 && cur->ne[3] == 1 &&
                        L->compute_backend != nullptr;
    ggml_tensor ** wts[4] = { up_exps, gate_exps, down_exps, gate_up_exps };
    ggml_tensor *  swap[4] = { nullptr, nullptr, nullptr, nullptr };
    // NOTE: the file tier stages every miss of a step too large for its LRU slots (stage_file_step)
    const bool staged = L->file_tier && L->slots.n_stage >= n_expert - L->slots.n_pinned;
    const bool remap = can_remap && L->slots.n_slots > 0 && (fits || hybrid || staged) && bank_swaps(*L, wts, swap);

    // NOTE: the stop reads one device tensor: the routed ids, or (hybrid) the ids packed with the
    // matmuls' input, so that the scheduler copies one tensor down per stop
    const int kind = !remap ? LLAMA_EXPERT_CACHE_NODE_COUNT : hybrid ? LLAMA_EXPERT_CACHE_NODE_HYBRID : LLAMA_EXPERT_CACHE_NODE_REMAP;
    ggml_tensor * args[1] = { kind == LLAMA_EXPERT_CACHE_NODE_HYBRID ? pack_inputs(*L, ctx0, sched, cur, selected_experts) : selected_experts };
    ggml_tensor * node = ggml_custom_4d(ctx0, GGML_TYPE_I32, k, n_tokens, 1, 1, args, 1,
            remap ? node_remap : node_count, 1, &L->nodes[phase][kind]);
    ggml_format_name(node, "%s-%d", remap ? "spark_ec_remap" : "spark_ec_count", il);
    ggml_backend_sched_set_tensor_backend(sched, node, backend_cpu);
    L->building_node = &L->nodes[phase][kind];

    if (!remap) {
        L->building_count = node;
        return selected_experts;
    }
    L->building_remap = node;
    ggml_tensor * ids = node; // the slot ids: copied up as they are, or (hybrid) packed with the CPU's outputs
    if (hybrid) {
        ids = build_cpu_nodes(*L, ctx0, sched, backend_cpu, phase, node, *down_exps);
    }
    L->building_node->writes = 1;
    for (int i = 0; i < 4; ++i) {
        if (swap[i]) {
            *wts[i] = swap[i];
        }
    }
    return ids;
}

ggml_backend_t llama_expert_cache::backend_of(ggml_backend_sched_t sched, ggml_backend_dev_t dev) {
    ggml_backend_t res = nullptr;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
        ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
        if (ggml_backend_get_device(b) == dev) {
            res = b;
        }
    }
    return res;
}

// the banks that replace the layer's expert weights; false if the cache does not hold one of them
bool llama_expert_cache::bank_swaps(const llama_expert_cache_layer & L, ggml_tensor ** wts[4], ggml_tensor * swap[4]) {
    for (int i = 0; i < 4; ++i) {
        if (!wts[i] || !*wts[i]) {
            continue;
        }
        for (const auto & b : L.banks) {
            if (b.src == *wts[i]) {
                swap[i] = b.bank;
            }
        }
        if (swap[i] == nullptr) {
            return false;
        }
    }
    return true;
}

// the hybrid stop's one input, on the layer's device: per token the matmuls' input row, then its
// routed ids as F32 (exact below 2^24)
ggml_tensor * llama_expert_cache::pack_inputs(llama_expert_cache_layer & L, ggml_context * ctx0, ggml_backend_sched_t sched,
        ggml_tensor * cur, ggml_tensor * selected_experts) {
    ggml_tensor * ids_f = ggml_cast(ctx0, selected_experts, GGML_TYPE_F32);
    ggml_tensor * down  = ggml_concat(ctx0, cur, ids_f, 0); // [n_embd + k, n_tokens]
    ggml_format_name(down, "spark_ec_down-%d", L.il);
    ggml_backend_sched_set_tensor_backend(sched, ids_f, L.compute_backend);
    ggml_backend_sched_set_tensor_backend(sched, down, L.compute_backend);
    const int64_t kT = selected_experts->ne[0] * selected_experts->ne[1];
    if ((int64_t) L.sel.size() < kT) {
        L.sel.resize(kT); // at graph build, never in a step
    }
    return down;
}

// The CPU miss path's node: one output packing, per (token, expert) entry, the partial result of
// the missed entries (a row each), then the device entries' mask, then the slot ids as F32, each
// part starting on a row. The device copies it once and reads views of its copy (views of the host
// node itself would each be copied) and casts the slot ids back to I32 for the matmuls.
ggml_tensor * llama_expert_cache::build_cpu_nodes(llama_expert_cache_layer & L, ggml_context * ctx0, ggml_backend_sched_t sched,
        ggml_backend_t backend_cpu, int phase, ggml_tensor * node, ggml_tensor * down_exps) {
    const int64_t k        = node->ne[0];
    const int64_t n_tokens = node->ne[1];
    const int64_t kT       = k * n_tokens;
    const int64_t n_out    = down_exps->ne[1];
    const int64_t part_rows = (kT + n_out - 1) / n_out; // rows of the mask, and of the slot ids
    ggml_tensor * pargs[2] = { node, node->src[0] };
    L.building_partial = ggml_custom_4d(ctx0, GGML_TYPE_F32, n_out, kT + 2 * part_rows, 1, 1, pargs, 2,
            node_partial, GGML_N_TASKS_MAX, &L.nodes[phase][LLAMA_EXPERT_CACHE_NODE_HYBRID]); // every thread of the graph
    ggml_format_name(L.building_partial, "spark_ec_cpu-%d", L.il);
    ggml_backend_sched_set_tensor_backend(sched, L.building_partial, backend_cpu);

    ggml_tensor * dev = ggml_cont(ctx0, L.building_partial);
    ggml_format_name(dev, "spark_ec_up-%d", L.il);
    ggml_backend_sched_set_tensor_backend(sched, dev, L.compute_backend);
    const size_t row = dev->nb[1];
    L.building_part = ggml_view_3d(ctx0, dev, n_out, k, n_tokens, row, row * k, 0);
    // NOTE: 1 for an entry the device computed, 0 for one the CPU computed: a missed entry
    // reads a filler slot (no expert id twice in a token: device kernels assume that), and
    // its device output is dropped by this factor before the CPU's is added
    L.building_mask = ggml_view_3d(ctx0, dev, 1, k, n_tokens, sizeof(float), sizeof(float) * k, row * kT);
    ggml_tensor * slots_f = ggml_view_2d(ctx0, dev, k, n_tokens, sizeof(float) * k, row * (kT + part_rows));
    ggml_tensor * slots = ggml_cast(ctx0, slots_f, GGML_TYPE_I32);
    ggml_format_name(slots, "spark_ec_slots-%d", L.il);
    ggml_backend_sched_set_tensor_backend(sched, slots, L.compute_backend);
    if ((int64_t) L.missed.size() < kT) {
        L.missed.resize(kT); // at graph build, never in a step
    }
    return slots;
}

void llama_expert_cache::expand(ggml_cgraph * gf, int il) {
    llama_expert_cache_layer * L = layer(il);
    if (!L) {
        return;
    }
    // NOTE: one after the other, so the scheduler puts them in one CPU split: one stop per layer
    std::vector<ggml_tensor *> host;
    for (ggml_tensor * t : { L->building_count, L->building_remap, L->building_partial }) {
        if (t) {
            ggml_build_forward_expand(gf, t);
            host.push_back(t);
        }
    }
    // the device tensors they read: the scheduler copies each one down
    std::vector<const ggml_tensor *> reads;
    for (ggml_tensor * t : host) {
        for (const ggml_tensor * s : t->src) {
            if (s && std::find(host.begin(), host.end(), s) == host.end() && std::find(reads.begin(), reads.end(), s) == reads.end()) {
                reads.push_back(s);
            }
        }
    }
    if (L->building_node) {
        L->building_node->reads = (int32_t) reads.size();
    }
}

ggml_tensor * llama_expert_cache::finish(ggml_context * ctx0, int il, ggml_tensor * experts) {
    llama_expert_cache_layer * L = layer(il);
    if (!L || L->slots.n_slots == 0 || (!L->building_remap && !L->building_count)) {
        return experts; // not cached, warm-up, or not built through the cache
    }
    ggml_tensor * partial = L->building_part;
    ggml_tensor * mask    = L->building_mask;
    ggml_tensor * cur     = L->building_cur;
    if (L->cpu_ok < 0) {
        L->cpu_ok = analyse(*L, experts, L->building_sel, cur) ? 1 : 0;
        if (!L->cpu_ok) {
            LLAMA_LOG_WARN("expert cache: layer %d: its expert ops cannot run on the CPU miss path; misses are uploaded\n", il);
        }
    }
    L->building_remap = L->building_partial = L->building_count = L->building_cur = L->building_sel = nullptr;
    L->building_part = L->building_mask = nullptr;
    L->building_node = nullptr;
    if (!partial) {
        return experts;
    }
    size_workers(*L, partial->ne[1] * partial->ne[2], cur->ne[0]);
    ggml_tensor * out = ggml_add(ctx0, ggml_mul(ctx0, experts, mask), partial);
    ggml_format_name(out, "spark_ec_join-%d", il);
    return out;
}

bool llama_expert_cache::analyse(llama_expert_cache_layer & L, ggml_tensor * experts, ggml_tensor * sel, ggml_tensor * cur) {
    if (!cur || cur->type != GGML_TYPE_F32 || cur->nb[0] != sizeof(float) || experts->op != GGML_OP_MUL_MAT_ID) {
        return false;
    }
    std::vector<ggml_tensor *> order;
    if (!recipe_order(L, experts, sel, cur, order)) {
        return false;
    }
    std::vector<llama_expert_cache_recipe_op> recipe(order.size());
    for (size_t i = 0; i < order.size(); ++i) {
        const ggml_tensor * t = order[i];
        auto & r = recipe[i];
        r.op   = t->op;
        r.type = t->type;
        r.ne0  = t->ne[0];
        memcpy(r.op_params, t->op_params, sizeof(r.op_params));
        r.view_offs = t->op == GGML_OP_VIEW ? t->view_offs : 0;
        for (int j = 0; j < GGML_MAX_SRC; ++j) {
            if (t->src[j] && !recipe_src(L, order, i, j, r.src[j])) {
                return false;
            }
        }
    }
    L.recipe = std::move(recipe);
    return true;
}

// the ops from the matmuls' input to the down projection, sources first
bool llama_expert_cache::recipe_order(const llama_expert_cache_layer & L, ggml_tensor * experts, ggml_tensor * sel,
        ggml_tensor * cur, std::vector<ggml_tensor *> & order) {
    const int64_t k = sel->ne[0];
    const int64_t T = sel->ne[1];
    std::unordered_set<const ggml_tensor *> visited;
    ggml_tensor * ids  = nullptr;
    ggml_tensor * x_in = nullptr;
    bool ok = true;

    auto is_input = [&](const ggml_tensor * t) {
        return t == cur || (t->view_src == cur && ggml_nelements(t) == ggml_nelements(cur) && t->ne[1] == 1);
    };
    std::function<void(ggml_tensor *)> visit = [&](ggml_tensor * t) {
        if (!ok || !t || visited.count(t)) {
            return;
        }
        visited.insert(t);
        if (t->op == GGML_OP_NONE) {
            ok = t->buffer != nullptr; // a model tensor, not some other input
            return;
        }
        if (!recipe_op_ok(t->op) || t->ne[1] != k || t->ne[2] != T || t->ne[3] != 1) {
            ok = false;
            return;
        }
        if (t->op == GGML_OP_MUL_MAT_ID) {
            ids = ids ? ids : t->src[2];
            ok = ok && t->src[2] == ids && host_of(L, t->src[0]) != nullptr;
            if (is_input(t->src[1])) {
                ok = ok && (x_in == nullptr || x_in == t->src[1]);
                x_in = t->src[1];
            } else {
                visit(t->src[1]);
            }
        } else if (t->op == GGML_OP_ADD_ID) {
            ok = ok && t->src[2] == sel && t->src[1]->op == GGML_OP_NONE;
            visit(t->src[0]);
            visit(t->src[1]);
        } else if (t->op == GGML_OP_VIEW) {
            ggml_tensor * p = t->view_src;
            ok = ok && p && t->src[0] == p && t->nb[0] == ggml_type_size(t->type) &&
                 t->nb[1] == p->nb[1] && t->nb[2] == p->nb[2] && t->view_offs < p->nb[1];
            visit(p);
        } else {
            for (ggml_tensor * s : t->src) {
                visit(s);
            }
        }
        order.push_back(t);
    };
    visit(experts);
    return ok && ids != nullptr && x_in != nullptr && !order.empty() && order.back() == experts && order.size() <= RECIPE_MAX;
}

// where source j of op i of the recipe comes from; false if the CPU cannot read it
bool llama_expert_cache::recipe_src(const llama_expert_cache_layer & L, const std::vector<ggml_tensor *> & order, size_t i,
        int j, llama_expert_cache_recipe_src & rs) {
    const ggml_tensor * t = order[i];
    ggml_tensor * s = t->src[j];
    auto it = std::find(order.begin(), order.begin() + i, s);
    if (it != order.begin() + i) {
        rs.kind = LLAMA_EXPERT_CACHE_SRC_OP;
        rs.op   = (int32_t) (it - order.begin());
    } else if (t->op == GGML_OP_MUL_MAT_ID && j == 1) {
        rs.kind = LLAMA_EXPERT_CACHE_SRC_INPUT;
    } else if ((t->op == GGML_OP_MUL_MAT_ID || t->op == GGML_OP_ADD_ID) && j == 2) {
        rs.kind = LLAMA_EXPERT_CACHE_SRC_IDS;
    } else if (ggml_tensor * h = host_of(L, s)) {
        rs.kind   = LLAMA_EXPERT_CACHE_SRC_HOST;
        rs.tensor = h;
    } else if (s->op == GGML_OP_NONE && ggml_backend_buffer_is_host(s->buffer)) {
        rs.kind   = LLAMA_EXPERT_CACHE_SRC_HOST;
        rs.tensor = s;
    } else if (s->op == GGML_OP_NONE && ggml_nbytes(s) <= MIRROR_MAX && ggml_is_contiguous(s)) {
        // NOTE: small device weights (per-expert biases) are read from a host copy made once
        auto & m = host_mirror[s];
        m.resize(ggml_nbytes(s));
        if (!dry) { // a dry run has no weights to copy (its graph is never computed)
            ggml_backend_tensor_get(s, m.data(), 0, m.size());
        }
        rs.kind   = LLAMA_EXPERT_CACHE_SRC_MIRROR;
        rs.tensor = s;
    } else {
        return false;
    }
    return true;
}
