#!/usr/bin/env bash
# spark bench on an x86-64 machine with one NVIDIA GPU (CUDA 13, nvcc), no network, and a
# python3 that has numpy, rich, typer and psutil but none of Spark's build.
#
# 1. Here, on the CPU machine (after scripts/bootstrap.sh):
#      scripts/gpu_bench.sh prepare
#    writes build/gpu-bundle/stage1 (llama.cpp sources with native/ applied, the pure-python
#    llama_cpp, gguf and diskcache packages, the first part of the SmolLM2 GGUF) and
#    build/gpu-bundle/stage2 (the rest of the GGUF), each <= 60 MiB. build/ is git-ignored:
#    a bundle travels only when a call names it in carry.
# 2. On the GPU machine, with the device tool, back to back (a warm machine keeps its files
#    and the background build for 30 s after a call; a later call gets a bare machine):
#      run(command="bash scripts/gpu_bench.sh stage1", carry=["build/gpu-bundle/stage1"], timeout_s=240)
#      run(command="bash scripts/gpu_bench.sh stage2", carry=["build/gpu-bundle/stage2"], timeout_s=600)
#    stage1 (~20 s): checks, unpacks, configures llama.cpp with CMake (CUDA sm_90, RPC, cuBLAS
#    from the toolkit or else from pip's nvidia-cublas wheel) and starts the build in its own
#    process session. stage2: joins the GGUF, waits for the build (until SPARK_GPU_WAIT s into
#    the call; if it is not done, call stage2 again at once: it resumes), builds the upcycled
#    demo model (E=64, top-4, ~3 GiB; its fit router runs SmolLM2 through the built library),
#    then runs spark bench with a budget that holds 60% of the expert bytes (--residency 0.6,
#    the ceiling measured as a reference) and prints the table last. JSON, PNG and logs go to
#    $OUT (the device tool brings them back).
#    `bash scripts/gpu_bench.sh all` does both stages in one call where one carry can hold both.
# 3. Then, on the same warm machine: run(command="bash scripts/gpu_check.sh", timeout_s=600)
#    (= gpu_bench.sh check): cached vs all-resident logits for prompts of 1/4/12/20/40 tokens
#    and 64 decode tokens at S = P + k, for each miss path, CUDA graphs on and off, with stock
#    --cpu-moe as the bound, and the decode graph's split count (scripts/gpu_check.py).
#    Expected device time: machine start 1-2 min, stage1 ~20 s, stage2 ~7-9 min (CUDA build
#    ~4 min on 16 cores: the whole build took 3,620 CPU-seconds on the CPU machine, docs/cuda.md;
#    then the demo model ~1 min: E=16 took 39 s on 2 cores; bench ~2 min).
#    Rehearsed on the CPU machine with SPARK_GPU_CUDA=0 SPARK_GPU_E=16 (tests/test_gpu_scripts.py
#    keeps the scripts' Python and bench flags in step with the code).
#
# Knobs (environment): SPARK_GPU_WORK (default /tmp/spark-gpu), SPARK_GPU_CUDA=0 (CPU-only
# rehearsal: builds without CUDA and benches on a local RPC stand-in), SPARK_GPU_ARCH (90),
# SPARK_GPU_FA=ON (compile FlashAttention kernels: a longer build), SPARK_GPU_E (64),
# SPARK_GPU_K (4), SPARK_GPU_RESIDENCY (0.6), SPARK_GPU_BENCH_ARGS ("-p 512 -n 128 -r 3"),
# SPARK_GPU_UB4_ARGS ("-p 128 -n 32 -r 2 -ub 4": the second run, 4-token prompt steps), SPARK_GPU_CONFIGS,
# SPARK_GPU_WAIT (420), SPARK_GPU_JOBS (all cores), PYTHON (python3).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=$REPO/build/gpu-bundle
WORK=${SPARK_GPU_WORK:-/tmp/spark-gpu}
PY=${PYTHON:-python3}
CUDA=${SPARK_GPU_CUDA:-1}
ARCH=${SPARK_GPU_ARCH:-90}
FA=${SPARK_GPU_FA:-OFF}
E=${SPARK_GPU_E:-64}
K=${SPARK_GPU_K:-4}
RESIDENCY=${SPARK_GPU_RESIDENCY:-0.6}
BENCH_ARGS=${SPARK_GPU_BENCH_ARGS:--p 512 -n 128 -r 3}
UB4_ARGS=${SPARK_GPU_UB4_ARGS:--p 128 -n 32 -r 2 -ub 4}
CONFIGS=${SPARK_GPU_CONFIGS:-resident,cpu-moe,n-cpu-moe,spark-step,spark,spark-layer}
WAIT=${SPARK_GPU_WAIT:-420}
JOBS=${SPARK_GPU_JOBS:-$(nproc)}
OUTDIR=${OUT:-$WORK/out}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

