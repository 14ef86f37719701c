// Spark expert cache: the file tier. Cached layers that run on the CPU keep their slots in RAM
// (banks on the CPU buffer type) and read a missed expert's slices from the model file with
// pread, all of a step's reads in flight together, instead of touching the mapping: the kernel's
// page cache, which faults one page at a time inside the compute threads and keeps what was
// touched last, never decides what stays resident.
#include "llama-expert-cache-impl.h"

#include "gguf.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <stdexcept>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

using namespace llama_expert_cache_impl;

llama_expert_cache_reader::~llama_expert_cache_reader() {
    {
        std::lock_guard<std::mutex> lk(m);
        stop = true;
    }
    cv_job.notify_all();
    for (auto & t : threads) {
        t.join();
    }
    if (fd >= 0) {
        ::close(fd);
    }
}

int32_t llama_expert_cache_reader::open(const char * p, int32_t n_threads, std::string & err) {
    path = p;
    fd   = ::open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        err = fmt("%s: cannot open it for the file tier (%s)", p, strerror(errno));
        return LLAMA_EXPERT_CACHE_ERR_PLACEMENT;
    }
    // NOTE: the calling thread reads too, so n_threads reads are in flight with n_threads - 1 helpers
    for (int32_t i = 1; i < n_threads; ++i) {
        threads.emplace_back([this] { loop(); });
    }
    return LLAMA_EXPERT_CACHE_OK;
}

void llama_expert_cache_reader::loop() {
    std::unique_lock<std::mutex> lk(m);
    for (;;) {
        cv_job.wait(lk, [&] { return stop || next < jobs.size(); });
        if (stop) {
            return;
        }
        work(lk);
    }
}

// take jobs until none is left (the lock held between jobs, never across a read)
void llama_expert_cache_reader::work(std::unique_lock<std::mutex> & lk) {
    while (next < jobs.size()) {
        const job j = jobs[next++];
        lk.unlock();
        std::string e = read_one(j);
        lk.lock();
        if (!e.empty() && error.empty()) {
            error = std::move(e);
        }
        if (++done == jobs.size()) {
            cv_done.notify_all();
        }
    }
}

std::string llama_expert_cache_reader::read_one(const job & j) const {
    size_t got = 0;
    while (got < j.n) {
        const ssize_t r = ::pread(fd, (char *) j.dst + got, j.n - got, (off_t) (j.off + (int64_t) got));
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return fmt("%s: reading %zu bytes at offset %lld failed (%s)", path.c_str(), j.n, (long long) j.off,
                    r < 0 ? strerror(errno) : "end of file: the model file changed since it was loaded");
        }
        got += (size_t) r;
    }
    // NOTE: the bank holds the bytes now; left cached they would only compete with the banks for RAM
    posix_fadvise(fd, (off_t) j.off, (off_t) j.n, POSIX_FADV_DONTNEED);
    return {};
}

void llama_expert_cache_reader::run(std::vector<job> & js) {
    if (js.empty()) {
        return;
    }
    std::unique_lock<std::mutex> lk(m);
    jobs.swap(js);
    next = done = 0;
    error.clear();
    cv_job.notify_all();
    work(lk);
    cv_done.wait(lk, [&] { return done == jobs.size(); });
    jobs.clear();
    next = done = 0;
    if (!error.empty()) {
        throw std::runtime_error(error);
    }
}

void llama_expert_cache_reader::begin(std::vector<job> & js) {
    std::unique_lock<std::mutex> lk(m);
    GGML_ASSERT(!busy && !threads.empty());
    jobs.swap(js);
    next = done = 0;
    error.clear();
    busy = true;
    cv_job.notify_all();
}

void llama_expert_cache_reader::finish() {
    std::unique_lock<std::mutex> lk(m);
    if (!busy) {
        return;
    }
    work(lk);
    cv_done.wait(lk, [&] { return done == jobs.size(); });
    jobs.clear();
    next = done = 0;
    busy = false;
    if (!error.empty()) {
        throw std::runtime_error(error);
    }
}

