// Spark expert cache: internal C++ side (see include/llama-expert-cache-api.h).
#pragma once

#include "llama-expert-cache-api.h"
#include "llama-expert-cache-policy.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct llama_model;
struct llama_expert_cache;

// One expert tensor of a cached layer and its device bank.
struct llama_expert_cache_bank {
    ggml_tensor * src  = nullptr; // host tensor [ne0, ne1, n_expert]
    ggml_tensor * bank = nullptr; // device view [ne0, ne1, ..] of its arena from the layer's slot 0: n_slots slots,
                                  // a zeroed guard, other layers' banks, then the shared staging slices
    int64_t file_off = -1;        // file tier: the host tensor's offset in the model file (-1: copied from src)
};

// The file tier's reads: preads of expert slices from the model file into RAM banks, a step's reads
// in flight together on a few threads owned by the cache (the caller is one of them). Each read is
// dropped from the page cache after it lands (the banks hold the bytes; the page cache would only
// compete with them for the run's RAM).
struct llama_expert_cache_reader {
    struct job {
        void *  dst = nullptr;
        size_t  n   = 0;
        int64_t off = 0;
    };
    ~llama_expert_cache_reader();
    int32_t open(const char * path, int32_t n_threads, std::string & err);
    void    run(std::vector<job> & js); // throws std::runtime_error naming the file on a failed read
    void    begin(std::vector<job> & js); // the reads in the background, on the helper threads (open with 2 or more)
    void    finish();                     // wait for begin's reads (the caller reads what is left); throws as run

    std::string path;
    int fd = -1;
  private:
    void loop();
    void work(std::unique_lock<std::mutex> & lk);
    std::string read_one(const job & j) const;

    std::vector<std::thread> threads;
    std::mutex m;
    std::condition_variable cv_job, cv_done;
    std::vector<job> jobs;
    size_t next = 0, done = 0;
    bool   stop = false;
    bool   busy = false; // begin's reads not finished
    std::string error;
};

// The banks of the cached layers whose expert tensors have the same types and shapes, on one buffer
// type: per expert tensor kind one device tensor holding each such layer's slots and guard, then the
// staging slices those layers share (a layer's host node runs only after the device finished the
// layers before it, so one layer at a time uses them). Split where a tensor would pass the buffer
// type's max size.
struct llama_expert_cache_arena {
    ggml_backend_buffer_type_t buft = nullptr;
    std::vector<ggml_tensor *> like;    // the first layer's expert tensors (types and shapes), in bank order
    std::vector<ggml_tensor *> tensors; // one per kind, made at allocation
    std::vector<int32_t> layers;        // the layers, and the slice of each one's slot 0
    std::vector<int64_t> start;
    int64_t stage_start = 0;            // the first staging slice
    int32_t n_stage = 0;                // staging slices (the file tier's: the expert count)
    int64_t total = 0;                  // slices
};

struct llama_expert_cache_layer;

// One CPU thread's share of the CPU miss path: the host node runs on every thread of the graph
// (as stock CPU experts do), and each thread computes an even share of the missed entries, grouped by
// expert, on its own one-thread backend.
struct llama_expert_cache_worker {
    ggml_backend_t       backend = nullptr; // owned; CPU, one thread
    std::vector<uint8_t> arena;
    ggml_context *       ctx  = nullptr; // owned; over the arena, made at graph build, reset per pass
    int64_t              rows = 0;       // missed entries one pass holds
    std::vector<int64_t> expert_rows;    // [n_expert] scratch: missed entries per expert this step
    std::vector<int64_t> order;          // scratch: this worker's missed entries (t*k + j), by expert
};

// Device bytes the banks need per buffer type, found while validating the layers.
struct llama_expert_cache_bank_needs {
    std::map<ggml_backend_buffer_type_t, size_t>             bytes;
    std::map<ggml_backend_buffer_type_t, ggml_backend_dev_t> dev;
    bool warned_pinned = false; // the unpinned host memory warning was logged
};

// What a layer's host nodes do in a step: count only, remap, or remap with the CPU miss path.
enum llama_expert_cache_node_kind : int32_t {
    LLAMA_EXPERT_CACHE_NODE_COUNT  = 0,
    LLAMA_EXPERT_CACHE_NODE_REMAP  = 1,
    LLAMA_EXPERT_CACHE_NODE_HYBRID = 2,
};

