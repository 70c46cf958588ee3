"""Measure ``rcp.approx.ftz.f32`` on this GPU where FlashInfer's NVFP4 combine uses it.

FlashInfer's encoder takes ``enc = rcp.approx.ftz.f32(ds)`` of the decode scale
``ds = fl(a * fl(1/6))`` of a BF16 block amax ``a``. ``ds`` takes one significand per BF16
significand of ``a`` (128 of them), so the instruction's result on every BF16 amax is
fixed by 128 numbers if it depends only on the significand of its input (exponent
invariance, checked here on every one of the 2^23 significands at several exponents).

Writes ``rcp_approx.json`` (the GPU, the per-BF16-significand offset of the result from
the correctly rounded reciprocal, in units in the last place, and the checks) and
``rcp_approx_bf16_amax.npz`` (``a_bits``, ``ds_bits``, ``rcp_bits`` int32 for every positive
normal BF16 ``a``): ``tests/formats/test_flashinfer_rcp.py`` checks the format's model
against that dump on CPU.

    python benchmarks/rcp_approx_table.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moewire.formats._numerics import mul_recip  # noqa: E402


def rcp_approx(x: torch.Tensor) -> torch.Tensor:
    """``rcp.approx.ftz.f32`` of FP32 CUDA ``x`` through Triton's inline PTX."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < n, other=1.0)
        y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [v],
                                      dtype=tl.float32, is_pure=True, pack=1)
        tl.store(y_ptr + offs, y, mask=offs < n)

    x = x.contiguous()
    y = torch.empty_like(x)
    kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y


def ulp_offset(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``bits(approx) - bits(exact)`` (int32; both positive normal FP32)."""
    return approx.view(torch.int32) - exact.view(torch.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")

    # Every significand at several exponents: is the offset a function of the significand?
    sig = torch.arange(0, 1 << 23, dtype=torch.int32, device=dev)
    offsets = {}
    for e in (-125, -64, -1, 0, 1, 64, 125):
        x = ((e + 127) << 23 | sig).view(torch.float32)
        offsets[e] = ulp_offset(rcp_approx(x), torch.reciprocal(x))
    base = offsets[0]
    invariant = {e: int((o != base).sum()) for e, o in offsets.items()}
    histogram = {int(v): int((base == v).sum()) for v in base.unique().tolist()}

    # Every positive normal BF16 amax: its decode scale and the instruction's reciprocal.
    a_bits = torch.arange(0x0080, 0x7F80, dtype=torch.int32, device=dev)
    a = a_bits.to(torch.int16).view(torch.bfloat16).float()
    ds = mul_recip(a, 6.0)
    normal = ds >= torch.finfo(torch.float32).tiny
    approx = rcp_approx(ds)
    off = torch.where(normal, ulp_offset(approx, torch.reciprocal(ds)), 0)
    table = []
    consistent = True
    for m in range(128):
        seen = off[normal & ((a_bits & 0x7F) == m)].unique().tolist()
        consistent &= len(seen) == 1
        table.append(seen[0] if len(seen) == 1 else seen)

    report = {
        "gpu": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "instruction": "rcp.approx.ftz.f32",
        "significand_offsets_at_exponent_0": histogram,
        "significands_whose_offset_changes_with_the_exponent": invariant,
        "bf16_amax_count": int(a.numel()),
        "bf16_amax_normal_ds": int(normal.sum()),
        "bf16_amax_differing": int((off != 0).sum()),
        "offset_by_bf16_significand_consistent": consistent,
        "offset_by_bf16_significand": table,
    }
    (args.out / "rcp_approx.json").write_text(json.dumps(report, indent=1) + "\n")
    np.savez_compressed(args.out / "rcp_approx_bf16_amax.npz", a_bits=a_bits.cpu().numpy(),
                        ds_bits=ds.view(torch.int32).cpu().numpy(),
                        rcp_bits=approx.view(torch.int32).cpu().numpy())
    print(f"{report['gpu']} sm_{''.join(map(str, report['capability']))}")
    print(f"offset histogram over 2^23 significands: {histogram}")
    print(f"significands whose offset depends on the exponent: {invariant}")
    print(f"BF16 amaxes: {report['bf16_amax_count']}, differing from 1/ds: "
          f"{report['bf16_amax_differing']}, per-significand offset consistent: {consistent}")
    print("offset by BF16 significand:", table)


if __name__ == "__main__":
    main()
