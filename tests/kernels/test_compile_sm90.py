"""The kernels compile for the H200 (sm_90) on a machine without a GPU.

The interpreter tests run the ``HW_CAST=False`` paths; the GPU-only code (inline PTX for the
packed BF16 conversions, ``tl.fma``, the saturating E4M3 convert) is only compiled on a GPU.
Here Triton compiles each kernel ahead of time for sm_90 with the ``ptxas`` its wheel ships,
so a kernel that would not build on an H200 fails in CI, under the pinned Triton and the
newest one (``make test-triton-next``). What the compiled code computes is checked on the
H200 (``pytest -m gpu``).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moewire.format_table import FORMATS

triton = pytest.importorskip("triton")

_ROOT = Path(__file__).resolve().parents[2]
_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
pytestmark = pytest.mark.skipif(not os.path.exists(_PTXAS), reason="Triton ships no ptxas here")
# Every format with a kernel (the format table's rows with a kernel code).
_FORMATS = tuple(name for name, row in FORMATS.items() if row.kernel_code is not None)
# Hidden sizes whose default programs differ: 1024 columns (V4-Pro, the target) and 512
# (Kimi-K3's 3584, one warp for the NVFP4 formats' 16-column threads).
_HIDDEN = (7168, 3584)


@functools.cache
def _compiled() -> dict[str, str]:
    """Compile every kernel in a child process (the test session interprets the kernels:
    ``TRITON_INTERPRET=1``); ``{"combine/fmt": "ok" or the error}``."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = "import json, tests.kernels.test_compile_sm90 as m; print(json.dumps(m.compile_all()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def compile_all() -> dict[str, str]:
    """(In the child) each kernel of each format at each hidden size, compiled for sm_90."""
    results = {}
    for fmt in _FORMATS:
        for hidden in _HIDDEN:
            for kind, build in (("combine-unrolled", functools.partial(_combine, unroll=True)),
                                ("combine-rolled", functools.partial(_combine, unroll=False)),
                                ("qdq", _qdq)):
                key = f"{kind}/{fmt}/{hidden}"
                try:
                    assert build(fmt, hidden).asm["cubin"]
                    results[key] = "ok"
                except Exception as e:  # noqa: BLE001 - reported by the test that reads it
                    results[key] = f"{type(e).__name__}: {e}"[-2000:]
    return results


def _compile(fn, signature: dict[str, str], constants: dict, aligned: list[str], warps: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = dict(signature)
    sig.update({name: "constexpr" for name in constants})
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, sig, constexprs=constants, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "enable_fp_fusion": False})


def _combine(fmt: str, hidden: int, unroll: bool):
    """Every mode at once (weighted, check, calibration, a shared row last), the format's
    default block and warps, the slot loop unrolled or rolled (the default picks either by
    format, k and the check: ``kernels.tuning.unroll``)."""
    from moewire import formats, kernels
    from moewire.kernels import _triton

    ptr = {n: "*bf16" for n in ("rows_ptr", "out_ptr", "check_ptr")}
    ptr.update(idx_ptr="*i64", w_ptr="*fp32", flag_ptr="*i32", calib_ptr="*fp32",
               amax_ptr="*fp32")
    ints = {n: "i32" for n in ("H", "stride_rs", "stride_rt", "stride_it", "stride_ik",
                               "stride_wt", "stride_wk", "stride_o", "stride_c")}
    bh = kernels.tuning.block_h(fmt, hidden, None)
    row = FORMATS[fmt]
    constants = dict(K=8, SHARED=2, FMT=row.kernel_code, SPLIT=row.split_tile,
                     HAS_AMAX=row.needs_amax, WEIGHTED=True, CHECK=True, CALIB=True,
                     BLOCK_H=bh, HW_CAST=True, UNROLL=unroll,
                     # The format's own accumulation mode (what the combine launches with).
                     ACC_F32=formats.get(fmt).combine_accumulate == "fp32")
    return _compile(_triton.combine_kernel, {**ptr, **ints}, constants,
                    [*ptr, "H", "stride_rt", "stride_it", "stride_o", "stride_c"],
                    kernels.tuning.num_warps(fmt, bh, None))


def _qdq(fmt: str, hidden: int):
    from moewire import kernels
    from moewire.kernels import _triton

    sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "amax_ptr": "*fp32", "H": "i32",
           "stride_x": "i32", "stride_o": "i32"}
    bh = kernels.tuning.block_h(fmt, hidden, None, pad_least=False)
    row = FORMATS[fmt]
    constants = dict(FMT=row.kernel_code, SPLIT=row.split_tile, HAS_AMAX=row.needs_amax,
                     BLOCK_H=bh, HW_CAST=True)
    return _compile(_triton.qdq_kernel, sig, constants,
                    ["x_ptr", "out_ptr", "amax_ptr", "H", "stride_x", "stride_o"],
                    kernels.tuning.num_warps(fmt, bh, None))


def test_every_format_is_compiled():
    from moewire import kernels

    assert _FORMATS == kernels.SUPPORTED_FORMATS


@pytest.mark.parametrize("hidden", _HIDDEN)
@pytest.mark.parametrize("kind", ["combine-unrolled", "combine-rolled", "qdq"])
@pytest.mark.parametrize("fmt", _FORMATS)
def test_kernel_compiles_for_sm90(kind, fmt, hidden):
    assert _compiled()[f"{kind}/{fmt}/{hidden}"] == "ok"
