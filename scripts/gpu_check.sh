#!/usr/bin/env bash
# Exactness of the expert cache on CUDA, after scripts/gpu_bench.sh stage1 + stage2 on the same
# warm GPU machine (it reuses their build). One device call: run(command="bash scripts/gpu_check.sh",
# timeout_s=600). Writes check-graphs-{on,off}.{txt,json} to $OUT; exit 1 if a check fails.
# Rehearsal here without a GPU: SPARK_GPU_CUDA=0 (the RPC stand-in, where every run must be exact).
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu_bench.sh" check "$@"
