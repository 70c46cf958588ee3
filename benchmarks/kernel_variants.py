"""Combine kernel revisions and tunings side by side, in one process, on an H200.

Each revision is a file holding ``moewire.kernels._triton`` as it was at some commit
(``git show REV:src/moewire/kernels/_triton.py > /tmp/REV.py``) or the current one
(``current``). For every format and revision it times the revision's default tuning and,
for ``current`` (every revision with ``--grid-all``), the tuning grid (block_h, num_warps,
loop): ``combine_kernel`` with the layout check at one shape (default the tuning target 8 x 8192
x 7168: rows random normal x 0.05 in BF16, every slot valid, static amax = max |rows|),
by CUDA-graph replay as ``benchmarks/combine.py`` does, beside a copy of the same
bytes. Before timing, each variant's output is compared bit for bit with the first
revision's default and its check flag must stay 0 (the rows are the kernel's own ``y``).

    python benchmarks/kernel_variants.py --rev old=/tmp/5fa58fe.py --rev current \
        --out variants.json

JSON (``--out``): ``{"copy_us", "k", "T", "H", "results": [...]}``, one result per variant
with ``fmt``, ``rev``, ``block_h``, ``num_warps``, ``unroll``, ``us``, ``of_copy`` (copy
time / variant time), ``same`` (bitwise equal to the first revision's default), ``flag``;
or ``error`` when the variant did not build or run. Needs CUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import time_graph  # noqa: E402

from moewire import kernels  # noqa: E402
from moewire.format_table import FORMATS as ROWS  # noqa: E402
from moewire.kernels import _triton  # noqa: E402

FORMATS = ("nvfp4", "mxfp4", "nvfp4_token", "fp8", "mxfp8", "fp8_b128", "fp8_b32_ue8m0", "bf16")
# Tunings tried per format besides each revision's default: (block_h, num_warps, unroll).
GRID = {
    "nvfp4": ((1024, 2, True), (1024, 2, False), (512, 1, True), (512, 1, False)),
    "nvfp4_token": (),
    "mxfp4": ((1024, 4, True), (1024, 4, False), (512, 2, True), (512, 2, False)),
}
GRID_DEFAULT = ((1024, 4, True), (1024, 4, False), (512, 2, True), (512, 2, False))
# The loop each revision unrolls by default (the file predates a table of its own).
_UNROLLED_BEFORE = {"bf16", "fp8", "mxfp8"}


def load_revision(spec: str) -> tuple[str, ModuleType]:
    """``NAME=PATH`` (a saved ``_triton.py``) or ``current``."""
    if spec == "current":
        return "current", _triton
    name, _, path = spec.partition("=")
    if not path or not Path(path).is_file():
        raise SystemExit(f"--rev {spec!r}: give NAME=PATH to a saved _triton.py, or current")
    module_spec = importlib.util.spec_from_file_location(f"_triton_{name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return name, module


def default_tuning(mod: ModuleType, fmt: str, k: int, h: int,
                   check: bool) -> tuple[int, int, bool]:
    """The tuning the product would launch ``mod`` with: the current package's for the
    current module and for saved files of the same program layout (v4 on: they have
    ``_tile_cols``); the layout's defaults before that."""
    if mod is _triton or hasattr(mod, "_tile_cols"):
        bh = kernels.tuning.block_h(fmt, h, None)
        return bh, kernels.tuning.num_warps(fmt, bh, None), kernels.tuning.unroll(fmt, k, check)
    if fmt == "nvfp4_token":
        return kernels.tuning.triton_next_pow2(h), 16, False
    return 1024, 4, fmt in _UNROLLED_BEFORE


