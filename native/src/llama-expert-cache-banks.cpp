// Spark expert cache: the arenas that hold each device's banks of expert slots, and the banks' views.
#include "llama-expert-cache-impl.h"

using namespace llama_expert_cache_impl;

namespace {

std::vector<ggml_tensor *> expert_tensors(const llama_layer & ml) {
    std::vector<ggml_tensor *> out;
    for (ggml_tensor * t : { ml.ffn_gate_exps, ml.ffn_up_exps, ml.ffn_down_exps, ml.ffn_gate_up_exps }) {
        if (t) {
            out.push_back(t);
        }
    }
    return out;
}

bool same_shapes(const std::vector<ggml_tensor *> & a, const std::vector<ggml_tensor *> & b) {
    if (a.size() != b.size()) {
        return false;
    }
    for (size_t i = 0; i < a.size(); ++i) {
        if (a[i]->type != b[i]->type || a[i]->ne[0] != b[i]->ne[0] || a[i]->ne[1] != b[i]->ne[1]) {
            return false;
        }
    }
    return true;
}

// the first slice at or after `at` whose byte offset suits the buffer type in every kind (views of
// an arena start there), within a bound
int64_t aligned_slice(const std::vector<ggml_tensor *> & like, int64_t at, size_t align) {
    for (int64_t s = at; s < at + 4096; ++s) {
        bool ok = true;
        for (ggml_tensor * t : like) {
            ok = ok && ((size_t) s * t->nb[2]) % align == 0;
        }
        if (ok) {
            return s;
        }
    }
    return at;
}

} // namespace

// Which arena holds each cached layer's banks (layer order), the staging slices after them, and the
// bytes they need per buffer type.
int32_t llama_expert_cache::plan_arenas(llama_expert_cache_bank_needs & need, std::string & err) {
    for (auto & Lp : layers) {
        if (!Lp || Lp->slots.n_slots == 0) {
            continue;
        }
        llama_expert_cache_layer & L = *Lp;
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(L.bank_dev);
        const int32_t n_stage = L.slots.n_stage; // NOTE: params.n_stage, or the file tier's expert count
        const std::vector<ggml_tensor *> like = expert_tensors(model.layers[L.il]);
        const size_t align = ggml_backend_buft_get_alignment(buft);
        size_t nb_max = 0;
        for (ggml_tensor * t : like) {
            nb_max = std::max(nb_max, t->nb[2]);
        }
        const int64_t max_slices = nb_max > 0 ? (int64_t) (ggml_backend_buft_get_max_size(buft) / nb_max) : INT64_MAX;
        llama_expert_cache_arena * a = nullptr;
        for (auto & c : arenas) {
            if (c.buft == buft && same_shapes(c.like, like)) {
                a = &c; // the newest arena of this kind (a full one is followed by a new one)
            }
        }
        int64_t at = a ? aligned_slice(like, a->total, align) : 0;
        // NOTE: a device bank ends with a zeroed guard slice (the first filler of an entry the CPU computes);
        // a file-tier bank has none: every routed expert of its steps is in a slot or a staging slice
        const int64_t need_slices = L.slots.n_slots + (L.file_tier ? 0 : 1);
        if (a && aligned_slice(like, at + need_slices, align) + n_stage > max_slices) {
            a = nullptr; // past the buffer type's max size: a new arena
            at = 0;
        }
        if (!a) {
            if (need_slices + n_stage > max_slices) {
                err = fmt("layer %d: a bank of %d slots does not fit one %s buffer (%.3f GiB at most)", L.il,
                        L.slots.n_slots, ggml_backend_buft_name(buft), ggml_backend_buft_get_max_size(buft) / 1073741824.0);
                return LLAMA_EXPERT_CACHE_ERR_NO_MEMORY;
            }
            arenas.emplace_back();
            a = &arenas.back();
            a->buft = buft;
            a->like = like;
            a->n_stage = n_stage;
        }
        a->layers.push_back(L.il);
        a->start.push_back(at);
        a->total = at + need_slices;
    }
    for (auto & a : arenas) {
        const size_t align = ggml_backend_buft_get_alignment(a.buft);
        a.stage_start = aligned_slice(a.like, a.total, align);
        a.total       = a.stage_start + a.n_stage;
        for (ggml_tensor * t : a.like) {
            need.bytes[a.buft] += GGML_PAD(t->nb[2] * (size_t) a.total, align);
        }
        for (size_t i = 0; i < a.layers.size(); ++i) {
            layer(a.layers[i])->slots.stage_base = (int32_t) (a.stage_start - a.start[i]);
        }
    }
    return LLAMA_EXPERT_CACHE_OK;
}