log() { printf '[gpu_bench %4ss] %s\n' "$SECONDS" "$*"; }
die() { log "error: $*" >&2; exit 2; }
timing() { printf '%-28s %6s s\n' "$1" "$2" >>"$WORK/timings.txt"; log "$1: $2 s"; }

check_manifest() {  # every file of a stage folder against its MANIFEST
    local dir=$1 kind sum size name
    [ -f "$dir/MANIFEST" ] || die "$dir/MANIFEST missing: run 'scripts/gpu_bench.sh prepare' here and carry $dir"
    while read -r kind sum size name; do
        [ "$kind" = file ] || continue
        [ -f "$dir/$name" ] || die "$dir/$name missing (did the carry bring the whole folder?)"
        echo "$sum  $dir/$name" | sha256sum --quiet -c - || die "$dir/$name: checksum mismatch"
    done <"$dir/MANIFEST"
}

find_nvcc() {
    local c
    for c in ${CUDA_HOME:+"$CUDA_HOME/bin/nvcc"} /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc "$(command -v nvcc || true)"; do
        if [ -n "$c" ] && [ -x "$c" ]; then readlink -f "$c"; return 0; fi
    done
    return 1
}

find_cublas() {  # prints "lib_dir include_dir" of a cuBLAS outside the toolkit, "" when the toolkit has it
    local found
    found=$("$PY" "$REPO/scripts/find_cublas.py" "$1" "$BUNDLE/stage1/cublas") || return 1
    [ "$found" = toolkit ] || echo "$found"
}

configure() {
    local flags=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_RPC=ON -DGGML_NATIVE=ON
        -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF)
    command -v ninja >/dev/null && flags+=(-G Ninja)
    : >"$WORK/env.sh"
    if [ "$CUDA" = 1 ]; then
        local nvcc home found lib inc
        nvcc=$(find_nvcc) || die "nvcc not found (PATH, \$CUDA_HOME, /usr/local/cuda*): a CUDA toolkit is needed"
        home=$(dirname "$(dirname "$nvcc")")
        log "nvcc: $nvcc ($("$nvcc" --version | tail -1))"
        flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc" "-DCMAKE_CUDA_ARCHITECTURES=$ARCH"
            -DGGML_CUDA_NO_VMM=ON -DGGML_CUDA_NCCL=OFF "-DGGML_CUDA_FA=$FA")
        if found=$(find_cublas "$home"); then
            if [ -n "$found" ]; then
                read -r lib inc <<<"$found"
                log "cuBLAS: not in the toolkit; using $lib"
                mkdir -p "$WORK/cublas"  # the wheel ships only libcublas.so.N: unversioned names for the linker
                ln -sfn "$lib"/libcublas*.so* "$WORK/cublas/"
                ln -sfn "$(ls "$lib"/libcublas.so.* | head -1)" "$WORK/cublas/libcublas.so"
                ln -sfn "$(ls "$lib"/libcublasLt.so.* | head -1)" "$WORK/cublas/libcublasLt.so"
                flags+=("-DCUDA_cublas_LIBRARY=$WORK/cublas/libcublas.so"
                    "-DCUDA_cublasLt_LIBRARY=$WORK/cublas/libcublasLt.so"
                    "-DCMAKE_CUDA_FLAGS=-I$inc" "-DCMAKE_CXX_FLAGS=-I$inc")
                echo "export LD_LIBRARY_PATH=$lib:\${LD_LIBRARY_PATH:-}" >>"$WORK/env.sh"
            else
                log "cuBLAS: from the toolkit at $home"
            fi
        else
            die "no cuBLAS: neither in $home nor in a pip nvidia-cublas wheel (python: $PY)"
        fi
    else
        log "SPARK_GPU_CUDA=0: CPU-only build (a rehearsal; the bench runs on a local RPC stand-in)"
    fi
    cmake -S "$WORK/llama.cpp" -B "$WORK/build" "${flags[@]}" >"$WORK/configure.log" 2>&1 ||
        { tail -25 "$WORK/configure.log" >&2; die "CMake configure failed (log: $WORK/configure.log)"; }
}