def launcher(mod, fmt, rows, idx, y, out, flag, block_h, num_warps, unroll, check=True):
    """A call of ``mod.combine_kernel`` (the layout check on unless ``check`` is False; no
    weights, no shared row)."""
    import triton

    t, h = y.shape
    amax = rows.float().abs().amax().reshape(1) if fmt in ("nvfp4", "fp8") else None
    if fmt == "nvfp4_token":
        block_h = kernels.tuning.triton_next_pow2(h)
    grid = (t, triton.cdiv(h, block_h))
    # The codes are the format table's (a saved revision kept them in its own FORMAT_CODES).
    kw = dict(K=rows.shape[0], SHARED=0, FMT=ROWS[fmt].kernel_code, HAS_AMAX=amax is not None,
              WEIGHTED=False, CHECK=check, CALIB=False, BLOCK_H=block_h, HW_CAST=True,
              UNROLL=unroll, num_warps=num_warps, enable_fp_fusion=False)
    if "SPLIT" in mod.combine_kernel.arg_names:  # the current one, and one older revision
        kw["SPLIT"] = ROWS[fmt].split_tile

    def call(_i: int) -> None:
        mod.combine_kernel[grid](
            rows, idx, out, out, y, flag, out, amax if amax is not None else out, h,
            rows.stride(0), rows.stride(1), idx.stride(0), idx.stride(1), 0, 0,
            out.stride(0), y.stride(0), **kw)

    return call


def run(revisions, fmts, k, t, h, grid_all=False, check=True) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = (torch.randn((k, t, h), device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    idx = torch.randint(0, 256, (t, k), device="cuda", generator=gen)
    y = torch.empty((t, h), dtype=torch.bfloat16, device="cuda")
    kernels.fused_combine(rows, idx, t, y, "bf16", None, None)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    minimal = k * t * h * 2 + t * h * 2 + t * k * 8
    src = torch.empty(minimal // 4, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_us = time_graph(lambda i: dst.copy_(src), 30)
    print(f"copy {copy_us:.1f} us ({k} x {t} x {h})", flush=True)
    results = []
    for fmt in fmts:
        first_name, first = revisions[0]
        ref = torch.empty_like(y)
        launcher(first, fmt, rows, idx, y, ref, flag, *default_tuning(first, fmt, k, h, check),
                 check)(0)
        for name, mod in revisions:
            tunings = [default_tuning(mod, fmt, k, h, check)]
            if mod is _triton or grid_all:
                tunings += [g for g in GRID.get(fmt, GRID_DEFAULT) if g not in tunings]
            for bh, nw, unroll in tunings:
                r = dict(fmt=fmt, rev=name, block_h=bh, num_warps=nw, unroll=unroll)
                out = torch.empty_like(y)
                try:
                    call = launcher(mod, fmt, rows, idx, y, out, flag, bh, nw, unroll, check)
                    flag.zero_()
                    call(0)
                    torch.cuda.synchronize()
                    r["flag"] = int(flag)
                    r["same"] = bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
                    r["us"] = time_graph(call, 20)
                    r["of_copy"] = copy_us / r["us"]
                except Exception as e:  # noqa: BLE001 - a variant that fails is reported
                    r["error"] = f"{type(e).__name__}: {e}"[:300]
                results.append(r)
                print(r, flush=True)
    return dict(copy_us=copy_us, k=k, T=t, H=h, check=check, results=results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", action="append", default=None,
                        help="NAME=PATH of a saved _triton.py, or current (repeatable; the "
                             "first is the bitwise reference)")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--grid-all", action="store_true",
                        help="time every revision over the tuning grid (default: only current)")
    parser.add_argument("--no-check", action="store_true",
                        help="time the kernels without the layout check")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernel_variants.py times CUDA kernels: run it on an H200")
    revisions = [load_revision(s) for s in (args.rev or ["current"])]
    doc = run(revisions, args.formats, args.k, args.tokens, args.hidden, args.grid_all,
              not args.no_check)
    print(f"\n{'fmt':14s} {'rev':10s} {'block_h':>7s} {'warps':>5s} {'loop':7s} "
          f"{'us':>8s} {'of copy':>8s} same flag")
    for r in doc["results"]:
        head = (f"{r['fmt']:14s} {r['rev']:10s} {r['block_h']:7d} {r['num_warps']:5d} "
                f"{'unroll' if r['unroll'] else 'rolled':7s}")
        if "us" in r:
            print(f"{head} {r['us']:8.1f} {r['of_copy']:8.2f} {r['same']!s:5s} {r['flag']}")
        else:
            print(f"{head} ERROR {r['error'][:70]}")
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