// Userdata of a host node, fixed when its graph is built (a reused graph keeps its own).
struct llama_expert_cache_node {
    llama_expert_cache_layer * layer = nullptr;
    int32_t phase  = LLAMA_EXPERT_CACHE_PHASE_PREFILL;
    bool    hybrid = false; // the graph adds the CPU miss path's output: misses read filler slots
    // the stop's copies, from the graph: device tensors the host nodes read (the scheduler copies
    // each down), host-node outputs the device reads (each copied up)
    int32_t reads  = 0;
    int32_t writes = 0;
};

// The CPU miss path rebuilds, for the missed entries only, the ops of the graph between the
// expert matmuls' input and the down projection. Recorded from the first graph of a layer; the
// ops are the same in every graph of the layer (only the token count differs).
enum llama_expert_cache_src_kind : int32_t {
    LLAMA_EXPERT_CACHE_SRC_NONE   = 0,
    LLAMA_EXPERT_CACHE_SRC_OP     = 1, // an earlier op of the recipe
    LLAMA_EXPERT_CACHE_SRC_INPUT  = 2, // the matmuls' input rows
    LLAMA_EXPERT_CACHE_SRC_IDS    = 3, // the routed expert ids
    LLAMA_EXPERT_CACHE_SRC_HOST   = 4, // a model tensor in host memory (expert weights, biases)
    LLAMA_EXPERT_CACHE_SRC_MIRROR = 5, // a small model tensor on the device, read from a host copy
};

struct llama_expert_cache_recipe_src {
    int32_t       kind   = LLAMA_EXPERT_CACHE_SRC_NONE;
    int32_t       op     = -1;      // SRC_OP: index of the op
    ggml_tensor * tensor = nullptr; // SRC_HOST, SRC_MIRROR: the model tensor
};

struct llama_expert_cache_recipe_op {
    ggml_op   op   = GGML_OP_NONE;
    ggml_type type = GGML_TYPE_F32;
    int64_t   ne0  = 0;
    int32_t   op_params[GGML_MAX_OP_PARAMS / sizeof(int32_t)] = {};
    size_t    view_offs = 0; // GGML_OP_VIEW: byte offset in its parent's rows
    llama_expert_cache_recipe_src src[GGML_MAX_SRC];
};

struct llama_expert_cache_layer {
    llama_expert_cache * owner = nullptr;
    int32_t il        = -1;
    int32_t cpu_ok    = -1; // the graph's expert ops can run on the CPU for misses: -1 unknown, 0 no, 1 yes
    bool    on_device = false;
    bool    file_tier = false; // on the CPU (or in_ram), slots in RAM, misses read from the model file
    ggml_backend_dev_t bank_dev = nullptr; // the device whose buffer type holds the layer's banks
    size_t  expert_bytes = 0; // host bytes of one expert across the layer's expert tensors

    ggml_backend_t compute_backend = nullptr; // the scheduler's backend of the layer's device
    ggml_backend_t upload_backend  = nullptr; // owned by the cache (per device), null: uploads block

    std::vector<llama_expert_cache_bank> banks;
    std::vector<std::pair<const ggml_tensor *, int64_t>> file_offs; // file tier: each expert tensor's offset in the file

    llama_expert_cache_slots slots; // the policy core: slot table, counts, decisions

    std::vector<ggml_backend_event_t> slot_event; // [n_slots] admission landed (null: no events)
    ggml_backend_event_t stage_event = nullptr;    // the step's staged uploads landed (null: they block)
    std::vector<uint8_t>  missed;      // [k * n_tokens] scratch: entries of the step the CPU computes

    // read-ahead (file tier, params.ahead): co-routing counts from this layer to the next file-tier layer
    int32_t               ahead_next = -1; // that layer (-1: none)
    std::vector<uint32_t> ahead_n;         // [n_expert] decode steps routing a here
    std::vector<uint32_t> ahead_co;        // [n_expert * n_expert] steps routing a here and e there
    std::vector<int32_t>  ahead_routed;    // this token's distinct routed ids (learned at the next layer's step)
    std::vector<int32_t>  ahead_es;        // experts of this layer read ahead, in the last staging slices

    std::vector<uint64_t> counts[2];   // [phase][n_expert] routed occurrences
    llama_expert_cache_node nodes[2][3]; // [phase][llama_expert_cache_node_kind] host-node userdata
    std::vector<int32_t>  sel;         // [k * n_tokens] scratch (hybrid): the step's routed ids, from the packed input

    std::vector<llama_expert_cache_recipe_op> recipe; // CPU miss path; empty: misses are uploaded

