"""moewire's cost on a real fused kernel: DeepGEMM's SM90 Mega-MoE (PR #323) on a Hopper GPU.

For each kernel (``fp8_mega_moe``, ``fp8_fp4_mega_moe``) at DeepSeek-V4-Flash's routed
layer (256 experts on one GPU, top-6, H 4096, I 2048) and each token count, it captures one
CUDA graph of ``reps`` forwards per mode: the experts module alone (``none (kernel)``), with
a dispatch quantizer only (the dispatch table: ``fp8`` / ``nvfp4`` / ``mxfp8 dispatch``),
and with moewire's FP8 dispatch and a combine quantizer in bf16 / fp8 / nvfp4 / mxfp8
(constant amaxes, the layout check passed eagerly first).

How it measures (the old version timed each mode once, one after the other, and read a
drift of the GPU's clock as moewire's cost): every trial replays every mode's graph once,
in an order that rotates from trial to trial, so each mode is timed beside the plain kernel
under the same clock; ``added %`` is the median over trials of ``mode / plain - 1`` taken
within a trial, and ``spread %`` is the plain kernel's own spread over the trials (max/min
- 1), the noise floor the added cost must be read against.

Per-launch profile (``--profile``): one replay of each graph under ``torch.profiler``, the
device time of each kernel name per forward; the kernels a mode adds over the plain forward
are moewire's launches, and their sum (``moewire us``) is moewire's own device time, set
against the copy time of the bytes moewire must touch (``copy us``: dispatch reads and
writes ``T x H`` BF16; the combine reads ``k x T x H`` rows and writes ``T x H``): one
device-to-device copy of that many bytes, captured and replayed like the forwards in the
same run, so both carry a launch's cost.

    python benchmarks/real_kernel_overhead.py --out overhead.json --profile profile.json
    (deep_gemm on PYTHONPATH: bash .real-kernel/run.sh benchmarks/real_kernel_overhead.py ...)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import zlib
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _bench import print_table  # noqa: E402

import moewire  # noqa: E402
from moewire import formats  # noqa: E402
from moewire.integrations import deepgemm_sm90 as sm90  # noqa: E402

SHAPE = dict(experts=256, top_k=6, hidden=4096, inter=2048)  # V4-Flash (config.json)
TOKENS = (128, 1024, 4096, 8192)
DISPATCHES = ("fp8", "nvfp4", "mxfp8")
COMBINES = ("bf16", "fp8", "nvfp4", "mxfp8")
PLAIN = "none (kernel)"
PROFILED_REPLAYS = 3
COLUMNS = [
    ("kernel", "kernel", ""), ("tokens", "T", ""), ("mode", "moewire", ""),
    ("graph_us", "graph us", ".1f"), ("added_pct", "added %", ".2f"),
    ("spread_pct", "plain spread %", ".1f"), ("moewire_us", "moewire us", ".1f"),
    ("copy_us", "copy us", ".1f"), ("of_copy", "x copy", ".2f"),
    ("sequential_added_pct", "old way added %", ".1f"),
]


def _group():
    import torch.distributed as dist

    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1,
                            rank=0, device_id=torch.device("cuda:0"))
    return dist.new_group([0])


def _gen(tag: str) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(zlib.crc32(tag.encode()))


def _weights(kernel: str):
    g = _gen("weights")
    e, h, i = SHAPE["experts"], SHAPE["hidden"], SHAPE["inter"]
    bf16 = dict(generator=g, device="cuda", dtype=torch.bfloat16)
    l1 = torch.randn(e, 2 * i, h, **bf16).mul_(h**-0.5)
    l2 = torch.randn(e, h, i, **bf16).mul_(i**-0.5)
    return sm90.quantize_weights(l1, l2, kernel)


def _batch(tokens: int):
    g = _gen(f"batch{tokens}")
    x = torch.randn(tokens, SHAPE["hidden"], generator=g, device="cuda").bfloat16()
    w, ids = torch.randn(tokens, SHAPE["experts"], generator=g, device="cuda").topk(
        SHAPE["top_k"], dim=-1)
    return x, w.softmax(-1), ids


def _cfg(fmt: str, amax: float) -> dict:
    cfg = {"format": fmt}
    if formats.get(fmt).needs_amax:
        cfg["constant_amax"] = amax
    return cfg


def _recipe(dispatch: str, combine: str | None, x_amax: float, row_amax: float) -> dict:
    quant_cfg = [{"quantizer_name": "*dispatch_quantizer", "cfg": _cfg(dispatch, x_amax)}]
    if combine is None:
        quant_cfg.append({"quantizer_name": "*combine_quantizer", "cfg": {"enable": False}})
    else:
        quant_cfg.append({"quantizer_name": "*combine_quantizer",
                          "cfg": _cfg(combine, row_amax)})
    return {"quant_cfg": quant_cfg}


def modes() -> list[tuple[str, str | None, str | None]]:
    """(label, dispatch format, combine format) of every measured mode, the plain first."""
    out: list[tuple[str, str | None, str | None]] = [(PLAIN, None, None)]
    out += [(f"{d} dispatch", d, None) for d in DISPATCHES]
    out += [(f"fp8 + {c}", "fp8", c) for c in COMBINES]
    return out


def moved_bytes(tokens: int, dispatch: str | None, combine: str | None) -> int:
    """The fewest bytes moewire's work touches per forward (BF16 rows, read once)."""
    k, h = SHAPE["top_k"], SHAPE["hidden"]
    nbytes = 0
    if dispatch is not None:
        nbytes += 2 * tokens * h * 2  # read the tokens, write the fake-quantized copy
    if combine is not None:
        nbytes += (k + 1) * tokens * h * 2  # read k rows per token, write y
    return nbytes