progress() { grep -o '^\[[0-9]*/[0-9]*\]' "$WORK/build.log" 2>/dev/null | tail -1 || true; }

build_running() { [ -f "$WORK/build.pid" ] && kill -0 "$(cat "$WORK/build.pid")" 2>/dev/null; }

cmd_prepare() {
    local t=$SECONDS
    [ -x "$REPO/.venv/bin/python" ] || die ".venv missing: run scripts/bootstrap.sh first"
    "$REPO/.venv/bin/python" "$REPO/scripts/gpu_bundle.py" --out "$BUNDLE"
    log "prepared in $((SECONDS - t)) s; now, back to back on the GPU machine:"
    echo "  run(command=\"bash scripts/gpu_bench.sh stage1\", carry=[\"build/gpu-bundle/stage1\"], timeout_s=240)"
    echo "  run(command=\"bash scripts/gpu_bench.sh stage2\", carry=[\"build/gpu-bundle/stage2\"], timeout_s=600)"
}

cmd_stage1() {
    local t
    command -v nvidia-smi >/dev/null && nvidia-smi -L || log "nvidia-smi: no GPU listed"
    log "python: $("$PY" -c 'import sys; print(sys.version.split()[0])'), cmake: $(cmake --version | head -1), cores: $(nproc)"
    "$PY" -c 'import numpy, rich, typer, psutil' || die "$PY lacks numpy, rich, typer or psutil"
    build_running && die "a build is already running in $WORK (pid $(cat "$WORK/build.pid")): run stage2"
    t=$SECONDS
    check_manifest "$BUNDLE/stage1"
    rm -rf "$WORK"
    mkdir -p "$WORK/home/downloads" "$OUTDIR"
    tar -xJf "$BUNDLE/stage1/src.tar.xz" -C "$WORK"
    tar -xJf "$BUNDLE/stage1/py.tar.xz" -C "$WORK"
    cp "$BUNDLE/stage1/smollm2.part1" "$BUNDLE/stage1/MANIFEST" "$WORK/"
    timing "unpack (stage1)" $((SECONDS - t))
    t=$SECONDS
    configure
    timing "cmake configure" $((SECONDS - t))
    date +%s >"$WORK/build.start"
    # NOTE: its own session, so the build outlives this call while the machine stays warm
    setsid nohup bash -c "cmake --build '$WORK/build' -j $JOBS >'$WORK/build.log' 2>&1; echo \$? >'$WORK/build.rc'" \
        >/dev/null 2>&1 </dev/null &
    echo $! >"$WORK/build.pid"
    log "build started in the background ($JOBS jobs, log $WORK/build.log); call stage2 now"
}

wait_build() {
    local deadline=$WAIT next=$((SECONDS + 30))  # WAIT counts from the start of stage2
    while [ ! -f "$WORK/build.rc" ]; do
        if ! build_running; then
            sleep 1
            [ -f "$WORK/build.rc" ] || die "the build stopped without a status (log: $WORK/build.log)"
            break
        fi
        if [ $SECONDS -ge $deadline ]; then
            log "the build is still running ${WAIT} s into stage2: $(progress)"
            log "call stage2 again right away (it resumes where it stopped)"
            exit 3
        fi
        if [ $SECONDS -ge $next ]; then
            log "building $(progress)"
            next=$((SECONDS + 30))
        fi
        sleep 2
    done
    if [ "$(cat "$WORK/build.rc")" != 0 ]; then
        tail -30 "$WORK/build.log" >&2
        cp "$WORK/build.log" "$OUTDIR/" 2>/dev/null || true
        die "the llama.cpp build failed (log: $WORK/build.log)"
    fi
    if [ ! -f "$WORK/build.seconds" ]; then
        echo $(($(stat -c %Y "$WORK/build.rc") - $(cat "$WORK/build.start"))) >"$WORK/build.seconds"
        timing "llama.cpp build" "$(cat "$WORK/build.seconds")"
    fi
}

