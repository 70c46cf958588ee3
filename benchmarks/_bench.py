"""Timing and reporting helpers shared by the combine and dispatch benchmarks.

Every time is a median per call in microseconds. Kernels that the caller would capture
in a CUDA graph (the fused kernels, the copy) are timed by replaying a graph of ``reps``
calls; the torch peers (eager, compiled, ModelOpt) by a loop of ``reps`` calls between
two CUDA events. Inputs rotate over enough copies that one pass touches at least
:data:`ROTATE_BYTES` (several times the H200's 60 MB L2), so no peer is timed from cache.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROTATE_BYTES = 256 * 2**20

# The models' config.json (experts, top-k, hidden); "target" is the 8192 x 8 x 7168 combine
# the kernels were tuned for.
MODELS = {
    "V4-Flash": (256, 6, 4096),
    "V4-Pro": (384, 6, 7168),
    "Kimi-K3": (896, 16, 3584),
}
TARGET = ("target", 8, 7168)
TOKENS = (128, 1024, 8192)
# The CPU smoke run (``--device cpu``): one small shape that checks the peers and the
# table, in seconds; its times mean nothing.
SMOKE_MODELS = {"smoke": (16, 4, 256)}
SMOKE_TOKENS = (16,)


def copies_for(nbytes: int, device: str = "cuda") -> int:
    """How many input copies one rotation needs to exceed the L2 (at least 1, at most 64);
    1 on CPU (the smoke run)."""
    if device != "cuda":
        return 1
    return max(1, min(64, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def time_graph(
    fn: Callable[[int], object], reps: int, trials: int = 7, device: str = "cuda"
) -> float:
    """Median us per call of ``fn(i)``, captured ``reps`` times in one CUDA graph (on CPU:
    :func:`time_loop`)."""
    if device != "cuda":
        return time_loop(fn, reps, trials, device)
    fn(0)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = _events()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    del graph
    return statistics.median(times)


def time_loop(
    fn: Callable[[int], object], reps: int, trials: int = 5, device: str = "cuda"
) -> float:
    """Median us per call of ``fn(i)`` over loops of ``reps`` calls (after one warm-up),
    between CUDA events (on CPU: the wall clock)."""
    if device != "cuda":
        fn(0)
        times = []
        for _ in range(trials):
            start = time.perf_counter()
            for i in range(reps):
                fn(i)
            times.append((time.perf_counter() - start) * 1e6 / reps)
        return statistics.median(times)
    fn(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = _events()
        start.record()
        for i in range(reps):
            fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def gbps(nbytes: int, us: float | None) -> float | None:
    return None if not us else nbytes / us / 1e3


def fmt_cell(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """Print ``rows`` as a fixed-width table; ``columns`` = (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([
            fmt_cell(r.get(k), s) if s else str(r.get(k, "-")) for k, _, s in columns
        ])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for line in cells:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))


def cli(doc: str, run: Callable[..., list[dict]], columns: list[tuple[str, str, str]]) -> None:
    """The command line of a sweep; prints the table.

    ``--out`` (JSON), ``--tokens``, ``--no-peers``, ``--models`` (:data:`MODELS` names and
    ``"target"``), ``--device`` (``cpu``: the smoke run on
    :data:`SMOKE_MODELS`, peers only), ``--compile-mode`` (default: ``_peers.default_mode``
    of the device) and ``--compile-numerics`` (``_peers.NUMERICS``).
    """
    from _peers import NUMERICS, default_mode

    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--tokens", type=int, nargs="*", default=None,
                        help=f"default {TOKENS} on CUDA, {SMOKE_TOKENS} on CPU")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--models", nargs="+", choices=(*MODELS, TARGET[0]), default=None,
                        help=f"default: all, and {TARGET[0]!r} (combine only, at T=8192)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run of the peers on one small shape")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile mode of the compile peer (default: "
                             "max-autotune-no-cudagraphs on CUDA, default on CPU)")
    parser.add_argument("--compile-numerics", choices=NUMERICS, default="auto",
                        help="Inductor numerics of the compile peer (see benchmarks/_peers.py)")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    tokens = tuple(args.tokens) if args.tokens else (SMOKE_TOKENS if cpu else TOKENS)
    models = args.models or ((*MODELS, TARGET[0]) if not cpu else tuple(SMOKE_MODELS))
    results = run(tokens, models=tuple(models),
                  peers=not args.no_peers, device=args.device,
                  compile_mode=args.compile_mode or default_mode(args.device),
                  numerics=args.compile_numerics)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print_table(results, columns)
