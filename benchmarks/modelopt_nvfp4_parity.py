"""Where moewire's NVFP4 and ModelOpt 0.47's CUDA NVFP4 fake quant differ, and why (H200).

ModelOpt's NVFP4 fake quant runs only on CUDA, as a Triton kernel. moewire's ``nvfp4``
(``moewire.formats``) divides with correct rounding and writes ``sign(x) * q * bs``. This
script counts, on random data, the elements whose values differ, those whose bits differ,
and how many of the latter are zeros of opposite sign. It also runs that math in torch
with its two divisions done by a one-line Triton kernel (``a / b``, Triton's default, not
correctly rounded) to see whether the division alone would change any value.

    PYTHONPATH=src python3 benchmarks/modelopt_nvfp4_parity.py --out DIR

Measured on an H200 (benchmarks/results/modelopt-nvfp4/): no value differs; every bit
difference is a negative input that rounds to zero, -0.0 in moewire, +0.0 in ModelOpt.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

import moewire

E2M1_BOUNDS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True),
               (3.5, False), (5.0, True))  # (threshold, value at the threshold rounds down)
E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@triton.jit
def _div_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask)
    b = tl.load(b_ptr + offs, mask=mask, other=1.0)
    tl.store(out_ptr + offs, a / b, mask=mask)


def triton_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = torch.broadcast_tensors(a.float(), b.float())
    a, b = a.contiguous(), b.contiguous()
    out = torch.empty_like(a)
    _div_kernel[(triton.cdiv(a.numel(), 1024),)](a, b, out, a.numel(), BLOCK=1024)
    return out


def e2m1(a: torch.Tensor) -> torch.Tensor:
    q = torch.full_like(a, E2M1_LEVELS[-1])
    for (bound, down), level in zip(reversed(E2M1_BOUNDS), reversed(E2M1_LEVELS[:-1]),
                                    strict=True):
        q = torch.where(a <= bound if down else a < bound, level, q)
    return q


def nvfp4_with(div, x: torch.Tensor, amax: float) -> torch.Tensor:
    """moewire's NVFP4 definition with ``div`` for its two tensor divisions (FP32 math)."""
    xf = x.float().reshape(-1, 16)
    gs = torch.tensor(amax, device=x.device) * (1.0 / 2688.0)
    bmax = xf.abs().amax(dim=1, keepdim=True)
    bs = div(bmax, 6.0 * gs).clamp(max=448.0).to(torch.float8_e4m3fn).float() * gs
    bs = torch.where(bs >= 1e-5, bs, torch.ones_like(bs))
    q = e2m1(div(xf.abs(), bs)) * bs
    return torch.where(xf >= 0, q, -q).reshape(x.shape).to(x.dtype)


def modelopt_nvfp4(x: torch.Tensor, amax: float) -> torch.Tensor:
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    cfg = QuantizerAttributeConfig(num_bits=(2, 1), block_sizes={
        -1: 16, "type": "dynamic", "scale_bits": (4, 3)})
    tq = TensorQuantizer(cfg)
    tq.amax = torch.tensor(amax, dtype=torch.float32)
    return tq.to(x.device)(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args()
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for seed in range(3):
            g = torch.Generator(device="cuda").manual_seed(seed)
            x = torch.randn(128, 256, generator=g, device="cuda") * 2.0
            if seed == 2:  # log-normal magnitudes over ~6 decades: many values round to 0
                x = torch.exp(x * 1.5) * torch.sign(torch.randn_like(x))
            x = x.to(dtype)
            amax = float(x.float().abs().max())
            theirs = modelopt_nvfp4(x, amax)
            ours = moewire.fake_quant(x, "nvfp4", amax)
            emulated = nvfp4_with(triton_div, x, amax)
            exact = nvfp4_with(torch.div, x, amax)
            bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
            bit_diff = ours.view(bits) != theirs.view(bits)
            rows.append({
                "dtype": str(dtype), "seed": seed, "amax": amax, "elements": x.numel(),
                "moewire_vs_modelopt": int((ours != theirs).sum()),
                "moewire_vs_modelopt_bits": int(bit_diff.sum()),
                "bit_diffs_that_are_signed_zeros": int(
                    (bit_diff & (ours == 0) & (theirs == 0)).sum()),
                "exact_division_emulation_vs_moewire": int((exact != ours).sum()),
                "triton_division_emulation_vs_modelopt": int((emulated != theirs).sum()),
                "triton_div_vs_true_div_elements": int(
                    (triton_div(x.float().abs(), torch.full_like(x.float(), 0.7)) !=
                     x.float().abs() / torch.full_like(x.float(), 0.7)).sum()),
            })
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "modelopt_nvfp4_parity.json").write_text(json.dumps(rows, indent=2))
    keys = list(rows[0])
    print(" ".join(f"{k[:14]:>14s}" for k in keys))
    for r in rows:
        print(" ".join(f"{str(r[k])[:14]:>14s}" for k in keys))


if __name__ == "__main__":
    main()
