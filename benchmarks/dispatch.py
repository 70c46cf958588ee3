"""Dispatch benchmark: fused Triton QDQ of [T, H] tokens vs torch eager, compile, ModelOpt.

Minimal bytes: ``T*H*2`` read + ``T*H*2`` written (BF16 in, BF16 out). The copy peer
moves the same bytes. Run on the H200 (``python benchmarks/dispatch.py --out r.json``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import (  # noqa: E402
    MODELS,
    TOKENS,
    cli,
    copies_for,
    gbps,
    time_graph,
    time_loop,
)
from _peers import compiled_qdq, modelopt_quantizer  # noqa: E402

from moewire import formats, kernels  # noqa: E402

PEER_FORMATS = ("nvfp4", "fp8")
FUSED_ONLY = ("fp8_b32_ue8m0", "fp8_b128", "mxfp8", "mxfp4", "nvfp4_token")

COLUMNS = [
    ("model", "model", ""), ("T", "T", ""), ("H", "H", ""), ("fmt", "fmt", ""),
    ("fused_us", "fused us", ".1f"), ("fused_gbps", "GB/s", ".0f"),
    ("frac_copy", "of copy", ".2f"), ("copy_us", "copy us", ".1f"),
    ("eager_us", "eager us", ".0f"), ("compile_us", "compile us", ".1f"),
    ("modelopt_us", "modelopt us", ".0f"), ("x_eager", "x eager", ".1f"),
    ("x_compile", "x compile", ".1f"), ("x_modelopt", "x modelopt", ".1f"),
    ("exact", "exact", ""),
]


def bench_shape(name, h, t, fmts, peer_fmts=PEER_FORMATS, reps_peer=5):
    dev = "cuda"
    minimal = 2 * t * h * 2
    n = copies_for(minimal)
    gen = torch.Generator(device=dev).manual_seed(t + h)
    x = (torch.randn((n, t, h), device=dev, generator=gen) * 2).to(torch.bfloat16)
    dst = torch.empty_like(x)
    reps = max(8, min(400, int(8e9 / minimal / n) * n))
    copy_us = time_graph(lambda i: dst[i % n].copy_(x[i % n]), reps)
    results = []
    for fmt in fmts:
        amax = x[0].float().abs().amax().reshape(()) if fmt in ("nvfp4", "fp8") else None
        ref = formats.get(fmt)
        r = dict(model=name, T=t, H=h, fmt=fmt, bytes=minimal, copies=n, copy_us=copy_us)
        r["fused_us"] = time_graph(lambda i, fmt=fmt, amax=amax: kernels.qdq(x[i % n], fmt, amax),
                                   reps)
        want = ref.reference(x[0], amax)
        r["exact"] = bool(torch.equal(kernels.qdq(x[0], fmt, amax).view(torch.int16),
                                      want.view(torch.int16)))
        if fmt in peer_fmts:
            r["eager_us"] = time_loop(lambda i, ref=ref, amax=amax: ref.reference(x[i % n], amax),
                                      reps_peer)
            try:
                comp = compiled_qdq(fmt)
                r["compile_exact"] = bool(torch.equal(comp(x[0], amax).view(torch.int16),
                                                      want.view(torch.int16)))
                r["compile_us"] = time_loop(lambda i, comp=comp, amax=amax: comp(x[i % n], amax),
                                            reps_peer)
            except Exception as exc:
                r["compile_error"] = f"{type(exc).__name__}: {exc}"[:300]
            tq, why = modelopt_quantizer(fmt, amax)
            r["modelopt"] = why
            if tq is not None:
                try:
                    with torch.no_grad():
                        r["modelopt_equal_frac"] = float(
                            (tq(x[0]).view(torch.int16) == want.view(torch.int16)).float().mean())
                        r["modelopt_us"] = time_loop(lambda i, tq=tq: tq(x[i % n]), reps_peer)
                except Exception as exc:
                    r["modelopt"] = f"modelopt run failed: {type(exc).__name__}: {exc}"[:300]
        r["fused_gbps"] = gbps(minimal, r["fused_us"])
        r["frac_copy"] = copy_us / r["fused_us"]
        for peer in ("eager", "compile", "modelopt"):
            if r.get(f"{peer}_us"):
                r[f"x_{peer}"] = r[f"{peer}_us"] / r["fused_us"]
        results.append(r)
    return results


def run(tokens=TOKENS, models=tuple(MODELS), peers=True) -> list[dict]:
    """Every (model H, T); peers for nvfp4 and fp8, other formats fused only."""
    results = []
    for name in models:
        h = MODELS[name][2]
        for t in tokens:
            fmts = PEER_FORMATS + (FUSED_ONLY if t == 8192 else ())
            results += bench_shape(name, h, t, fmts, PEER_FORMATS if peers else ())
            torch.cuda.empty_cache()
    return results


def main() -> None:
    cli(__doc__, run, COLUMNS)


if __name__ == "__main__":
    main()