// The file tier's file and each CPU-cached layer's tensor offsets in it, checked against the loaded
// tensors (same size), before anything is allocated.
int32_t llama_expert_cache::open_file_tier(const llama_expert_cache_params & params, std::string & err) {
    bool any = false;
    for (auto & L : layers) {
        any = any || (L && L->file_tier);
    }
    if (!any) {
        return LLAMA_EXPERT_CACHE_OK;
    }
    gguf_init_params gp = { /*.no_alloc =*/ true, /*.ctx =*/ nullptr };
    gguf_context * g = gguf_init_from_file(params.file_path, gp);
    if (!g) {
        err = fmt("%s: not a readable GGUF file (the file tier reads misses from the model's own file)", params.file_path);
        return LLAMA_EXPERT_CACHE_ERR_PLACEMENT;
    }
    const size_t base = gguf_get_data_offset(g);
    int32_t rc = LLAMA_EXPERT_CACHE_OK;
    for (auto & L : layers) {
        if (!L || !L->file_tier || rc != LLAMA_EXPERT_CACHE_OK) {
            continue;
        }
        for (const ggml_tensor * t : { model.layers[L->il].ffn_gate_exps, model.layers[L->il].ffn_up_exps,
                                       model.layers[L->il].ffn_down_exps, model.layers[L->il].ffn_gate_up_exps }) {
            if (!t) {
                continue;
            }
            const int64_t id = gguf_find_tensor(g, t->name);
            if (id < 0 || gguf_get_tensor_size(g, id) != ggml_nbytes(t) || gguf_get_tensor_type(g, id) != t->type) {
                err = fmt("%s: %s is not in this file as loaded (a split GGUF? the file tier reads one-file models)",
                        params.file_path, t->name);
                rc = LLAMA_EXPERT_CACHE_ERR_PLACEMENT;
                break;
            }
            L->file_offs.push_back({ t, (int64_t) (base + gguf_get_tensor_offset(g, id)) });
        }
    }
    gguf_free(g);
    if (rc != LLAMA_EXPERT_CACHE_OK) {
        return rc;
    }
    reader = std::make_unique<llama_expert_cache_reader>();
    return reader->open(params.file_path, params.n_readers > 0 ? params.n_readers : 4, err);
}

// The file tier's expert tensors leave RAM: llama.cpp maps the file with MAP_POPULATE, so their pages
// are mapped and cached from the load on, and would compete with the banks for the run's RAM. Their
// mapped pages are dropped (a read-only file mapping: a later touch faults the same bytes back in
// from the file, as stock's page cache does) and then their cached pages.
void llama_expert_cache::release_mapping() {
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    for (auto & L : layers) {
        if (!L || !L->file_tier) {
            continue;
        }
        for (const auto & b : L->banks) {
            if (b.file_off < 0 || !b.src->data) {
                continue;
            }
            const uintptr_t lo = ((uintptr_t) b.src->data + page - 1) / page * page;
            const uintptr_t hi = ((uintptr_t) b.src->data + ggml_nbytes(b.src)) / page * page;
            if (hi > lo) {
                madvise((void *) lo, hi - lo, MADV_DONTNEED);
                madvise((void *) lo, hi - lo, MADV_RANDOM); // NOTE: no read-ahead if the stock path touches them
            }
            posix_fadvise(reader->fd, (off_t) b.file_off, (off_t) ggml_nbytes(b.src), POSIX_FADV_DONTNEED);
        }
    }
}