use_build() {  # point llama_cpp's bindings (they load lib/ beside them) at the fresh build
    ln -sfn "$WORK/build/bin" "$WORK/py/llama_cpp/lib"
    # shellcheck disable=SC1091
    . "$WORK/env.sh"
    export LLAMA_CPP_LIB_PATH=$WORK/build/bin LD_LIBRARY_PATH=$WORK/build/bin:${LD_LIBRARY_PATH:-}
    "$PY" -c "from spark_cli.native.devices import listed; print('devices:', ', '.join(f'{d.name} ({d.type}, {d.free / 2**30:.1f} of {d.total / 2**30:.1f} GiB free)' for d in listed([])))" ||
        die "the built libraries do not load"
}

cmd_check() {  # scripts/gpu_check.sh: exactness on the device, after stage2 on the same warm machine
    local t model rc=0 rpc=()
    [ -f "$WORK/build.rc" ] || die "no finished build in $WORK: run stage1 and stage2 first (same warm machine)"
    mkdir -p "$OUTDIR"
    export SPARK_HOME=$WORK/home PYTHONPATH=$REPO:$WORK/py PYTHONUNBUFFERED=1
    "$PY" -c 'import yaml, jinja2, typing_extensions' 2>/dev/null || PYTHONPATH=$PYTHONPATH:$WORK/py/fallback
    use_build
    t=$SECONDS
    model=$("$PY" -c "from spark_cli.models.demo_model import build_demo_model; print(build_demo_model(8, 2))") ||
        die "the E=8 demo model could not be built (did stage2 join the GGUF?)"
    timing "demo model E=8 k=2" $((SECONDS - t))
    if [ "$CUDA" != 1 ]; then
        "$PY" -m spark_cli.native.rpc_main --host 127.0.0.1 --port 50052 >"$OUTDIR/rpc.log" 2>&1 &
        sleep 2
        rpc=(--rpc 127.0.0.1:50052)
    fi
    for graphs in on off; do
        t=$SECONDS
        log "exactness, CUDA graphs $graphs ..."
        if [ "$graphs" = off ]; then export GGML_CUDA_DISABLE_GRAPHS=1; else unset GGML_CUDA_DISABLE_GRAPHS; fi
        "$PY" "$REPO/scripts/gpu_check.py" "$model" "${rpc[@]}" --decode "${SPARK_GPU_CHECK_DECODE:-64}" \
            --json "$OUTDIR/check-graphs-$graphs.json" 2>"$OUTDIR/check-graphs-$graphs.err" | tee "$OUTDIR/check-graphs-$graphs.txt" ||
            rc=1
        timing "check, graphs $graphs" $((SECONDS - t))
    done
    unset GGML_CUDA_DISABLE_GRAPHS
    [ "$CUDA" = 1 ] || kill %1 2>/dev/null || true
    [ "$rc" = 0 ] && log "all checks passed" || log "a check failed: see $OUTDIR/check-*.txt"
    return "$rc"
}

