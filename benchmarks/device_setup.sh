# Sourced by the benchmarks' device scripts (benchmarks/eval_device_run.sh,
# benchmarks/results/*/device_run.sh, the load profile's call), from the repository root on
# a GPU host, with OUT set: installs the carried wheels of .whl/ (if any) into /tmp/site,
# sets the environment the eval benchmarks need, records the GPU in $OUT/gpu.txt, and sets RK
# to the command that runs a Python script, through DeepGEMM's real SM90 kit when
# .real-kernel/ is carried, else plain python3 with src/ on the path.
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 MOEWIRE_REFERENCE_WEIGHT_CACHE_BYTES=60000000000
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
  | tee "$OUT/gpu.txt"
RK="bash .real-kernel/run.sh"
[ -f .real-kernel/run.sh ] || RK="env PYTHONPATH=${PYTHONPATH:-}:$PWD/src:$PWD python3"
