"""Combine benchmark on DeepGEMM 2.8.0's NVFP4 x NVFP4 layout (``fp4_fp4_mega_moe``).

moewire's combine quantizer re-sums the rows the kernel leaves in its ``fp4xfp4`` buffer:
the BF16 ``[k (+1), Tmax, H]`` region right after ``l2_acts_sf`` (the buffer's last region),
read through moewire's layout (``megamoe.layout.combine_rows`` with the ``deepgemm-2.8``
build) from the stand-in's buffer (``moewire.reference.fp4_fp4``). Two cases:

- ``routed``: vLLM main's ``DeepseekV32MegaMoEExperts`` (no fused shared expert,
  ``routed_scaling_factor`` 1): the fused Triton combine alone, one pass;
- ``shared-rsf``: a fused BF16 shared expert and ``routed_scaling_factor`` 2.5 (vLLM main's
  ModelOpt NVFP4 quant method): the fused combine of the routed rows, then the kernel's
  finish (the routed sum rounded to BF16, scaled, the shared row added).

Timed per (shape, case, format): ``fused_us`` (``megamoe.resum`` with the CUDA kernels,
captured in a CUDA graph), ``torch_us`` (the same with ``MOEWIRE_DISABLE_KERNELS=1``, the
definition), ``copy_us`` (a copy of the same minimal bytes: ``k*T*H*2`` rows read, plus
``T*H*2`` for the shared row, ``T*H*2`` written, ``T*k*8`` ids), and ``exact`` (the fused
result equals the torch one bit for bit). Run on an H200::

    python benchmarks/combine_fp4_fp4.py --out benchmarks/results/combine_fp4_fp4.json

``--device cpu`` is a smoke run of the torch path on one small shape (its times mean
nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import copies_for, gbps, print_table, time_graph, time_loop  # noqa: E402

from moewire.megamoe import flavours  # noqa: E402
from moewire.megamoe.layout import combine_rows  # noqa: E402
from moewire.megamoe.resum import resum  # noqa: E402
from moewire.quantizer import WireQuantizer  # noqa: E402
from moewire.reference import deep_gemm  # noqa: E402

#: DeepSeek V3.2 / GLM-5.2's MoE layer (256 routed experts, top-8, H 7168, I 2048).
SHAPES = {"V3.2": (256, 8, 7168, 2048)}
SMOKE = {"smoke": (16, 4, 512, 512)}
TOKENS = (128, 1024, 8192)
CASES = {"routed": (False, 1.0), "shared-rsf": (True, 2.5)}
FORMATS = ("fp8", "nvfp4", "mxfp8")
COLUMNS = [
    ("model", "model", ""), ("case", "case", ""), ("T", "T", ""), ("fmt", "fmt", ""),
    ("fused_us", "fused us", ".1f"), ("fused_gbps", "GB/s", ".0f"),
    ("frac_copy", "of copy", ".2f"), ("copy_us", "copy us", ".1f"),
    ("torch_us", "torch us", ".0f"), ("x_torch", "x torch", ".1f"), ("exact", "exact", ""),
]


def _buffers(n, e, k, h, inter, t, shared, device, gen):
    """``n`` fp4xfp4 buffers with random rows in their combine region and staged ids; the
    rows as moewire reads them (``combine_rows``)."""
    build = flavours.get("deepgemm-2.8")
    out = []
    for _ in range(n):
        with deep_gemm.use_flavour("deepgemm-2.8"):
            buf = deep_gemm.get_symm_buffer_for_mega_moe(
                None, e, t, k, h, inter, num_shared_experts=int(shared), mma_type="fp4xfp4",
                device=device)
        rows = combine_rows(buf, build, "fp4_fp4_mega_moe", fused_shared=shared)
        rows[:, :t].copy_(torch.randn(rows[:, :t].shape, device=device, generator=gen) * 0.05)
        ids = torch.randint(0, e, (t, k), device=device, generator=gen)
        ids[torch.rand((t, k), device=device, generator=gen) < 0.2] = -1
        buf.topk_idx[:t].copy_(ids)
        out.append((buf, rows))
    return out


def bench(model, e, k, h, inter, t, case, device):
    shared, rsf = CASES[case]
    minimal = k * t * h * 2 + t * h * 2 * (2 if shared else 1) + t * k * 8
    n = copies_for(minimal, device)
    gen = torch.Generator(device=device).manual_seed(t * 7 + h)
    bufs = _buffers(n, e, k, h, inter, t, shared, device, gen)
    position = "last" if shared else None
    scale = rsf if (shared or rsf != 1.0) else None
    out = torch.empty((n, t, h), dtype=torch.bfloat16, device=device)
    src = torch.empty((n, minimal // 2), dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    reps = max(4, min(200, int(4e9 / minimal / max(1, n)) * n))
    copy_us = time_graph(lambda i: dst[i % n].copy_(src[i % n]), reps, device=device)
    results = []
    for fmt in FORMATS:
        rows0 = bufs[0][1]
        amax = float(rows0[:k, :t].float().abs().max()) if fmt in ("fp8", "nvfp4") else None
        q = WireQuantizer(fmt, constant_amax=amax).to(device)

        def call(i, q=q):
            buf, rows = bufs[i % n]
            return resum(rows, buf.topk_idx, t, shared_position=position, row_quantizer=q,
                         out=out[i % n], routed_scale=scale)

        r = dict(model=model, case=case, T=t, k=k, H=h, fmt=fmt, bytes=minimal, copies=n,
                 copy_us=copy_us, device=device)
        fused = call(0).clone() if device == "cuda" else None
        if device == "cuda":
            r["fused_us"] = time_graph(call, reps, device=device)
        os.environ["MOEWIRE_DISABLE_KERNELS"] = "1"
        try:
            plain = call(0).clone()
            r["torch_us"] = time_loop(call, max(2, reps // 20), device=device)
        finally:
            del os.environ["MOEWIRE_DISABLE_KERNELS"]
        if fused is not None:
            r["exact"] = bool(torch.equal(fused.view(torch.int16), plain.view(torch.int16)))
            if not r["exact"]:
                print(f"WARNING fp4xfp4 combine {case} {fmt} T={t}: fused != torch", flush=True)
        r["fused_gbps"] = gbps(minimal, r.get("fused_us"))
        r["frac_copy"] = copy_us / r["fused_us"] if r.get("fused_us") else None
        r["x_torch"] = r["torch_us"] / r["fused_us"] if r.get("fused_us") else None
        results.append(r)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--tokens", type=int, nargs="*", default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    shapes = SMOKE if cpu else SHAPES
    tokens = tuple(args.tokens) if args.tokens else ((16,) if cpu else TOKENS)
    results = []
    for model, (e, k, h, inter) in shapes.items():
        for t in tokens:
            for case in CASES:
                results += bench(model, e, k, h, inter, t, case, args.device)
                if not cpu:
                    torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print_table(results, COLUMNS)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
