"""Run a gloo worker in one spawned process per rank and collect what each rank wrote."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections.abc import Callable
from pathlib import Path


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
