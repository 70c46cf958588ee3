#!/usr/bin/env bash
# One device call on an H200 (torch 2.11, Python 3.12): every `gpu` test, the EP check on the
# GPUs there are, then (when the SM90 kit is carried in .real-kernel/) the real-kernel tier,
# the study on the real kernel and the overhead benchmark (scripts/real_kernel/device_run.py).
# Logs and JSON go to $OUT/results.tgz (one archive: the device tool brings back at most 8
# files); the last lines printed are the summary.
#   OUT=/tmp/out bash benchmarks/h200_check.sh [TIER_S STUDY_S BENCH_S]
set -u
DEST=${OUT:-/tmp/moewire-h200}
OUT=/tmp/moewire-h200-raw
mkdir -p "$OUT" "$DEST"
ROOT=$PWD
# ModelOpt 0.47 and what the image lacks, carried as wheels in .whl/ (gitignored).
if ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD
else
  export PYTHONPATH=$PWD/src:$PWD
fi
export PYTHONUNBUFFERED=1 MOEWIRE_REFERENCE_WEIGHT_CACHE_BYTES=60000000000
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git -C "$ROOT" rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /'
python3 -m pytest -q -o addopts="" -m gpu --timeout 300 -p no:cacheprovider tests \
  --ignore=tests/vllm --ignore=tests/real_kernel -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
torchrun --nproc-per-node "$gpus" benchmarks/ep_check.py --out /tmp/ep 2>&1 \
  | tee "$OUT/ep.log" | tail -14
cp /tmp/ep/*.json "$OUT/" 2>/dev/null
if [ -f .real-kernel/run.sh ]; then
  OUT=/tmp/rk bash .real-kernel/run.sh scripts/real_kernel/device_run.py "$@" 2>&1 | tail -80
  for f in tier.log tier.xml study.log study_results.json overhead.log overhead.json \
      profile.json; do
    [ -f /tmp/rk/$f ] && cp /tmp/rk/$f "$OUT/rk_$f"
  done
fi
tar czf "$DEST/results.tgz" -C "$OUT" .
echo "== gpu tests =="; tail -1 "$OUT/gpu_tests.log"