    // the host nodes of the graph being built, between build() and finish()
    ggml_tensor * building_remap   = nullptr;
    ggml_tensor * building_partial = nullptr; // hybrid: the host node whose one output packs partial, mask, slot ids
    ggml_tensor * building_count   = nullptr;
    ggml_tensor * building_cur     = nullptr;
    ggml_tensor * building_sel     = nullptr; // the routed ids (selected_experts)
    ggml_tensor * building_part    = nullptr; // hybrid, on the device: views of the packed output's copy
    ggml_tensor * building_mask    = nullptr;
    llama_expert_cache_node * building_node = nullptr; // the userdata of the graph's host nodes
    llama_expert_cache_stats stats = {};
};

struct llama_expert_cache {
    llama_expert_cache(const llama_model & model);
    ~llama_expert_cache();

    // Validate params, allocate and fill the banks. Returns a status and sets err.
    int32_t init(const llama_expert_cache_params & params, std::string & err);

    // Graph hook 1, in build_moe_ffn after the experts are selected: builds the host node(s)
    // (not yet in the graph, see expand) and returns the ids the expert matmuls must use;
    // swaps the expert tensors for their banks when remapped.
    ggml_tensor * build(
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
            ggml_tensor        ** gate_up_exps);

    // Graph hook 2, after the routing weights are expanded: adds the host nodes to the graph
    // there, so the top-k routing stays fusable and the host nodes share one split.
    void expand(ggml_cgraph * gf, int il);

    // Graph hook 3, after the down projection: records the CPU recipe and adds the CPU-computed
    // partial result (zero where the device computed) to the expert outputs.
    ggml_tensor * finish(ggml_context * ctx0, int il, ggml_tensor * experts);

    // Record the CPU recipe of a layer from its graph; false if some op cannot be rebuilt.
    bool analyse(llama_expert_cache_layer & L, ggml_tensor * experts, ggml_tensor * sel, ggml_tensor * cur);

    // Run by the host nodes.
    void step(llama_expert_cache_node & n, const ggml_tensor * ids, ggml_tensor * dst, bool remap);
    void compute_partial(llama_expert_cache_node & n, ggml_tensor * dst, int ith, int nth);
    static void write_tail(const llama_expert_cache_layer & L, ggml_tensor * dst);
    static llama_expert_cache_ids routed_ids(llama_expert_cache_layer & L, const ggml_tensor * src, int64_t k);

    // parts of init
    void    make_layers();
    int32_t check_layer(const llama_expert_cache_layer_params & lp, std::string & err);
    int32_t check_layer_tensors(const llama_expert_cache_layer_params & lp, bool file_tier, llama_expert_cache_bank_needs & need,
                                size_t & expert_bytes, std::string & err);
    int32_t configure_layer(const llama_expert_cache_params & params, const llama_expert_cache_layer_params & lp,
                            llama_expert_cache_bank_needs & need, std::string & err);
    int32_t check_budget(const llama_expert_cache_params & params, llama_expert_cache_bank_needs & need, std::string & err);
    int32_t alloc_banks(llama_expert_cache_bank_needs & need, std::string & err);
    int32_t plan_arenas(llama_expert_cache_bank_needs & need, std::string & err);
    void    make_views(const llama_expert_cache_arena & a, ggml_context * c);
    static ggml_backend_buffer_t dry_buffer(ggml_context * c, ggml_backend_buffer_type_t buft, size_t & bytes);
    void    init_admissions(llama_expert_cache_layer & L, ggml_backend_dev_t dev);
    void    init_workers();
    void    upload_pinned(const llama_expert_cache_params & params);
    int32_t open_file_tier(const llama_expert_cache_params & params, std::string & err);
    void    release_mapping();
    size_t  keep_resident();
    void    stage_file_step(llama_expert_cache_layer & L, const llama_expert_cache_ids & v, int32_t * out,
                            std::unique_lock<std::mutex> & lock);

    // read-ahead (llama-expert-cache-file.cpp)
    int32_t open_ahead(const llama_expert_cache_params & params, std::string & err);
    void    ahead_drain();
    int32_t ahead_take(llama_expert_cache_layer & L, int32_t n_admit);
    void    ahead_issue(llama_expert_cache_layer & L, const llama_expert_cache_ids & v);
    void    ahead_learn(llama_expert_cache_layer & P, const std::vector<int32_t> & next);
    bool    ahead_step(const llama_expert_cache_layer & L, const llama_expert_cache_node & n,
                       const llama_expert_cache_ids & v, bool remap) const;

