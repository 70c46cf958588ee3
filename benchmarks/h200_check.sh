#!/usr/bin/env bash
# One device call on an H200 (torch 2.11, Python 3.12): every `gpu` test, then the EP check
# on the GPUs there are. Logs and JSON go to $OUT; the last lines printed are the summary.
#   OUT=/tmp/out bash benchmarks/h200_check.sh
set -u
OUT=${OUT:-/tmp/moewire-h200}
mkdir -p "$OUT"
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
python3 -m pytest -q -o addopts="" -m gpu --timeout 300 -p no:cacheprovider tests \
  --ignore=tests/vllm -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
torchrun --nproc-per-node "$gpus" benchmarks/ep_check.py --out "$OUT/ep" 2>&1 \
  | tee "$OUT/ep.log" | tail -14