cmd_stage2() {
    local t gguf model
    [ -d "$WORK/llama.cpp" ] || die "$WORK is empty: the machine was handed back after stage1; run stage1, then stage2 at once"
    mkdir -p "$OUTDIR"
    export SPARK_HOME=$WORK/home PYTHONPATH=$REPO:$WORK/py PYTHONUNBUFFERED=1
    if ! "$PY" -c 'import yaml, jinja2, typing_extensions' 2>/dev/null; then
        log "$PY lacks pyyaml, jinja2 or typing_extensions: using the bundled pure-python copies"
        PYTHONPATH=$PYTHONPATH:$WORK/py/fallback
    fi
    gguf=$SPARK_HOME/downloads/$GGUF_NAME
    if [ ! -f "$gguf" ]; then
        t=$SECONDS
        check_manifest "$BUNDLE/stage2"
        read -r _ sum _ _ < <(grep '^gguf ' "$WORK/MANIFEST")
        cat "$WORK/smollm2.part1" "$BUNDLE/stage2/smollm2.part2" >"$gguf.tmp"
        echo "$sum  $gguf.tmp" | sha256sum --quiet -c - || { rm -f "$gguf.tmp"; die "the joined GGUF has the wrong checksum"; }
        mv "$gguf.tmp" "$gguf"
        timing "join GGUF" $((SECONDS - t))
    fi
    t=$SECONDS
    wait_build
    [ $((SECONDS - t)) -gt 2 ] && timing "waiting for the build" $((SECONDS - t))
    use_build
    if [ ! -f "$WORK/model.path" ]; then
        # NOTE: after the build, not beside it: the fit router runs dense SmolLM2 through the built
        # library to capture each layer's FFN input (models/demo_router.py; a few thousand tokens)
        t=$SECONDS
        log "building the demo model E=$E k=$K ..."
        "$PY" -c "from spark_cli.models.demo_model import build_demo_model; print(build_demo_model($E, $K))" \
            >"$WORK/model.path.tmp" 2>"$WORK/model.log" || { cat "$WORK/model.log" >&2; die "demo model build failed"; }
        mv "$WORK/model.path.tmp" "$WORK/model.path"
        timing "demo model E=$E k=$K" $((SECONDS - t))
    fi
    model=$(cat "$WORK/model.path")
    log "model: $model ($(du -h "$model" | cut -f1))"
    local extra=()
    [ "$CUDA" = 1 ] || extra+=(--rpc auto)
    if "$PY" -c 'import matplotlib' 2>/dev/null; then
        extra+=(--plot "$OUTDIR/bench.png")
    else
        log "no matplotlib in $PY: no plot"
    fi
    t=$SECONDS
    # NOTE: a 512-token prompt (BENCH_ARGS) through every configuration, the per-layer miss rule
    # before issue 25 (spark-layer) beside the per-expert one (spark)
    # shellcheck disable=SC2086
    COLUMNS=${COLUMNS:-170} "$PY" -m spark_cli.cli bench "$model" --residency "$RESIDENCY" --ceiling $BENCH_ARGS \
        --configs "$CONFIGS" "${extra[@]}" -o "$OUTDIR/bench.json" >"$OUTDIR/bench.txt" 2>"$OUTDIR/bench.err" ||
        { tail -20 "$OUTDIR/bench.err" >&2; die "spark bench failed"; }
    timing "spark bench" $((SECONDS - t))
    # prompt steps of 4 tokens (-ub 4: as speculative or MTP verification, or a few batched
    # sequences): the split against both fixed paths
    t=$SECONDS
    # shellcheck disable=SC2086
    COLUMNS=${COLUMNS:-170} "$PY" -m spark_cli.cli bench "$model" --residency "$RESIDENCY" $UB4_ARGS \
        --configs n-cpu-moe,spark,spark-layer "${extra[@]/bench.png/bench-ub4.png}" -o "$OUTDIR/bench-ub4.json" \
        >"$OUTDIR/bench-ub4.txt" 2>"$OUTDIR/bench-ub4.err" ||
        { tail -20 "$OUTDIR/bench-ub4.err" >&2; die "spark bench -ub 4 failed"; }
    timing "spark bench -ub 4" $((SECONDS - t))
    cp "$WORK/timings.txt" "$OUTDIR/" 2>/dev/null || true
    echo
    echo "timings (s):"
    cat "$WORK/timings.txt"
    echo
    cat "$OUTDIR/bench.txt"
    echo
    echo "-ub 4:"
    cat "$OUTDIR/bench-ub4.txt"
}

case "${1:-}" in
    prepare) cmd_prepare ;;
    stage1) cmd_stage1 ;;
    stage2) cmd_stage2 ;;
    all) cmd_stage1 && cmd_stage2 ;;
    check) cmd_check ;;
    *) sed -n '2,30p' "$0"; exit 2 ;;
esac
