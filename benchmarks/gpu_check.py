"""One device call: kernel tests, a launch-config sweep, the combine and dispatch tables.

Usage on an H200 (what ``benchmarks/results/README.md`` records)::

    PYTHONPATH=src:. python3 benchmarks/gpu_check.py --out "$OUT"

Writes ``pytest.log``, ``sweep.json``, ``combine.json`` and ``dispatch.json`` under
``--out`` and prints the short tables last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import combine  # noqa: E402
import dispatch  # noqa: E402
from _bench import TARGET, print_table, time_graph  # noqa: E402
from _peers import CUDA_COMPILE_MODE, NUMERICS  # noqa: E402

from moewire import kernels  # noqa: E402

SWEEP = ((512, 4, False), (1024, 4, False), (512, 4, True), (1024, 4, True), (2048, 8, False))


def run_tests(out: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/kernels",
         "-p", "no:cacheprovider"],
        capture_output=True, text=True,
    )
    (out / "pytest.log").write_text(proc.stdout + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    failed = [ln for ln in lines if ln.startswith("FAILED")]
    return "\n".join(failed[:15] + lines[-1:])


def sweep(fmts=("nvfp4", "mxfp4", "fp8_b32_ue8m0", "fp8")) -> list[dict]:
    """Fused combine (with check) at the target shape for each (block_h, num_warps)."""
    _, k, h = TARGET
    t = 8192
    rows = (torch.randn((k, t, h), device="cuda") * 0.05).to(torch.bfloat16)
    idx = torch.randint(0, 256, (t, k), device="cuda")
    out = torch.empty((t, h), dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(out)
    kernels.fused_combine(rows, idx, t, y, "bf16", None, None)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    minimal = k * t * h * 2 + t * h * 2 + t * k * 8
    results = []
    for fmt in fmts:
        amax = rows.float().abs().amax().reshape(()) if fmt in ("nvfp4", "fp8") else None
        for bh, nw, un in SWEEP:
            def call(i, fmt=fmt, amax=amax, bh=bh, nw=nw, un=un):
                return kernels.fused_combine(rows, idx, t, out, fmt, amax, None, y, flag,
                                             block_h=bh, num_warps=nw, unroll=un)

            us = time_graph(call, 5)
            results.append(dict(fmt=fmt, block_h=bh, num_warps=nw, unroll=un, us=us,
                                gbps=minimal / us / 1e3, flag=int(flag)))
    return results


def _stage(label, fn, *args, **kwargs):
    """Run one stage; a failure is printed and recorded, and the next stage still runs."""
    t0 = time.time()
    try:
        result = fn(*args, **kwargs)
    except Exception:
        traceback.print_exc()
        result = [dict(stage=label, error=traceback.format_exc(limit=3)[-600:])]
    print(f"{label}: {time.time() - t0:.1f}s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--no-peers", action="store_true", help="time the fused kernels only")
    parser.add_argument("--tokens", type=int, nargs="*", default=[128, 1024, 8192])
    parser.add_argument("--compile-mode", default=CUDA_COMPILE_MODE,
                        help="torch.compile mode of the compile peers")
    parser.add_argument("--compile-numerics", choices=NUMERICS, default="auto",
                        help="Inductor numerics of the compile peers (benchmarks/_peers.py)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    print(f"torch {torch.__version__} triton {triton.__version__} "
          f"{torch.cuda.get_device_name()}", flush=True)
    tests = "skipped" if args.skip_tests else run_tests(args.out)
    print("tests:", tests, flush=True)
    sw = _stage("sweep", sweep)
    (args.out / "sweep.json").write_text(json.dumps(sw, indent=1))
    peers = () if args.no_peers else dispatch.PEER_FORMATS
    compile_args = dict(compile_mode=args.compile_mode, numerics=args.compile_numerics)
    disp = []
    for name in dispatch.MODELS:
        for t in args.tokens:
            fmts = dispatch.PEER_FORMATS + (dispatch.FUSED_ONLY if t == 8192 else ())
            h = dispatch.MODELS[name][2]
            disp += _stage(f"dispatch {name} T={t}", dispatch.bench_shape, name, h, t, fmts, peers,
                           **compile_args)
            (args.out / "dispatch.json").write_text(json.dumps(disp, indent=1))
            torch.cuda.empty_cache()
    comb = []
    for name, k, h, t in combine._shapes(tuple(args.tokens), (*combine.MODELS, TARGET[0])):
        fmts = combine.PEER_FORMATS + (combine.FUSED_ONLY if t == 8192 else ())
        comb += _stage(f"combine {name} T={t}", combine.bench_shape, name, k, h, t, fmts,
                       tuple(combine.PEER_FORMATS) if not args.no_peers else (), **compile_args)
        (args.out / "combine.json").write_text(json.dumps(comb, indent=1))
        torch.cuda.empty_cache()
    mo = {r.get("modelopt") for r in comb + disp if r.get("modelopt")}
    print("modelopt:", "; ".join(sorted(mo)))
    print_table(sw, [("fmt", "fmt", ""), ("block_h", "block_h", ""), ("num_warps", "warps", ""),
                     ("unroll", "unroll", ""), ("us", "us", ".1f"), ("gbps", "GB/s", ".0f"),
                     ("flag", "flag", "")])
    print_table(disp, dispatch.COLUMNS)
    print_table(comb, combine.COLUMNS)
    print("tests:", tests)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
