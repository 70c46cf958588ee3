"""Combine benchmark: fused Triton combine vs torch eager, torch.compile, ModelOpt, copy.

Minimal bytes of one combine: ``k*T*H*2`` (rows read once) + ``T*H*2`` (``y`` written)
+ ``T*k*8`` (``topk_idx``). The copy peer moves the same number of bytes (reads half,
writes half). Run on an H200 (``python benchmarks/combine.py --out results.json``); the
CPU smoke run (``--device cpu``) checks the peers on one small shape, without the fused
kernel, in seconds.

Peers (``fp8``, ``nvfp4``): ``eager`` is ``megamoe.resum`` with the format's torch
reference as row quantizer; ``compile`` is the same QDQ + re-sum as one plain-torch
function (``_peers.peer_combine``: select, never multiply; slots in ascending order)
compiled with static shapes and ``max-autotune-no-cudagraphs`` (``--compile-mode``;
Inductor's numerics per ``--compile-numerics``, see ``_peers``); ``modelopt`` is
ModelOpt's ``TensorQuantizer`` followed by the torch re-sum. Before anything is timed, the
fused result and the compiled peer are compared bit for bit with ``resum`` on two inputs
of the timed shapes: the benchmark rows (every slot valid) and the same rows with every
fifth (token, slot) invalid and its row NaN (a stale row). A mismatch prints a WARNING.

JSON (``--out``): a list, one object per (shape, format), with the keys

- ``model``, ``T``, ``k``, ``H``, ``fmt``; ``bytes`` (the minimal bytes), ``copies``
  (input copies rotated over), ``device``;
- ``copy_us``, ``fused_check_us`` (fused with the layout check: the headline time),
  ``fused_us`` (without it), ``check_flag_after`` (0: the check never fired),
  ``eager_us``, ``compile_us``, ``modelopt_us``: median us per call (absent: not run);
- ``fused_gbps``, ``copy_gbps`` (minimal bytes / time), ``frac_copy`` ("of copy":
  ``copy_us / fused_check_us``), ``x_eager``, ``x_compile`` ("fused vs compile"),
  ``x_modelopt``: peer time / ``fused_check_us``;
- ``exact``: the fused result equals ``resum`` bitwise on both check inputs;
- ``compile_exact``, ``compile_mismatch`` (differing values per check input),
  ``compile_numerics`` (``"inductor"`` or ``"eager"``: what the timed peer was compiled
  with), ``compile_mode``, ``compile_inductor_mismatch`` (when ``auto`` fell back),
  ``compile_error`` (the peer failed to compile or run);
- ``modelopt`` (its version or why it did not run), ``modelopt_equal_frac`` (share of
  outputs equal to ``resum``'s).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import (  # noqa: E402
    MODELS,
    SMOKE_MODELS,
    TARGET,
    TOKENS,
    cli,
    copies_for,
    gbps,
    time_graph,
    time_loop,
)
from _peers import (  # noqa: E402
    combine_peer,
    default_mode,
    differing,
    modelopt_quantizer,
    reference_quant,
    stale_nan_case,
    time_compiled,
)

from moewire import kernels  # noqa: E402
from moewire.megamoe.resum import resum  # noqa: E402

PEER_FORMATS = ("nvfp4", "fp8")
FUSED_ONLY = ("bf16", "fp8_b128", "fp8_b32_ue8m0", "mxfp8", "mxfp4", "nvfp4_token")
SHAPES = {**MODELS, **SMOKE_MODELS}

COLUMNS = [
    ("model", "model", ""), ("T", "T", ""), ("k", "k", ""), ("H", "H", ""), ("fmt", "fmt", ""),
    ("fused_check_us", "fused+chk us", ".1f"), ("fused_gbps", "GB/s", ".0f"),
    ("frac_copy", "of copy", ".2f"), ("fused_us", "fused us", ".1f"),
    ("copy_us", "copy us", ".1f"), ("eager_us", "eager us", ".0f"),
    ("compile_us", "compile us", ".0f"), ("modelopt_us", "modelopt us", ".0f"),
    ("x_eager", "x eager", ".1f"), ("x_compile", "fused vs compile", ".2f"),
    ("x_modelopt", "x modelopt", ".1f"), ("exact", "exact", ""),
    ("compile_exact", "compile exact", ""), ("compile_numerics", "numerics", ""),
]


def _shapes(tokens, models):
    """(name, k, H, T) of every model in ``models`` at every T; ``"target"`` at T=8192 only."""
    for name in models:
        if name == TARGET[0]:
            if 8192 in tokens:
                yield TARGET[0], TARGET[1], TARGET[2], 8192
            continue
        _, k, h = SHAPES[name]
        for t in tokens:
            yield name, k, h, t


def _peers(r, rows, idx, t, n, fmt, amax, out, checks, want, reps_peer, device, mode,
           numerics):
    quant = reference_quant(fmt, amax)
    r["eager_us"] = time_loop(
        lambda i: resum(rows[i % n], idx, t, row_quantizer=quant, out=out[i % n]),
        reps_peer, device=device)
    label = f"combine compile peer {fmt} k={r['k']} T={t} H={r['H']}"
    time_compiled(
        r, combine_peer(fmt), mode, numerics,
        [((c_rows, c_idx, amax), c_want) for (c_rows, c_idx), c_want in checks], label,
        lambda comp: time_loop(lambda i: comp(rows[i % n], idx, amax), reps_peer, device=device),
    )
    tq, why = modelopt_quantizer(fmt, amax)
    r["modelopt"] = why
    if tq is not None:
        try:
            with torch.no_grad():
                mo = resum(rows[0], idx, t, row_quantizer=tq)
                r["modelopt_equal_frac"] = float(
                    (mo.view(torch.int16) == want.view(torch.int16)).float().mean())
                r["modelopt_us"] = time_loop(
                    lambda i: resum(rows[i % n], idx, t, row_quantizer=tq, out=out[i % n]),
                    reps_peer, device=device)
        except Exception as exc:
            r["modelopt"] = f"modelopt run failed: {type(exc).__name__}: {exc}"[:300]


def bench_shape(name, k, h, t, fmts, peer_fmts=PEER_FORMATS, reps_peer=3, *, device="cuda",
                compile_mode=None, numerics="auto"):
    """Time every format of ``fmts`` at one shape; the peers for those in ``peer_fmts``.

    On ``device="cpu"`` the fused kernel does not run (its keys are absent)."""
    dev = device
    cuda = dev == "cuda"
    mode = compile_mode or default_mode(dev)
    minimal = k * t * h * 2 + t * h * 2 + t * k * 8
    n = copies_for(minimal, dev)
    gen = torch.Generator(device=dev).manual_seed(t * 7 + h)
    rows = (torch.randn((n, k, t, h), device=dev, generator=gen) * 0.05).to(torch.bfloat16)
    idx = torch.randint(0, SHAPES.get(name, (256,))[0], (t, k), device=dev, generator=gen)
    stale = stale_nan_case(rows[0], idx)
    out = torch.empty((n, t, h), dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(out)
    if cuda:
        for i in range(n):
            kernels.fused_combine(rows[i], idx, t, y[i], "bf16", None, None)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    src = torch.empty((n, minimal // 4), dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    reps = max(4, min(200, int(4e9 / minimal / max(1, n)) * n))
    copy_us = time_graph(lambda i: dst[i % n].copy_(src[i % n]), reps, device=dev)
    results = []
    for fmt in fmts:
        amax = rows[0].float().abs().amax().reshape(()) if fmt in ("nvfp4", "fp8") else None
        r = dict(model=name, T=t, k=k, H=h, fmt=fmt, bytes=minimal, copies=n, copy_us=copy_us,
                 device=dev)
        quant = reference_quant(fmt, amax)
        checks = [(rows[0], idx), stale]
        wants = [resum(c_rows, c_idx, t, row_quantizer=quant) for c_rows, c_idx in checks]
        if cuda:
            r["fused_check_us"] = time_graph(
                lambda i, amax=amax, fmt=fmt: kernels.fused_combine(
                    rows[i % n], idx, t, out[i % n], fmt, amax, None, y[i % n], flag), reps)
            r["check_flag_after"] = int(flag)
            r["fused_us"] = time_graph(
                lambda i, amax=amax, fmt=fmt: kernels.fused_combine(
                    rows[i % n], idx, t, out[i % n], fmt, amax, None), reps)
            kernels.fused_combine(rows[0], idx, t, out[0], fmt, amax, None)
            got_stale = torch.empty_like(out[0])
            kernels.fused_combine(*stale, t, got_stale, fmt, amax, None)
            fused_mismatch = [differing(out[0], wants[0]), differing(got_stale, wants[1])]
            r["exact"] = not any(fused_mismatch)
            if not r["exact"]:
                print(f"WARNING combine fused {fmt} k={k} T={t} H={h}: NOT bit-exact to resum "
                      f"({fused_mismatch} differing values per check input)", flush=True)
        if fmt in peer_fmts:
            _peers(r, rows, idx, t, n, fmt, amax, out, list(zip(checks, wants, strict=True)),
                   wants[0], reps_peer, dev, mode, numerics)
        fused = r.get("fused_check_us")
        r["fused_gbps"] = gbps(minimal, fused)
        r["copy_gbps"] = gbps(minimal, copy_us)
        r["frac_copy"] = copy_us / fused if fused else None
        for peer in ("eager", "compile", "modelopt"):
            if r.get(f"{peer}_us") and fused:
                r[f"x_{peer}"] = r[f"{peer}_us"] / fused
        results.append(r)
    return results


def run(tokens=TOKENS, models=(*MODELS, TARGET[0]), peers=True, all_formats=True, *,
        device="cuda", compile_mode=None, numerics="auto") -> list[dict]:
    """Every shape; peers for nvfp4 and fp8, the other formats fused only at T=8192."""
    results = []
    for name, k, h, t in _shapes(tokens, models):
        fmts = PEER_FORMATS + (FUSED_ONLY if all_formats and t == 8192 else ())
        results += bench_shape(name, k, h, t, fmts, PEER_FORMATS if peers else (),
                               device=device, compile_mode=compile_mode, numerics=numerics)
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def main() -> None:
    cli(__doc__, run, COLUMNS)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
