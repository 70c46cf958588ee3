"""One fused combine, launched a few times, for a profiler to read (``ncu``, ``nsys``).

    ncu --clock-control none -k regex:combine_kernel --launch-skip 2 --launch-count 1 \\
        --section ComputeWorkloadAnalysis --section WarpStateStats \\
        python benchmarks/profile_combine.py --fmt nvfp4 --k 6 --hidden 7168 --tokens 8192

Rows are random BF16 (never zeros, as the timed benchmarks use), every slot valid; the
layout check runs unless ``--no-check`` (it compares with the unquantized re-sum, computed
once first). The output is compared bit for bit with ``megamoe.resum`` on the format's torch
reference (``exact``). Prints the median of the launches timed by CUDA events, beside a copy of the
same bytes, so a profiled case can be matched with ``benchmarks/combine_formats.py``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from moewire import formats, kernels
from moewire.megamoe.resum import resum


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fmt", default="nvfp4")
    p.add_argument("--accumulate", default=None, help="default: the format's combine mode")
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--launches", type=int, default=5)
    args = p.parse_args()
    fmt = formats.get(args.fmt)
    mode = args.accumulate or fmt.combine_accumulate
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(args.k, args.tokens, args.hidden, generator=g) * 0.05).bfloat16().cuda()
    idx = torch.randint(0, 256, (args.tokens, args.k), generator=g).cuda()
    amax = rows.float().abs().amax().reshape(1) if fmt.needs_amax else None
    y = None if args.no_check else resum(rows, idx, args.tokens)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty(args.tokens, args.hidden, dtype=torch.bfloat16, device="cuda")
    def quantize(r):
        return fmt.dequantize(r, amax) if mode == "fp32" else fmt.qdq(r, amax, use_kernel=False)

    want = resum(rows, idx, args.tokens, row_quantizer=quantize, accumulate=mode)
    times = []
    for _ in range(args.launches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernels.fused_combine(rows, idx, args.tokens, out, args.fmt, amax, None, y,
                              None if y is None else flag, accumulate=mode)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    nbytes = rows.numel() * 2 + out.numel() * 2 * (1 if y is None else 2) + idx.numel() * 8
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copies = []
    for _ in range(args.launches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        copies.append(start.elapsed_time(end) * 1e3)
    fused, copy = statistics.median(times), statistics.median(copies)
    exact = bool(torch.equal(out.view(torch.int16), want.view(torch.int16)))
    print(f"{args.fmt}/{mode} k={args.k} H={args.hidden} T={args.tokens} "
          f"check={y is not None}: {fused:.1f} us, copy of the same bytes {copy:.1f} us "
          f"({copy / fused:.2f} of copy), flag={int(flag)}, exact={exact}")


if __name__ == "__main__":
    main()
