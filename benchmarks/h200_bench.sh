#!/usr/bin/env bash
# One device call for the benchmark tables docs/performance.md and docs/eval.md quote:
#   combine  benchmarks/combine_formats.py at 8192 tokens (every format, check on and off)
#   ncu      the NVFP4 combine's hardware counters (benchmarks/profile_combine.py under ncu)
#   forward  benchmarks/forward_overhead.py (grouped_mm, "moewire" plain and quantized; the
#            real SM90 kernel's rows when .real-kernel/ is carried), with --profile
#   eval     benchmarks/eval_throughput.py (moewire eval beside the plain forward)
# Logs and JSON go to $OUT/bench.tgz; each part has its own time limit (seconds).
#   OUT=/tmp/out bash benchmarks/h200_bench.sh combine ncu forward eval
set -u
DEST=${OUT:-/tmp/moewire-bench}
R=/tmp/moewire-bench-raw
mkdir -p "$R" "$DEST"
if ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD
else
  export PYTHONPATH=$PWD/src:$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$R/gpu.txt"
parts=("$@")
[ $# -eq 0 ] && parts=(combine ncu forward eval)
for part in "${parts[@]}"; do
  case $part in
    combine)
      timeout 150 python3 benchmarks/combine_formats.py --tokens 8192 \
        --out "$R/combine_formats.json" > "$R/combine_formats.log" 2>&1
      echo "== combine (rc $?)"; grep -E "^\S+ +8192|model" "$R/combine_formats.log" | tail -70 ;;
    ncu)
      timeout 60 ncu --clock-control none -k regex:combine_kernel --launch-skip 2 \
        --launch-count 1 --section SpeedOfLight --section WarpStateStats --section Occupancy \
        --section SchedulerStats --metrics smsp__inst_executed.sum,launch__registers_per_thread \
        python3 benchmarks/profile_combine.py --fmt nvfp4 --k 6 --hidden 7168 \
        > "$R/ncu_nvfp4.txt" 2>&1
      echo "== ncu nvfp4 (rc $?)"
      grep -E "Duration|Issue Slots Busy|Achieved Occupancy|Registers Per|No Eligible|Memory Throughput|SM Frequency|inst_executed" \
        "$R/ncu_nvfp4.txt" | head -12 ;;
    forward)
      if [ -f .real-kernel/run.sh ]; then
        OUT=$R timeout 150 bash .real-kernel/run.sh benchmarks/forward_overhead.py --profile \
          --iters 10 --out "$R/forward/forward.json" > "$R/forward.log" 2>&1
      else
        timeout 150 python3 benchmarks/forward_overhead.py --profile --iters 10 \
          --out "$R/forward/forward.json" > "$R/forward.log" 2>&1
      fi
      echo "== forward (rc $?)"; grep -E "^-- |^moewire|^grouped_mm|^row|tokens," "$R/forward.log" | tail -24 ;;
    eval)
      timeout 150 python3 benchmarks/eval_throughput.py --tokens 4096 16384 65536 \
        --out "$R/eval" > "$R/eval_throughput.log" 2>&1
      echo "== eval (rc $?)"; tail -14 "$R/eval_throughput.log" ;;
  esac
done
rm -f "$R"/jitcache.tgz
tar czf "$DEST/bench.tgz" -C "$R" .
