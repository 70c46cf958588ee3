"""Combine-format benchmark: every format the fused Triton combine runs, in its combine
accumulation mode, with and without the layout check, beside a copy of the same bytes.

For each shape (``benchmarks/_bench.py``'s models at T tokens) and each case (a format, an
accumulation mode, the check on or off), the fused combine (``moewire.kernels.fused_combine``,
as the hooks run it) is timed by replaying a CUDA graph, next to a device copy of the same
minimal bytes: ``k*T*H*2`` rows read + ``T*H*2`` written + ``T*k*8`` of ``topk_idx``, and with
the check ``T*H*2`` more for the kernel's ``y`` it reads. The check runs on the first routed
batch of each buffer (and on every replay of a CUDA graph captured before that batch); a
proven buffer's combine runs without it. Before timing, each case's output is compared bit for
bit with ``megamoe.resum`` in the same mode on the benchmark rows.

Run on an H200: ``python benchmarks/combine_formats.py --out results.json``; ``--device
cpu`` is a smoke run (one small shape, torch definition only; its times mean nothing).

JSON (``--out``): a list, one object per (shape, case), with ``model``, ``T``, ``k``, ``H``,
``fmt``, ``accumulate``, ``check``, ``bytes``, ``copy_us``, ``fused_us`` (median us per
call), ``fused_gbps``, ``frac_copy`` (``copy_us / fused_us``), ``x_nvfp4`` (``fused_us`` over
the NVFP4 combine's on the same shape with the same check setting: at most 1 means at least
as fast), ``exact``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import MODELS, SMOKE_MODELS, copies_for, gbps, print_table, time_graph  # noqa: E402

from moewire import formats, kernels  # noqa: E402
from moewire.megamoe.resum import resum  # noqa: E402

# (format, accumulation mode): every format's own combine mode, and NVFP4's other mode.
CASES = (
    ("nvfp4", "bf16"),
    ("nvfp4", "fp32"),
    ("nvfp4_token", "bf16"),
    ("mxfp4", "bf16"),
    ("trtllm_16e2m1xbf16", "fp32"),
    ("fp8", "bf16"),
    ("fp8_b128_ue8m0", "bf16"),
    ("mxfp8", "bf16"),
    ("deepgemm_fp8_combine", "fp32"),
    ("trtllm_32e4m3xe8m0", "fp32"),
    ("te_mxfp8", "fp32"),
    ("bf16", "bf16"),
    ("trtllm_16e2m1xbf16", "bf16"),
    ("flashinfer_mxfp8", "fp32"),
    ("flashinfer_nvfp4", "fp32"),
    ("mori_fp8_blockwise_fnuz", "fp32"),
    ("mori_fp8_direct_cast_fnuz", "fp32"),
)
TOKENS = (1024, 8192)
# --grid: (block_h, num_warps, unroll) tried for the split-tile formats besides the default.
GRID = ((1024, 2, False), (1024, 2, True), (512, 1, True), (512, 2, False), (256, 1, True))
SPLIT = ("nvfp4", "trtllm_16e2m1xbf16", "flashinfer_nvfp4")
COLUMNS = [
    ("model", "model", ""), ("T", "T", ""), ("k", "k", ""), ("H", "H", ""),
    ("fmt", "format", ""), ("accumulate", "acc", ""), ("check", "check", ""),
    ("tuning", "tuning", ""),
    ("copy_us", "copy us", ".1f"),
    ("fused_us", "fused us", ".1f"), ("fused_gbps", "GB/s", ".0f"),
    ("frac_copy", "of copy", ".2f"), ("x_nvfp4", "x nvfp4", ".2f"), ("exact", "exact", ""),
]


def _inputs(k: int, t: int, h: int, copies: int, device: str):
    g = torch.Generator(device="cpu").manual_seed(k * 131 + t + h)
    rows = [(torch.randn(k, t, h, generator=g) * 0.05).bfloat16().to(device)
            for _ in range(copies)]
    idx = torch.randint(0, 256, (t, k), generator=g).to(device)
    return rows, idx


def bench_shape(name: str, k: int, h: int, t: int, device: str,
                grid: bool = False) -> list[dict]:
    base_bytes = k * t * h * 2 + t * h * 2 + t * k * 8
    check_bytes = base_bytes + t * h * 2  # the check reads the kernel's y
    copies = copies_for(check_bytes, device)
    rows, idx = _inputs(k, t, h, copies, device)
    out = torch.empty((t, h), dtype=torch.bfloat16, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    copy_us = {}
    for check, nbytes in ((True, check_bytes), (False, base_bytes)):
        src = [torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
               for _ in range(copies)]
        dst = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        copy_us[check] = time_graph(lambda i, src=src, dst=dst: dst.copy_(src[i % copies]), 20,
                                    device=device)
    # The layout check compares the unquantized sum: one for every case and tuning.
    y = resum(rows[0], idx, t) if device == "cuda" else None
    results = []
    for fmt_name, mode in CASES:
        fmt = formats.get(fmt_name)
        amax = (rows[0].float().abs().amax().reshape(1) if fmt.needs_amax else None)

        def quantize(r, fmt=fmt, amax=amax, mode=mode):
            return (fmt.dequantize(r, amax) if mode == "fp32"
                    else fmt.qdq(r, amax, use_kernel=False))

        want = resum(rows[0], idx, t, row_quantizer=quantize, accumulate=mode)
        tunings = ((None, None, None),) + (GRID if grid and fmt_name in SPLIT else ())
        for check in (True, False):
            for bh, nw, unroll in tunings:
                tune = {"block_h": bh, "num_warps": nw, "unroll": unroll}
                against = (y, flag) if check else (None, None)
                if device == "cuda":
                    flag.zero_()
                    kernels.fused_combine(rows[0], idx, t, out, fmt_name, amax, None, *against,
                                          accumulate=mode, **tune)
                    exact = bool(torch.equal(out.view(torch.int16), want.view(torch.int16)))
                    exact = exact and int(flag) == 0

                    def call(i, fmt_name=fmt_name, amax=amax, mode=mode, tune=tune,
                             against=against):
                        kernels.fused_combine(rows[i % copies], idx, t, out, fmt_name, amax,
                                              None, *against, accumulate=mode, **tune)

                    fused_us = time_graph(call, 20, device=device)
                else:
                    exact, fused_us = True, None
                nbytes = check_bytes if check else base_bytes
                results.append({
                    "model": name, "T": t, "k": k, "H": h, "fmt": fmt_name,
                    "accumulate": mode, "check": check,
                    "tuning": "default" if bh is None else f"{bh}/{nw}/{'u' if unroll else 'r'}",
                    "bytes": nbytes, "copy_us": copy_us[check], "fused_us": fused_us,
                    "fused_gbps": gbps(nbytes, fused_us),
                    "frac_copy": copy_us[check] / fused_us if fused_us else None,
                    "exact": exact,
                })
    for check in (True, False):
        base = next(r["fused_us"] for r in results if r["fmt"] == "nvfp4" and r["check"] == check
                    and r["accumulate"] == "bf16" and r["tuning"] == "default")
        for r in results:
            if r["check"] == check:
                r["x_nvfp4"] = r["fused_us"] / base if base and r["fused_us"] else None
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--tokens", type=int, nargs="*", default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--grid", action="store_true",
                        help="also time the split-tile formats at each tuning of GRID")
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=None)
    args = parser.parse_args()
    cpu = args.device == "cpu"
    models = SMOKE_MODELS if cpu else {m: MODELS[m] for m in (args.models or MODELS)}
    tokens = tuple(args.tokens) if args.tokens else ((16,) if cpu else TOKENS)
    results = []
    for name, (_, k, h) in models.items():
        for t in tokens:
            results.extend(bench_shape(name, k, h, t, args.device, args.grid))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print_table(results, COLUMNS)


if __name__ == "__main__":
    main()