// The weights that stay resident beside a file tier (the non-expert weights; in a three-tier run the cached
// layers' host experts too) are in the same file mapping, where the kernel may reclaim their pages under
// the run's RAM cap and fault them back in every token (a thrash nothing at the cap can stop). So they
// become anonymous memory with the same bytes at the same addresses: copied into a fresh anonymous
// mapping, which mremap then moves over the file's pages. Like the slots, that needs no root and no
// RLIMIT_MEMLOCK, and it is not reclaimed without swap. A range that cannot move stays mapped (said once).
// Returns the bytes that stayed mapped.
size_t llama_expert_cache::keep_resident() {
    const llama_expert_cache_bank * any = nullptr;
    std::unordered_set<const ggml_tensor *> tier;
    for (const auto & L : layers) {
        if (!L || !L->file_tier) {
            continue;
        }
        for (const auto & b : L->banks) {
            if (b.file_off >= 0 && b.src->data) {
                tier.insert(b.src);
                any = &b;
            }
        }
    }
    struct stat st = {};
    if (!any || fstat(reader->fd, &st) != 0) {
        return 0;
    }
    const char * base = (const char *) any->src->data - any->file_off; // llama.cpp maps the whole file
    const char * end  = base + st.st_size;
    std::vector<std::pair<uintptr_t, uintptr_t>> rs;
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    for (const auto & [name, t] : model.tensors_by_name) {
        const char * d = (const char *) t->data;
        if (!t->buffer || !ggml_backend_buffer_is_host(t->buffer) || tier.count(t) || d < base || d >= end) {
            continue;
        }
        rs.push_back({ (uintptr_t) d / page * page, ((uintptr_t) d + ggml_nbytes(t) + page - 1) / page * page });
    }
    std::sort(rs.begin(), rs.end());
    std::vector<std::pair<uintptr_t, uintptr_t>> merged;
    for (const auto & r : rs) {
        if (!merged.empty() && r.first <= merged.back().second) {
            merged.back().second = std::max(merged.back().second, r.second);
        } else {
            merged.push_back(r);
        }
    }
    size_t stayed = 0;
    int    why    = ENOSYS;
    const size_t chunk = (size_t) 16 << 20; // the copy's peak beside the run's own RAM
    for (const auto & [lo, hi] : merged) {
        for (uintptr_t a = lo; a < hi; a += chunk) {
            const size_t n = std::min((size_t) (hi - a), chunk);
#ifdef __linux__
            void * fresh = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (fresh != MAP_FAILED) {
                memcpy(fresh, (const void *) a, n);
                mprotect(fresh, n, PROT_READ);
                if (mremap(fresh, n, n, MREMAP_MAYMOVE | MREMAP_FIXED, (void *) a) != MAP_FAILED) {
                    posix_fadvise(reader->fd, (off_t) ((const char *) a - base), (off_t) n, POSIX_FADV_DONTNEED);
                    continue;
                }
                why = errno;
                munmap(fresh, n);
            } else {
                why = errno;
            }
#endif
            stayed += n;
        }
    }
    if (stayed > 0) {
        LLAMA_LOG_WARN("expert cache: %.1f MiB of resident weights stay in the file mapping (%s): under memory "
                "pressure the kernel may reclaim them and read them again\n", stayed / 1048576.0, strerror(why));
    }
    return stayed;
}

// A file-tier step larger than the LRU slots (a prefill ubatch): the resident experts are read where
// they are, untouched (the decode working set stays as it was). While LRU slots are free (a cold
// start), the misses with most entries fill them (slots.fill_free): a prompt warms the slots its
// decode will use. Every other routed expert is read once into a staging slice for this step and not
// admitted. (under the lock, released for the reads)
void llama_expert_cache::stage_file_step(llama_expert_cache_layer & L, const llama_expert_cache_ids & v, int32_t * out,
        std::unique_lock<std::mutex> & lock) {
    auto & S = L.slots;
    const int32_t n_fill = S.fill_free(v);
    if (n_fill < 0) {
        throw std::runtime_error(fmt("layer %d: a routed expert id out of range", L.il));
    }
    std::vector<int32_t> where(n_expert, -1), filled(n_expert, 0), es, ss;
    for (int32_t a = 0; a < n_fill; ++a) {
        filled[S.admit[2 * a]] = 1;
        es.push_back(S.admit[2 * a]);
        ss.push_back(S.admit[2 * a + 1]);
    }
    uint64_t hits = 0;
    int32_t n_staged = 0;
    for (int64_t t = 0; t < v.n_tokens; ++t) {
        for (int64_t j = 0; j < v.k; ++j) {
            const int32_t e = v.at(t, j);
            if (where[e] < 0) {
                if (S.expert_slot[e] >= 0) {
                    where[e] = S.expert_slot[e];
                    hits += !filled[e];
                } else {
                    if (n_staged >= S.n_stage) {
                        throw std::runtime_error(fmt("layer %d: more misses than the %d staging slices", L.il, S.n_stage));
                    }
                    where[e] = S.stage_base + n_staged++;
                    es.push_back(e);
                    ss.push_back(where[e]);
                }
            }
            out[t * v.k + j] = where[e];
        }
    }
    L.stats.hits   += hits;
    L.stats.misses += es.size();
    lock.unlock();
    const int64_t t0 = ggml_time_us();
    read_experts(L, es.data(), ss.data(), (int32_t) es.size());
    const int64_t dt = ggml_time_us() - t0;
    lock.lock();
    L.stats.uploads               += n_fill;
    L.stats.bytes_uploaded        += (uint64_t) n_fill * L.expert_bytes;
    L.stats.staged_uploads        += n_staged;
    L.stats.staged_upload_bytes   += (uint64_t) n_staged * L.expert_bytes;
    L.stats.blocking_upload_bytes += (uint64_t) es.size() * L.expert_bytes;
    L.stats.blocking_calls        += (uint64_t) es.size() * L.banks.size();
    L.stats.upload_us             += dt;
}