def _capture(fn, reps: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _time(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def interleaved(graphs: dict[str, torch.cuda.CUDAGraph], reps: int, trials: int
                ) -> dict[str, list[float]]:
    """us per forward of each graph, ``trials`` times, every graph once per trial in an
    order that rotates by one each trial (no mode always runs first or after another)."""
    names = list(graphs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for trial in range(trials):
        shift = trial % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(_time(graphs[name], reps))
    return times


def sequential(graphs: dict[str, torch.cuda.CUDAGraph], reps: int, trials: int
               ) -> dict[str, float]:
    """The old method, kept to show what it measured: each mode's ``trials`` replays back to
    back, one mode after the other; median us per forward."""
    return {name: statistics.median(_time(g, reps) for _ in range(trials))
            for name, g in graphs.items()}


def _device_us(event) -> float:
    for attr in ("device_time_total", "cuda_time_total", "self_device_time_total"):
        value = getattr(event, attr, None)
        if value:
            return float(value)
    return 0.0


def profile(graph: torch.cuda.CUDAGraph, reps: int) -> dict[str, float]:
    """Device us per forward of each kernel name in one replay of ``graph``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    per_name: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        us = _device_us(event)
        if us and getattr(event, "device_type", None) != torch.autograd.DeviceType.CPU:
            per_name[event.key] += us / (reps * PROFILED_REPLAYS)
    return dict(per_name)


def copy_us(nbytes: int, reps: int, trials: int) -> float:
    """Median us of one device-to-device copy that reads ``nbytes / 2`` and writes as many,
    captured ``reps`` times in a graph as the forwards are (launch cost included, as it is
    in moewire's own launches)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    graph = _capture(lambda: dst.copy_(src), reps)
    return statistics.median(_time(graph, reps) for _ in range(trials))


def is_mega_moe(name: str) -> bool:
    """The fused kernel under test (its time is the plain forward's, not moewire's)."""
    return "mega_moe" in name


def _added(profiles: dict[str, dict[str, float]], mode: str) -> dict[str, float]:
    """moewire's launches in a mode: device us per forward that each kernel name adds over
    the plain forward, the Mega-MoE kernel itself left out (its run-to-run change is in
    ``added %``, not a launch of moewire's)."""
    base = profiles[PLAIN]
    return {name: us - base.get(name, 0.0) for name, us in profiles[mode].items()
            if not is_mega_moe(name) and us - base.get(name, 0.0) > 0.05}


def run(kernels: tuple[str, ...], tokens: tuple[int, ...], reps: int, trials: int, group,
        out: Path | None, profile_out: Path | None, meta: dict, old_way: bool = False
        ) -> list[dict]:
    rows: list[dict] = []
    profiles_all: list[dict] = []
    for kernel in kernels:
        w1, w2 = _weights(kernel)
        for t in tokens:
            buf = sm90.deep_gemm.get_symm_buffer_for_sm90_mega_moe(
                group, SHAPE["experts"], t, SHAPE["top_k"], SHAPE["hidden"], SHAPE["inter"])
            x, w, ids = _batch(t)
            plain = sm90.SM90MegaMoEExperts(w1, w2, buf, kernel)
            graphs: dict[str, torch.cuda.CUDAGraph] = {}
            with torch.no_grad():
                plain(x, w, ids)
                k, tmax, h = SHAPE["top_k"], buf.num_max_tokens_per_rank, SHAPE["hidden"]
                region = buf.buffer[buf.buffer.numel() - k * tmax * h * 2:]
                row_amax = float(region.view(torch.bfloat16).view(k, tmax, h)[:, :t]
                                 .float().abs().max())
                x_amax = float(x.float().abs().max())
                spec = {label: (d, c) for label, d, c in modes()}
                modules = {PLAIN: plain}
                for label, d, c in modes()[1:]:
                    m = sm90.SM90MegaMoEExperts(w1, w2, buf, kernel)
                    modules[label] = moewire.quantize(m, _recipe(d, c, x_amax, row_amax))
                for label, m in modules.items():
                    m(x, w, ids)  # JIT, and the eager layout check
                    graphs[label] = _capture(lambda m=m, a=(x, w, ids): m(*a), reps)
                times = interleaved(graphs, reps, trials)
                old = sequential(graphs, reps, trials) if old_way else {}
                profiles = {label: profile(g, reps) for label, g in graphs.items()} \
                    if profile_out else {}
            base = times[PLAIN]
            copies: dict[int, float] = {}
            spread = 100 * (max(base) / min(base) - 1)
            for label in graphs:
                d, c = spec[label]
                ratios = [m / b - 1 for m, b in zip(times[label], base, strict=True)]
                added = _added(profiles, label) if profiles else {}
                moewire_us = sum(added.values()) if profiles else None
                nbytes = moved_bytes(t, d, c)
                if nbytes and nbytes not in copies:  # the combine pairs share one byte count
                    copies[nbytes] = copy_us(nbytes, reps, trials)
                copy = copies.get(nbytes)
                row = dict(
                    kernel=kernel, tokens=t, mode=label, dispatch=d, combine=c,
                    graph_us=statistics.median(times[label]),
                    added_pct=100 * statistics.median(ratios), spread_pct=spread,
                    trials=times[label], moewire_us=moewire_us, copy_us=copy,
                    of_copy=(moewire_us / copy) if moewire_us and copy else None,
                    sequential_added_pct=(100 * (old[label] / old[PLAIN] - 1)) if old else None,
                )
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "trials"}), flush=True)
                if profiles:
                    profiles_all.append(dict(kernel=kernel, tokens=t, mode=label,
                                             kernels_us=profiles[label], added_us=added))
            if out:  # after every cell: a run stopped early keeps what it measured
                out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            if profile_out:
                profile_out.write_text(json.dumps({"meta": meta, "profiles": profiles_all},
                                                  indent=1))
            del graphs, plain, modules
            buf.destroy()
            del buf
            torch.cuda.empty_cache()
    return rows


def print_profiles(profiles: list[dict], tokens: int) -> None:
    """The launches each mode adds at ``tokens`` (us per forward), and the kernel's own."""
    for entry in profiles:
        if entry["tokens"] != tokens:
            continue
        kernels = entry["kernels_us"]
        mega = sum(us for name, us in kernels.items() if is_mega_moe(name))
        added = ", ".join(f"{name[:60]} {us:.1f}" for name, us in sorted(
            entry["added_us"].items(), key=lambda kv: -kv[1]))
        print(f"{entry['kernel']:>16} T={tokens} {entry['mode']:>15}: mega-moe kernel "
              f"{mega:.1f} us; adds: {added or '-'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write the per-launch profile of every graph as JSON")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--kernels", nargs="*", default=list(sm90.KERNELS),
                        choices=list(sm90.KERNELS))
    parser.add_argument("--reps", type=int, default=10, help="forwards per graph")
    parser.add_argument("--trials", type=int, default=15, help="interleaved replays per mode")
    parser.add_argument("--sequential", action="store_true",
                        help="also time the old way (modes one after the other) for comparison")
    args = parser.parse_args()
    ok, why = sm90.available()
    if not ok:
        sys.exit(f"real_kernel_overhead: the real SM90 kernel cannot run here: {why}")
    group = _group()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                deep_gemm=getattr(sm90.deep_gemm, "__version__", "?"), shape=SHAPE,
                reps=args.reps, trials=args.trials, commit=os.environ.get("MOEWIRE_COMMIT", "?"))
    rows = run(tuple(args.kernels), tuple(args.tokens), args.reps, args.trials, group,
               args.out, args.profile, meta, old_way=args.sequential)
    if args.profile and args.profile.exists():
        print("\n== moewire's launches per forward (us), beside the Mega-MoE kernel's ==")
        for t in args.tokens:
            print_profiles(json.loads(args.profile.read_text())["profiles"], t)
    print()
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
