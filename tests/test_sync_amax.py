"""WireQuantizer.sync_amax and calibration() over real gloo groups in spawned processes, one
rank without data."""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moewire.quantizer import WireQuantizer, calibration

TIMEOUT_S = 240  # 2 shared CPU cores: spawning 4 torch processes can take a minute
EMPTY_RANK = 1


def _rank_data(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    scale = 1.0 + rank  # each rank a different max, so "max of the others" is checked
    return (torch.randn((6, 64), generator=gen) * scale).to(torch.bfloat16)


def _calibrate(rank: int) -> WireQuantizer:
    q = WireQuantizer("nvfp4")
    q.mode = "calibrate"
    if rank != EMPTY_RANK:
        q(_rank_data(rank))
    q.mode = "quantize"
    return q


def _state(q: WireQuantizer) -> dict:
    return {"amax": float(q.amax), "has_amax": q.has_amax, "source": q.amax_source,
            "seen": bool(q.calib_seen)}


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    result: dict = {"rank": rank}
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=TIMEOUT_S * 3 // 4),
        )
        # Synced while the collected state is still pending, then loaded.
        before = _calibrate(rank)
        pointer = before.amax.data_ptr()
        before.sync_amax()
        result["before_loaded"] = before.load_calib_amax() is not None
        result["before"] = {**_state(before), "same_buffer": before.amax.data_ptr() == pointer}
        # Loaded first (the rank without data warns and keeps no amax), then synced.
        after = _calibrate(rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["after_loaded"] = after.load_calib_amax() is not None
        result["after_warned"] = any("saw no data" in str(w.message) for w in caught)
        after.sync_amax()
        result["after"] = _state(after)
        # The one calibration context: collect, sync, load; the rank without data gets the
        # group's max and no warning.
        driven = WireQuantizer("nvfp4")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with calibration([(driven, (None, dist.group.WORLD))]):
                if rank != EMPTY_RANK:
                    driven(_rank_data(rank))
        result["driven"] = _state(driven)
        result["driven_warned"] = any("saw no data" in str(w.message) for w in caught)
        # A constant amax survives the sync.
        fixed = WireQuantizer("fp8", constant_amax=448.0)
        fixed.sync_amax()
        result["fixed"] = float(fixed.amax)
        # A NaN state on one rank turns into inf everywhere: every rank refuses, none hangs.
        poisoned = _calibrate(rank)
        if rank == 0:
            poisoned.calib_amax.fill_(float("nan"))
        poisoned.sync_amax()
        try:
            poisoned.load_calib_amax()
            result["poisoned"] = "loaded"
        except ValueError as err:
            result["poisoned"] = str(err)
        dist.destroy_process_group()
    except BaseException:  # reported to the parent, which fails the test
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _run(world: int, tmp_path) -> list[dict]:
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker,
                    args=(rank, world, str(tmp_path / "init"), str(tmp_path)))
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    hung = []
    deadline = time.monotonic() + TIMEOUT_S
    for rank, p in enumerate(procs):
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            hung.append(rank)
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} hung (killed after {TIMEOUT_S}s)"
    results = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result (exit code {procs[rank].exitcode})"
        results.append(json.loads(path.read_text()))
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    return results


@pytest.mark.parametrize(
    "world", [2, pytest.param(4, marks=pytest.mark.slow)], ids=["2ranks", "4ranks"]
)
def test_sync_amax_with_a_rank_without_data(world, tmp_path):
    results = _run(world, tmp_path)
    expected = max(
        float(_rank_data(rank).abs().float().max()) for rank in range(world) if rank != EMPTY_RANK
    )
    for r in results:
        for key in ("before", "after", "driven"):
            state = r[key]
            assert state["amax"] == expected, (key, r)
            assert state["has_amax"] and state["source"] == "calibrated", (key, r)
        assert r["before"]["seen"] and r["before"]["same_buffer"], r
        assert r["before_loaded"], r
        assert r["fixed"] == 448.0, r
        assert not r["driven_warned"], r
        assert "held inf" in r["poisoned"], r
        empty = r["rank"] == EMPTY_RANK
        assert r["after_loaded"] == (not empty) and r["after_warned"] == empty, r


def test_sync_amax_is_a_no_op_without_a_group():
    q = WireQuantizer("fp8")
    q.collect(torch.ones(2, 16))
    q.sync_amax()
    assert not q.has_amax and float(q.calib_amax) == 1.0
