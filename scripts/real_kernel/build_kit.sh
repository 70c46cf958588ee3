#!/usr/bin/env bash
# Reproduce the real-kernel kit: DeepGEMM's SM90 Mega-MoE package (pull request #323) with a
# host module _C.so built against the torch at hand. Fetches the sources at the pins below
# (git over HTTPS), stages them as DeepGEMM's build_sgl_deep_gemm.sh does, installs the
# build-time wheels with pip, and compiles _C.so with build_c.py's single c++ command.
# Everything lands in an ignored folder (default .real-kernel-build/); nothing is committed.
#   bash scripts/real_kernel/build_kit.sh [DEST]
# Then: PYTHONPATH=DEST/site:DEST python3 -c "import deep_gemm"   (docs/real-kernel.md)
set -euo pipefail
DEEPGEMM_REF=refs/pull/323/head
DEEPGEMM_SHA=8ddf7f96cb3300011f69458e88c7651a1e305a8c
CUTLASS_SHA=f3fde58372d33e9a5650ba7b80fc48b3b49d40c8   # DeepGEMM's submodule pin
FMT_SHA=553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28       # DeepGEMM's submodule pin
TVM_FFI=apache-tvm-ffi==0.1.11
HERE=$(cd "$(dirname "$0")" && pwd)
DEST=$(mkdir -p "${1:-.real-kernel-build}" && cd "${1:-.real-kernel-build}" && pwd)
SRC=$DEST/src
fetch() {  # fetch URL SHA DIR [REF]: one commit, no history
  mkdir -p "$3"; git -C "$3" init -q
  git -C "$3" fetch -q --depth 1 "$1" "${4:-$2}"
  [ "$(git -C "$3" rev-parse FETCH_HEAD)" = "$2" ] || { echo "$1: ${4:-$2} is not $2" >&2; exit 1; }
  git -C "$3" checkout -q FETCH_HEAD
}
[ -d "$SRC/DeepGEMM" ] || fetch https://github.com/deepseek-ai/DeepGEMM.git $DEEPGEMM_SHA "$SRC/DeepGEMM" $DEEPGEMM_REF
[ -d "$SRC/cutlass" ] || fetch https://github.com/NVIDIA/cutlass.git $CUTLASS_SHA "$SRC/cutlass"
[ -d "$SRC/fmt" ] || fetch https://github.com/fmtlib/fmt.git $FMT_SHA "$SRC/fmt"
# Stage as build_sgl_deep_gemm.sh: the Python package with cute/cutlass headers beside its own,
# and the source root (csrc + third-party) that _C.so is compiled from.
ROOT=$DEST/root
rm -rf "$ROOT" && mkdir -p "$ROOT/third-party"
cp -r "$SRC/DeepGEMM/csrc" "$SRC/DeepGEMM/deep_gemm" "$ROOT/"
[ -d "$SRC/DeepGEMM/sgl_deep_gemm" ] && cp -r "$SRC/DeepGEMM/sgl_deep_gemm" "$ROOT/"
ln -s "$SRC/cutlass" "$ROOT/third-party/cutlass"
ln -s "$SRC/fmt" "$ROOT/third-party/fmt"
cp -r "$SRC/cutlass/include/cute" "$SRC/cutlass/include/cutlass" "$ROOT/deep_gemm/include/"
echo "0.0.0+pr323.${DEEPGEMM_SHA:0:7}" > "$ROOT/deep_gemm/VERSION"
python3 -m pip install -q --target "$DEST/site" "$TVM_FFI"
PYTHONPATH=$DEST/site python3 "$HERE/build_c.py" "$ROOT" "$ROOT/deep_gemm/_C.so" \
  --tvm-dir "$DEST/site/tvm_ffi"
rm -rf "$DEST/deep_gemm" && cp -r "$ROOT/deep_gemm" "$DEST/deep_gemm"
echo "built $DEST/deep_gemm (import it with PYTHONPATH=$DEST/site:$DEST)"
