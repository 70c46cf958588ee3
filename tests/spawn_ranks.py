"""Run a gloo worker in one spawned process per rank and collect what each rank wrote:
JSON (:func:`run_ranks`) or tensors saved with ``torch.save`` (:func:`run_torch_ranks`)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as torch_mp


def run_ranks(
    worker: Callable[[int, int, str, str], None], world: int, out_dir: Path, timeout_s: float
) -> list[dict]:
    """Spawn ``worker(rank, world, init_file, out_dir)`` for every rank and wait.

    Each rank writes ``rank{r}.json`` on success or ``rank{r}.err`` (its traceback). Fails
    with the hung ranks' pids (killed after ``timeout_s``), the ranks' errors or a non-zero
    exit code; returns the ranks' JSON results in rank order.
    """
    ctx = mp.get_context("spawn")
    init_file = out_dir / "init"
    procs = [
        ctx.Process(target=worker, args=(r, world, str(init_file), str(out_dir)))
        for r in range(world)
    ]
    # One thread per rank: several ranks share the machine's few cores.
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
    finally:
        hung = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    errors = [e.read_text() for e in sorted(out_dir.glob("rank*.err"))]
    assert not hung, f"ranks hung (killed after {timeout_s}s): {hung}\n" + "\n".join(errors)
    assert not errors, "\n".join(errors)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def run_torch_ranks(
    worker: Callable[[int, int, str, str], None], world: int, out_dir: Path, timeout_s: float
) -> list:
    """Spawn ``worker(rank, world, init_file, out_dir)`` with torch's process starter (a
    rank's exception is raised here with its traceback) and return what each rank saved
    with ``torch.save`` to ``rank{r}.pt``, in rank order.

    Fails the test, after killing the ranks still alive, when they have not all finished
    within ``timeout_s``.
    """
    context = torch_mp.start_processes(
        worker, args=(world, str(out_dir / "init"), str(out_dir)), nprocs=world, join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{world}-rank gloo run did not finish within {timeout_s} s")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
