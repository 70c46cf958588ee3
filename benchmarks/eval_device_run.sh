#!/usr/bin/env bash
# One device call (H100 or H200; torch 2.11, Python 3.12) for moewire eval: the GPU tier of
# what eval touches (graphed equals eager bit for bit, a replay that differs drops the
# graphs, memory back after return and after an error, the fused metrics kernel against
# float64, NVFP4's global-scale fallback; the real SM90 kernel when .real-kernel/ is
# carried), then benchmarks/eval_throughput.py at Qwen3-30B-A3B's shapes, eager and graphed
# in one run, per kernel. Logs and JSON go to $OUT (TOKENS overrides the token counts).
#   OUT=/tmp/out bash benchmarks/eval_device_run.sh [tests] [KERNEL ...]
# (no argument: the tests, then both kernels' benchmark). Used by
# benchmarks/results/eval-fused-h100/ and eval-graphs-default/.
set -u
OUT=${OUT:-/tmp/moewire-eval}
. benchmarks/device_setup.sh
WHAT=${*:-tests deepgemm-sm90 stand-in}
case " $WHAT " in *" tests "*)
  OUT=/tmp/rk timeout 150 $RK -m pytest -q -o addopts="" -m gpu -p no:cacheprovider -rfE \
  tests/eval/test_eval_graphs.py tests/eval/test_eval_memory.py tests/eval/test_streaming.py \
  tests/kernels/test_logit_metrics.py tests/formats/test_nvfp4_gs_underflow.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -25;;
esac
for kernel in $WHAT; do
  [ "$kernel" = tests ] && continue
  OUT=/tmp/rk timeout 200 $RK benchmarks/eval_throughput.py --tokens ${TOKENS:-16384 65536} \
    --pairs fp8:nvfp4 --kernel "$kernel" --out "$OUT/$kernel" 2>"$OUT/$kernel.err" \
    | tee "$OUT/$kernel.log"
  tail -3 "$OUT/$kernel.err"
done
