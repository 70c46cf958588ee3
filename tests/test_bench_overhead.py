"""The real-kernel overhead benchmark's accounting (benchmarks/real_kernel_overhead.py).

The benchmark itself needs a Hopper GPU and DeepGEMM's SM90 kernel; what it concludes rests
on three pure pieces checked here: every mode is timed once per trial in a rotating order
(the old sequential timing read the GPU's clock drift as moewire's cost), moewire's launches
leave the Mega-MoE kernel's own run-to-run change out, and the copy floor counts the bytes
each side must touch.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "real_kernel_overhead.py"
sys.path.insert(0, str(_PATH.parent))
_SPEC = importlib.util.spec_from_file_location("real_kernel_overhead", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_modes_cover_the_dispatch_table_and_every_combine_pair():
    modes = bench.modes()
    assert modes[0] == (bench.PLAIN, None, None)
    assert {(d, c) for _, d, c in modes[1:]} == (
        {(d, None) for d in bench.DISPATCHES} | {("fp8", c) for c in bench.COMBINES}
    )


def test_interleaved_times_every_mode_once_per_trial_in_a_rotating_order(monkeypatch):
    order: list[str] = []
    monkeypatch.setattr(bench, "_time", lambda graph, reps: order.append(graph) or 1.0)
    names = ["a", "b", "c"]
    times = bench.interleaved({n: n for n in names}, reps=4, trials=3)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert times == {n: [1.0, 1.0, 1.0] for n in names}


def test_added_launches_leave_the_mega_moe_kernel_out():
    profiles = {
        bench.PLAIN: {"void deep_gemm::sm90_fp8_mega_moe_impl<384u>": 1500.0, "memcpy": 2.0},
        "fp8 + nvfp4": {"void deep_gemm::sm90_fp8_mega_moe_impl<384u>": 1530.0,
                        "memcpy": 3.5, "combine_kernel": 5.0, "qdq_kernel": 1.8},
    }
    assert bench._added(profiles, "fp8 + nvfp4") == pytest.approx(
        {"memcpy": 1.5, "combine_kernel": 5.0, "qdq_kernel": 1.8})


@pytest.mark.parametrize(
    ("dispatch", "combine", "want"),
    [("fp8", None, 2 * 2), (None, "nvfp4", (6 + 1) * 2), ("fp8", "fp8", 4 + 14)],
    ids=["dispatch", "combine", "both"],
)
def test_moved_bytes_count_each_side_once(dispatch, combine, want):
    tokens, hidden = 3, bench.SHAPE["hidden"]
    assert bench.moved_bytes(tokens, dispatch, combine) == want * tokens * hidden
