#!/usr/bin/env bash
# One device call (H100 or H200; torch 2.11, Python 3.12): the GPU tier of moewire eval under
# CUDA graphs (graphed equals eager bit for bit, memory back after return and after an error;
# the real SM90 kernel when .real-kernel/ is carried), then benchmarks/eval_throughput.py at
# Qwen3-30B-A3B's shapes, eager and graphed in one run, on the stand-in and on the real SM90
# kernel. Logs and JSON go to $OUT.
#   OUT=/tmp/out bash benchmarks/results/eval-graphs-h100/device_run.sh
set -u
OUT=${OUT:-/tmp/moewire-eval-graphs}
. benchmarks/device_setup.sh
OUT=/tmp/rk timeout 240 $RK -m pytest -q -o addopts="" -m gpu -p no:cacheprovider -rfE \
  tests/eval/test_eval_graphs.py tests/eval/test_eval_memory.py 2>&1 | tee "$OUT/gpu_tests.log" \
  | tail -30
for kernel in stand-in deepgemm-sm90; do
  OUT=/tmp/rk timeout 200 $RK benchmarks/eval_throughput.py --tokens 16384 65536 \
    --pairs fp8:nvfp4 --kernel "$kernel" --out "$OUT/$kernel" 2>"$OUT/$kernel.err" \
    | tee "$OUT/$kernel.log"
  tail -5 "$OUT/$kernel.err"
done