// every bank slice of the listed experts, in flight together; counted as the layer's uploads
void llama_expert_cache::read_experts(llama_expert_cache_layer & L, const int32_t * es, const int32_t * ss, int32_t n, size_t stride) {
    std::vector<llama_expert_cache_reader::job> js;
    js.reserve((size_t) n * L.banks.size());
    for (int32_t i = 0; i < n; ++i) {
        const int32_t e = es[(size_t) i * stride];
        const int32_t s = ss[(size_t) i * stride];
        for (const auto & b : L.banks) {
            const size_t nb = b.src->nb[2];
            GGML_ASSERT(b.file_off >= 0 && b.bank->data != nullptr);
            js.push_back({ (char *) b.bank->data + (size_t) s * nb, nb, b.file_off + (int64_t) e * (int64_t) nb });
        }
    }
    reader->run(js);
}

// Read-ahead. While a file-tier layer's decode step runs (before its expert matmuls), the experts the
// next file-tier layer is predicted to route, and does not hold in its RAM slots, are read into that
// layer's last staging slices on the read-ahead thread. The predictor, per pair of consecutive
// file-tier layers (l, l'), counts decode steps routing a at l (n[a]) and a at l with e at l'
// (co[a][e]); given l's routed set R it scores e as sum over a in R of (co[a][e] << 16) / n[a], and
// reads the best `ahead` experts (ties: lower id) whose score / |R| (a chance, fixed point) reaches
// ahead_min_prob. Integers only, so core/prefetch.py replays it exactly. At l''s step a miss read ahead
// is copied from its staging slice into the slot the policy gave it instead of read: the policy, and
// so every hit and miss, is the same as without read-ahead. Any other step that may use the staging
// slices (a prefill) first waits for the reads ahead and drops them.
int32_t llama_expert_cache::open_ahead(const llama_expert_cache_params & params, std::string & err) {
    if (params.ahead < 0 || params.ahead_min_prob < 0 || params.ahead_min_prob > (1 << 16)) {
        err = fmt("read-ahead: %d experts at a chance of at least %d / 65536: give 0 or more, and a chance in [0, 65536]",
                params.ahead, params.ahead_min_prob);
        return LLAMA_EXPERT_CACHE_ERR_ARG;
    }
    if (params.ahead == 0 || !reader || dry) {
        return LLAMA_EXPERT_CACHE_OK;
    }
    ahead          = std::min(params.ahead, n_expert);
    ahead_min_prob = params.ahead_min_prob;
    llama_expert_cache_layer * prev = nullptr;
    for (auto & L : layers) {
        if (!L || !L->file_tier || L->slots.n_slots == 0) {
            continue;
        }
        if (prev) {
            prev->ahead_next = L->il;
            prev->ahead_n.assign(n_expert, 0);
            prev->ahead_co.assign((size_t) n_expert * n_expert, 0);
        }
        L->ahead_routed.reserve(n_expert);
        L->ahead_es.reserve(ahead);
        prev = L.get();
    }
    ahead_score.assign(n_expert, 0);
    ahead_mark.assign(n_expert, 0);
    ahead_reader = std::make_unique<llama_expert_cache_reader>();
    return ahead_reader->open(params.file_path, 2, err); // NOTE: one helper thread: the reads run beside the step
}

bool llama_expert_cache::ahead_step(const llama_expert_cache_layer & L, const llama_expert_cache_node & n,
        const llama_expert_cache_ids & v, bool remap) const {
    return ahead > 0 && L.file_tier && remap && n.phase == LLAMA_EXPERT_CACHE_PHASE_DECODE &&
           v.n_tokens * v.k <= L.slots.n_slots - L.slots.n_pinned;
}

void llama_expert_cache::ahead_drain() {
    if (ahead_pending < 0) {
        return;
    }
    llama_expert_cache_layer & N = *layer(ahead_pending);
    ahead_pending = -1;
    N.ahead_es.clear();
    ahead_reader->finish();
}

