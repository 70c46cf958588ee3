"""Combine benchmark: fused Triton combine vs torch eager, torch.compile, ModelOpt, copy.

Minimal bytes of one combine: ``k*T*H*2`` (rows read once) + ``T*H*2`` (``y`` written)
+ ``T*k*8`` (``topk_idx``). The copy peer moves the same number of bytes (reads half,
writes half). Run on the H200 (``python benchmarks/combine.py --out results.json``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import (  # noqa: E402
    MODELS,
    TARGET,
    TOKENS,
    cli,
    copies_for,
    gbps,
    time_graph,
    time_loop,
)
from _peers import (  # noqa: E402
    compiled_resum,
    modelopt_quantizer,
    reference_quant,
)

from moewire import kernels  # noqa: E402
from moewire.megamoe.resum import resum  # noqa: E402

PEER_FORMATS = ("nvfp4", "fp8")
FUSED_ONLY = ("bf16", "fp8_b128", "fp8_b32_ue8m0", "mxfp8", "mxfp4", "nvfp4_token")

COLUMNS = [
    ("model", "model", ""), ("T", "T", ""), ("k", "k", ""), ("H", "H", ""), ("fmt", "fmt", ""),
    ("fused_check_us", "fused+chk us", ".1f"), ("fused_gbps", "GB/s", ".0f"),
    ("frac_copy", "of copy", ".2f"), ("fused_us", "fused us", ".1f"),
    ("copy_us", "copy us", ".1f"), ("eager_us", "eager us", ".0f"),
    ("compile_us", "compile us", ".0f"), ("modelopt_us", "modelopt us", ".0f"),
    ("x_eager", "x eager", ".1f"), ("x_compile", "x compile", ".1f"),
    ("x_modelopt", "x modelopt", ".1f"), ("exact", "exact", ""),
]


def _shapes(tokens, models):
    for name in models:
        _, k, h = MODELS[name]
        for t in tokens:
            yield name, k, h, t
    if 8192 in tokens:
        yield TARGET[0], TARGET[1], TARGET[2], 8192


def bench_shape(name, k, h, t, fmts, peer_fmts=PEER_FORMATS, reps_peer=3):
    dev = "cuda"
    minimal = k * t * h * 2 + t * h * 2 + t * k * 8
    n = copies_for(minimal)
    gen = torch.Generator(device=dev).manual_seed(t * 7 + h)
    rows = (torch.randn((n, k, t, h), device=dev, generator=gen) * 0.05).to(torch.bfloat16)
    idx = torch.randint(0, MODELS.get(name, (256,))[0], (t, k), device=dev, generator=gen)
    out = torch.empty((n, t, h), dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(out)
    for i in range(n):
        kernels.fused_combine(rows[i], idx, t, y[i], "bf16", None, None)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    src = torch.empty((n, minimal // 4), dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    reps = max(4, min(200, int(4e9 / minimal / max(1, n)) * n))
    copy_us = time_graph(lambda i: dst[i % n].copy_(src[i % n]), reps)
    results = []
    for fmt in fmts:
        amax = rows[0].float().abs().amax().reshape(()) if fmt in ("nvfp4", "fp8") else None
        r = dict(model=name, T=t, k=k, H=h, fmt=fmt, bytes=minimal, copies=n, copy_us=copy_us)
        r["fused_check_us"] = time_graph(
            lambda i, amax=amax, fmt=fmt: kernels.fused_combine(
                rows[i % n], idx, t, out[i % n], fmt, amax, None, y[i % n], flag), reps)
        r["check_flag_after"] = int(flag)
        r["fused_us"] = time_graph(
            lambda i, amax=amax, fmt=fmt: kernels.fused_combine(
                rows[i % n], idx, t, out[i % n], fmt, amax, None), reps)
        quant = reference_quant(fmt, amax)
        want = resum(rows[0], idx, t, row_quantizer=quant)
        kernels.fused_combine(rows[0], idx, t, out[0], fmt, amax, None)
        r["exact"] = bool(torch.equal(out[0].view(torch.int16), want.view(torch.int16)))
        if fmt in peer_fmts:
            r["eager_us"] = time_loop(
                lambda i, quant=quant: resum(rows[i % n], idx, t, row_quantizer=quant,
                                             out=out[i % n]), reps_peer)
            try:
                comp = compiled_resum(fmt)
                got = comp(rows[0], idx, amax)
                r["compile_exact"] = bool(torch.equal(got.view(torch.int16),
                                                      want.view(torch.int16)))
                r["compile_us"] = time_loop(
                    lambda i, amax=amax, comp=comp: comp(rows[i % n], idx, amax), reps_peer)
            except Exception as exc:
                r["compile_error"] = f"{type(exc).__name__}: {exc}"[:300]
            tq, why = modelopt_quantizer(fmt, amax)
            r["modelopt"] = why
            if tq is not None:
                try:
                    with torch.no_grad():
                        mo = resum(rows[0], idx, t, row_quantizer=tq)
                        r["modelopt_equal_frac"] = float(
                            (mo.view(torch.int16) == want.view(torch.int16)).float().mean())
                        r["modelopt_us"] = time_loop(
                            lambda i, tq=tq: resum(rows[i % n], idx, t, row_quantizer=tq,
                                                   out=out[i % n]), reps_peer)
                except Exception as exc:
                    r["modelopt"] = f"modelopt run failed: {type(exc).__name__}: {exc}"[:300]
        fused = r["fused_check_us"]
        r["fused_gbps"] = gbps(minimal, fused)
        r["copy_gbps"] = gbps(minimal, copy_us)
        r["frac_copy"] = copy_us / fused
        for peer in ("eager", "compile", "modelopt"):
            if r.get(f"{peer}_us"):
                r[f"x_{peer}"] = r[f"{peer}_us"] / fused
        results.append(r)
    return results


def run(tokens=TOKENS, models=tuple(MODELS), peers=True, all_formats=True) -> list[dict]:
    """Every shape; peers for nvfp4 and fp8, the other formats fused only at T=8192."""
    results = []
    for name, k, h, t in _shapes(tokens, models):
        fmts = PEER_FORMATS + (FUSED_ONLY if all_formats and t == 8192 else ())
        results += bench_shape(name, k, h, t, fmts, PEER_FORMATS if peers else ())
        torch.cuda.empty_cache()
    return results


def main() -> None:
    cli(__doc__, run, COLUMNS)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
