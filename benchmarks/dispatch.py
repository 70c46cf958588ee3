"""Dispatch benchmark: fused Triton QDQ of [T, H] tokens vs torch eager, compile, ModelOpt.

Minimal bytes: ``T*H*2`` read + ``T*H*2`` written (BF16 in, BF16 out). The copy peer
moves the same bytes. Run on an H200 (``python benchmarks/dispatch.py --out r.json``); the
CPU smoke run (``--device cpu``) checks the peers on one small shape, without the fused
kernel, in seconds.

Peers (``fp8``, ``nvfp4``): ``eager`` is the format's torch reference; ``compile`` is that
reference compiled with static shapes and ``max-autotune-no-cudagraphs``
(``--compile-mode``; Inductor's numerics per ``--compile-numerics``, see ``_peers``);
``modelopt`` is ModelOpt's ``TensorQuantizer``. Before anything is timed, the fused result
and the compiled peer are compared bit for bit with the reference; a mismatch prints a
WARNING.

JSON (``--out``): a list, one object per (shape, format), with the keys

- ``model``, ``T``, ``H``, ``fmt``; ``bytes`` (the minimal bytes), ``copies`` (input
  copies rotated over), ``device``;
- ``copy_us``, ``fused_us``, ``eager_us``, ``compile_us``, ``modelopt_us``: median us per
  call (absent: not run);
- ``fused_gbps`` (minimal bytes / time), ``frac_copy`` ("of copy": ``copy_us /
  fused_us``), ``x_eager``, ``x_compile`` ("fused vs compile"), ``x_modelopt``: peer time /
  ``fused_us``;
- ``exact``: the fused result equals the reference bitwise;
- ``compile_exact``, ``compile_mismatch`` (differing values), ``compile_numerics``
  (``"inductor"`` or ``"eager"``: what the timed peer was compiled with), ``compile_mode``,
  ``compile_inductor_mismatch`` (when ``auto`` fell back), ``compile_error``;
- ``modelopt`` (its version or why it did not run), ``modelopt_equal_frac``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import (  # noqa: E402
    MODELS,
    SMOKE_MODELS,
    TOKENS,
    cli,
    copies_for,
    gbps,
    time_graph,
    time_loop,
)
from _peers import (  # noqa: E402
    default_mode,
    differing,
    modelopt_quantizer,
    qdq_peer,
    time_compiled,
)

from moewire import formats, kernels  # noqa: E402

PEER_FORMATS = ("nvfp4", "fp8")
FUSED_ONLY = ("fp8_b32_ue8m0", "fp8_b128", "mxfp8", "mxfp4", "nvfp4_token")
SHAPES = {**MODELS, **SMOKE_MODELS}

COLUMNS = [
    ("model", "model", ""), ("T", "T", ""), ("H", "H", ""), ("fmt", "fmt", ""),
    ("fused_us", "fused us", ".1f"), ("fused_gbps", "GB/s", ".0f"),
    ("frac_copy", "of copy", ".2f"), ("copy_us", "copy us", ".1f"),
    ("eager_us", "eager us", ".0f"), ("compile_us", "compile us", ".1f"),
    ("modelopt_us", "modelopt us", ".0f"), ("x_eager", "x eager", ".1f"),
    ("x_compile", "fused vs compile", ".2f"), ("x_modelopt", "x modelopt", ".1f"),
    ("exact", "exact", ""), ("compile_exact", "compile exact", ""),
    ("compile_numerics", "numerics", ""),
]


def _peers(r, x, n, fmt, amax, want, reps_peer, device, mode, numerics):
    ref = formats.get(fmt)
    r["eager_us"] = time_loop(lambda i: ref.reference(x[i % n], amax), reps_peer,
                              device=device)
    label = f"dispatch compile peer {fmt} T={r['T']} H={r['H']}"
    time_compiled(
        r, qdq_peer(fmt), mode, numerics, [((x[0], amax), want)], label,
        lambda comp: time_loop(lambda i: comp(x[i % n], amax), reps_peer, device=device),
    )
    tq, why = modelopt_quantizer(fmt, amax)
    r["modelopt"] = why
    if tq is not None:
        try:
            with torch.no_grad():
                r["modelopt_equal_frac"] = float(
                    (tq(x[0]).view(torch.int16) == want.view(torch.int16)).float().mean())
                r["modelopt_us"] = time_loop(lambda i: tq(x[i % n]), reps_peer, device=device)
        except Exception as exc:
            r["modelopt"] = f"modelopt run failed: {type(exc).__name__}: {exc}"[:300]


def bench_shape(name, h, t, fmts, peer_fmts=PEER_FORMATS, reps_peer=5, *, device="cuda",
                compile_mode=None, numerics="auto"):
    """Time every format of ``fmts`` at one shape; the peers for those in ``peer_fmts``.

    On ``device="cpu"`` the fused kernel does not run (its keys are absent)."""
    dev = device
    cuda = dev == "cuda"
    mode = compile_mode or default_mode(dev)
    minimal = 2 * t * h * 2
    n = copies_for(minimal, dev)
    gen = torch.Generator(device=dev).manual_seed(t + h)
    x = (torch.randn((n, t, h), device=dev, generator=gen) * 2).to(torch.bfloat16)
    dst = torch.empty_like(x)
    reps = max(8, min(400, int(8e9 / minimal / n) * n))
    copy_us = time_graph(lambda i: dst[i % n].copy_(x[i % n]), reps, device=dev)
    results = []
    for fmt in fmts:
        amax = x[0].float().abs().amax().reshape(()) if fmt in ("nvfp4", "fp8") else None
        ref = formats.get(fmt)
        r = dict(model=name, T=t, H=h, fmt=fmt, bytes=minimal, copies=n, copy_us=copy_us,
                 device=dev)
        want = ref.reference(x[0], amax)
        if cuda:
            r["fused_us"] = time_graph(
                lambda i, fmt=fmt, amax=amax: kernels.qdq(x[i % n], fmt, amax), reps)
            mismatch = differing(kernels.qdq(x[0], fmt, amax), want)
            r["exact"] = not mismatch
            if mismatch:
                print(f"WARNING dispatch fused {fmt} T={t} H={h}: NOT bit-exact to the "
                      f"reference ({mismatch} differing values)", flush=True)
        if fmt in peer_fmts:
            _peers(r, x, n, fmt, amax, want, reps_peer, dev, mode, numerics)
        fused = r.get("fused_us")
        r["fused_gbps"] = gbps(minimal, fused)
        r["frac_copy"] = copy_us / fused if fused else None
        for peer in ("eager", "compile", "modelopt"):
            if r.get(f"{peer}_us") and fused:
                r[f"x_{peer}"] = r[f"{peer}_us"] / fused
        results.append(r)
    return results


def run(tokens=TOKENS, models=tuple(MODELS), peers=True, *, device="cuda", compile_mode=None,
        numerics="auto") -> list[dict]:
    """Every (model H, T); peers for nvfp4 and fp8, other formats fused only."""
    results = []
    for name in (m for m in models if m in SHAPES):  # "target" is a combine shape
        h = SHAPES[name][2]
        for t in tokens:
            fmts = PEER_FORMATS + (FUSED_ONLY if t == 8192 else ())
            results += bench_shape(name, h, t, fmts, PEER_FORMATS if peers else (),
                                   device=device, compile_mode=compile_mode,
                                   numerics=numerics)
            if device == "cuda":
                torch.cuda.empty_cache()
    return results


def main() -> None:
    cli(__doc__, run, COLUMNS)


if __name__ == "__main__":
    main()