// the step's misses that were read ahead: copied into their slots, and left out of the step's reads
int32_t llama_expert_cache::ahead_take(llama_expert_cache_layer & L, int32_t n_admit) {
    if (ahead_pending == L.il) {
        ahead_pending = -1;
        ahead_reader->finish();
    }
    uint64_t used = 0;
    for (size_t i = 0; i < L.ahead_es.size(); ++i) {
        const int32_t slice = L.slots.stage_base + L.slots.n_stage - 1 - (int32_t) i;
        for (int32_t a = 0; a < n_admit; ++a) {
            if (L.slots.admit[2 * a] != L.ahead_es[i]) {
                continue;
            }
            const int32_t s = L.slots.admit[2 * a + 1];
            for (const auto & b : L.banks) {
                const size_t nb = b.src->nb[2];
                memcpy((char *) b.bank->data + (size_t) s * nb, (const char *) b.bank->data + (size_t) slice * nb, nb);
            }
            std::swap(L.slots.admit[2 * a], L.slots.admit[2 * (n_admit - 1)]);
            std::swap(L.slots.admit[2 * a + 1], L.slots.admit[2 * (n_admit - 1) + 1]);
            n_admit--;
            used++;
            break;
        }
    }
    L.ahead_es.clear();
    if (used > 0) {
        std::lock_guard<std::mutex> lock(mutex);
        L.stats.ahead_used += used;
    }
    return n_admit;
}

// learn the pair (P, the layer after it) from one token: P routed P.ahead_routed, the next `next`
void llama_expert_cache::ahead_learn(llama_expert_cache_layer & P, const std::vector<int32_t> & next) {
    const uint32_t top = UINT32_MAX;
    for (int32_t a : P.ahead_routed) {
        if (P.ahead_n[a] < top) {
            P.ahead_n[a]++;
        }
        uint32_t * row = &P.ahead_co[(size_t) a * n_expert];
        for (int32_t e : next) {
            if (row[e] < top) {
                row[e]++;
            }
        }
    }
}

void llama_expert_cache::ahead_issue(llama_expert_cache_layer & L, const llama_expert_cache_ids & v) {
    std::vector<int32_t> & R = L.ahead_routed; // NOTE: reserved at init: no allocation on the step
    R.clear();
    for (int64_t t = 0; t < v.n_tokens; ++t) {
        for (int64_t j = 0; j < v.k; ++j) {
            const int32_t e = v.at(t, j);
            if (e >= 0 && e < n_expert && !ahead_mark[e]) {
                ahead_mark[e] = 1;
                R.push_back(e);
            }
        }
    }
    for (int32_t e : R) {
        ahead_mark[e] = 0;
    }
    if (ahead_last >= 0 && layer(ahead_last)->ahead_next == L.il) {
        ahead_learn(*layer(ahead_last), R);
    }
    ahead_last = L.il;
    if (L.ahead_next < 0 || R.empty()) {
        return;
    }
    llama_expert_cache_layer & N = *layer(L.ahead_next);
    std::fill(ahead_score.begin(), ahead_score.end(), 0);
    for (int32_t a : R) {
        const uint64_t na = L.ahead_n[a];
        if (na == 0) {
            continue;
        }
        const uint32_t * row = &L.ahead_co[(size_t) a * n_expert];
        for (int32_t e = 0; e < n_expert; ++e) {
            ahead_score[e] += ((uint64_t) row[e] << 16) / na;
        }
    }
    // the best `ahead` candidates: a partial selection by (score desc, id asc)
    N.ahead_es.clear();
    for (int32_t i = 0; i < ahead; ++i) {
        int32_t best = -1;
        for (int32_t e = 0; e < n_expert; ++e) {
            const uint64_t sc = ahead_score[e];
            if (sc == 0 || N.slots.expert_slot[e] >= 0 || sc / R.size() < (uint64_t) ahead_min_prob) {
                continue;
            }
            if (best < 0 || sc > ahead_score[best]) {
                best = e;
            }
        }
        if (best < 0) {
            break;
        }
        N.ahead_es.push_back(best);
        ahead_score[best] = 0;
    }
    if (N.ahead_es.empty()) {
        return;
    }
    std::vector<llama_expert_cache_reader::job> js;
    js.reserve(N.ahead_es.size() * N.banks.size());
    for (size_t i = 0; i < N.ahead_es.size(); ++i) {
        const int32_t slice = N.slots.stage_base + N.slots.n_stage - 1 - (int32_t) i;
        for (const auto & b : N.banks) {
            const size_t nb = b.src->nb[2];
            js.push_back({ (char *) b.bank->data + (size_t) slice * nb, nb, b.file_off + (int64_t) N.ahead_es[i] * (int64_t) nb });
        }
    }
    ahead_reader->begin(js);
    ahead_pending = N.il;
    std::lock_guard<std::mutex> lock(mutex);
    N.stats.ahead_reads += N.ahead_es.size();
    N.stats.ahead_bytes += (uint64_t) N.ahead_es.size() * N.expert_bytes;
}