    // the file tier: read experts es[i] into slices ss[i] of every bank of L (blocking, all in flight)
    void    read_experts(llama_expert_cache_layer & L, const int32_t * es, const int32_t * ss, int32_t n, size_t stride = 1);

    // parts of build and analyse
    static ggml_backend_t backend_of(ggml_backend_sched_t sched, ggml_backend_dev_t dev);
    static bool bank_swaps(const llama_expert_cache_layer & L, ggml_tensor ** wts[4], ggml_tensor * swap[4]);
    ggml_tensor * pack_inputs(llama_expert_cache_layer & L, ggml_context * ctx0, ggml_backend_sched_t sched, ggml_tensor * cur,
                              ggml_tensor * selected_experts);
    ggml_tensor * build_cpu_nodes(llama_expert_cache_layer & L, ggml_context * ctx0, ggml_backend_sched_t sched, ggml_backend_t backend_cpu,
                                  int phase, ggml_tensor * node, ggml_tensor * down_exps);
    static bool recipe_order(const llama_expert_cache_layer & L, ggml_tensor * experts, ggml_tensor * sel, ggml_tensor * cur,
                             std::vector<ggml_tensor *> & order);
    bool recipe_src(const llama_expert_cache_layer & L, const std::vector<ggml_tensor *> & order, size_t i, int j,
                    llama_expert_cache_recipe_src & rs);

    // parts of step and compute_partial
    void count_step(llama_expert_cache_layer & L, int phase, const llama_expert_cache_ids & ids);
    void wait_admissions(llama_expert_cache_layer & L);
    void upload_admissions(llama_expert_cache_layer & L, int32_t n_admit, bool background, bool any_wait);
    void upload_staged(llama_expert_cache_layer & L, int32_t n_staged);
    void compute_entries(llama_expert_cache_worker & w, llama_expert_cache_layer & L, ggml_tensor * dst);
    void size_workers(const llama_expert_cache_layer & L, int64_t n_entries, int64_t n_embd_in);
    ggml_tensor * build_recipe(const llama_expert_cache_layer & L, ggml_context * pctx, ggml_tensor * x, ggml_tensor * xi, int64_t n_miss);

    llama_expert_cache_layer * layer(int32_t il);

    const llama_model & model;
    int32_t n_expert = 0;
    int32_t n_threads = 1;
    bool    failed = false; // a host node caught an exception (see the log)

    std::vector<std::unique_ptr<llama_expert_cache_layer>> layers; // [n_layer], null for dense layers
    std::vector<llama_expert_cache_arena> arenas;
    std::vector<ggml_context_ptr>        ctxs;
    std::vector<ggml_backend_buffer_ptr> bufs;
    std::map<ggml_backend_dev_t, ggml_backend_t> upload_backends; // owned
    std::unique_ptr<llama_expert_cache_reader> reader;            // the file tier's, null without one
    std::unique_ptr<llama_expert_cache_reader> ahead_reader;      // its read-ahead's (one helper thread), null: off
    int32_t ahead = 0;          // experts read ahead per layer at most
    int32_t ahead_min_prob = 0; // fixed point, 1 << 16 = 1
    int32_t ahead_pending = -1; // the layer whose reads ahead are in flight
    int32_t ahead_last = -1;    // the file-tier layer whose decode step ran last (this token's, or -1)
    std::vector<uint64_t> ahead_score; // [n_expert] scratch
    std::vector<uint8_t>  ahead_mark;  // [n_expert] scratch
    size_t device_bytes = 0;
    std::map<ggml_backend_buffer_type_t, size_t> bank_bytes; // per device buffer type (a dry run's: what it would hold)
    bool   dry = false; // the model was loaded with no_alloc: banks are sized, never allocated or filled

    // CPU miss path: one worker per thread of the graph (n_threads of them), reused by every step
    std::vector<llama_expert_cache_worker> workers;
    std::atomic<int64_t> cpu_t0{0};   // the step's first worker start (us)
    std::atomic<int32_t> cpu_done{0}; // threads of the step's node that finished
    std::map<const ggml_tensor *, std::vector<uint8_t>> host_mirror; // small device weights (biases) copied once

    bool    trace_on = false;
    bool    count_uncached = true; // uncached MoE layers count (params.count_uncached, or counting only)
    std::vector<int32_t> trace;
    int64_t trace_max = 0;
    int64_t trace_dropped = 0;

    mutable std::mutex mutex; // guards counters and slot tables against readers; never held across uploads
};