// one buffer per device buffer type holding its arenas (more where the buffer type's max size asks)
int32_t llama_expert_cache::alloc_banks(llama_expert_cache_bank_needs & need, std::string & err) {
    std::map<ggml_backend_buffer_type_t, ggml_context *> bctx;
    for (const auto & [buft, bytes] : need.bytes) {
        (void) bytes;
        ggml_init_params ip = { /*.mem_size =*/ ggml_tensor_overhead() * 4 * (arenas.size() + 1) + 1024, /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ true };
        ggml_context * c = ggml_init(ip);
        if (!c) {
            err = "ggml_init failed";
            return LLAMA_EXPERT_CACHE_ERR_INTERNAL;
        }
        ctxs.emplace_back(c);
        bctx[buft] = c;
    }
    for (size_t i = 0; i < arenas.size(); ++i) {
        auto & a = arenas[i];
        for (ggml_tensor * t : a.like) {
            ggml_tensor * b = ggml_new_tensor_3d(bctx[a.buft], t->type, t->ne[0], t->ne[1], a.total);
            ggml_format_name(b, "spark_arena%zu.%s", i, t->name);
            a.tensors.push_back(b);
        }
    }
    for (const auto & [buft, c] : bctx) {
        if (dry) {
            size_t bytes = 0;
            ggml_backend_buffer_t buf = dry_buffer(c, buft, bytes);
            bank_bytes[buft] += bytes;
            device_bytes     += ggml_backend_buft_is_host(buft) ? 0 : bytes;
            bufs.emplace_back(buf);
            continue;
        }
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(c, buft);
        if (!buf) {
            err = fmt("could not allocate %.3f GiB of expert banks on %s", need.bytes[buft] / 1073741824.0, ggml_backend_buft_name(buft));
            return LLAMA_EXPERT_CACHE_ERR_NO_MEMORY;
        }
        // NOTE: weights usage, so the scheduler keeps the expert matmuls on the bank's device
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        ggml_backend_buffer_clear(buf, 0); // zeroed guard slices (and empty slots)
        bank_bytes[buft] += ggml_backend_buffer_get_size(buf);
        device_bytes     += ggml_backend_buft_is_host(buft) ? 0 : ggml_backend_buffer_get_size(buf); // NOTE: file tier banks are RAM
        bufs.emplace_back(buf);
    }
    size_t n_views = 0;
    for (const auto & a : arenas) {
        n_views += a.layers.size() * a.like.size();
    }
    ggml_init_params ip = { /*.mem_size =*/ ggml_tensor_overhead() * (n_views + 1) + 1024, /*.mem_buffer =*/ nullptr, /*.no_alloc =*/ true };
    ggml_context * vctx = ggml_init(ip);
    if (!vctx) {
        err = "ggml_init failed";
        return LLAMA_EXPERT_CACHE_ERR_INTERNAL;
    }
    ctxs.emplace_back(vctx);
    for (const auto & a : arenas) {
        make_views(a, vctx);
        for (int32_t il : a.layers) {
            init_admissions(*layer(il), layer(il)->bank_dev);
        }
    }
    return LLAMA_EXPERT_CACHE_OK;
}

// a dry run's banks: the size a real allocation would take, and a zero-size buffer that marks the
// tensors allocated (as llama.cpp's no_alloc weights), so the scheduler plans the cached graph
ggml_backend_buffer_t llama_expert_cache::dry_buffer(ggml_context * c, ggml_backend_buffer_type_t buft, size_t & bytes) {
    bytes = ggml_backend_alloc_ctx_tensors_from_buft_size(c, buft);
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, 0);
    for (ggml_tensor * t = ggml_get_first_tensor(c); t != nullptr; t = ggml_get_next_tensor(c, t)) {
        t->buffer = buf;
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    return buf;
}

// each layer's banks: views of the arena from its slot 0 to the arena's end (slots, guard, the
// banks after it, the staging slices), so one id space holds its slots and the staging slices
void llama_expert_cache::make_views(const llama_expert_cache_arena & a, ggml_context * c) {
    for (size_t i = 0; i < a.layers.size(); ++i) {
        llama_expert_cache_layer & L = *layer(a.layers[i]);
        const std::vector<ggml_tensor *> srcs = expert_tensors(model.layers[L.il]);
        for (size_t k = 0; k < a.tensors.size(); ++k) {
            ggml_tensor * t = a.tensors[k];
            ggml_tensor * v = ggml_view_3d(c, t, t->ne[0], t->ne[1], a.total - a.start[i], t->nb[1], t->nb[2],
                    (size_t) a.start[i] * t->nb[2]);
            ggml_format_name(v, "spark_bank.%s", srcs[k]->name);
            if (dry) {
                v->buffer = t->buffer; // NOTE: no data to point into: the dry run's marked buffer
            } else {
                GGML_ASSERT(ggml_backend_view_init(v) == GGML_STATUS_SUCCESS);
            }
            int64_t off = -1;
            for (const auto & [t, o] : L.file_offs) {
                off = t == srcs[k] ? o : off;
            }
            L.banks.push_back({ srcs[k], v, off });
        }
    }
}
