"""``moewire.integrations.transformers.save_scales`` over 2 gloo ranks (spawned processes, a
timeout): an amax held on one rank and missing on the other is a disagreement every rank
refuses, naming the quantizer; any failure of rank 0's writer, a refusal or any other error,
reaches every rank as an error with the same cause, and no rank returns the path of a file
that does not exist.

The ranks quantize a small stand-in experts module of their own (no process group in its
buffer), so each rank's amax is what its own calibration found.
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from pathlib import Path

import pytest

pytest.importorskip("transformers.integrations.moe")

from spawn_ranks import run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 180
# Short, so that a rank left waiting in the broadcast fails within the test's timeout.
GROUP_TIMEOUT_S = 30
RECIPE = {"quant_cfg": [{"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "fp8"}},
                        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "fp8"}}]}


def _outcome(call) -> dict:
    try:
        return {"returned": str(call())}
    except Exception as exc:  # the test compares what every rank raised
        return {"raised": type(exc).__name__, "message": str(exc)}


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    try:
        _run(rank, world, init_file, Path(out_dir))
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _run(rank: int, world: int, init_file: str, out: Path) -> None:
    sys.path.insert(0, str(HERE.parent / "megamoe"))
    import torch
    import torch.distributed as dist
    from mm_helpers import SHAPES, batch, make_experts

    import moewire
    from moewire.integrations.transformers import scales

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    hidden = SHAPES["bf16xbf16"][0]
    result = {}

    def calibrated():
        experts = make_experts(seed=3)
        moewire.quantize(experts, RECIPE, forward_loop=lambda m: m(*batch(20, hidden, seed=90)))
        return experts

    # An amax on rank 0 only: rank 1 quantized but never calibrated (its amaxes are missing).
    experts = calibrated() if rank == 0 else moewire.quantize(make_experts(seed=3), RECIPE)
    result["missing"] = _outcome(lambda: scales.save_scales(experts, out / "missing.json"))
    moewire.unquantize(experts)

    experts = calibrated()
    # Rank 0's writer refuses: the directory does not exist (a ValueError).
    result["refused"] = _outcome(
        lambda: scales.save_scales(experts, out / "no-such-dir" / "scales.json"))
    # Rank 0's writer breaks in another way (a RuntimeError): the last case, since a rank 0
    # that leaves before the broadcast leaves the group unusable.
    if rank == 0:
        def broken(model, path):
            raise RuntimeError("the writer broke on purpose")

        scales.api.save_scales = broken
    result["broken"] = _outcome(lambda: scales.save_scales(experts, out / "broken.json"))
    (out / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("save_scales_ranks")
    return run_ranks(_worker, 2, out, TIMEOUT_S), out


def test_an_amax_missing_on_one_rank_is_refused_on_every_rank(results):
    """An amax that exists on rank 0 and is missing on rank 1 (NaN in the all-gather) is a
    disagreement: both ranks raise, naming the quantizers, and nothing is written. Break:
    count a NaN on some ranks as agreement (only NaN on every rank is)."""
    ranks, out = results
    for r in ranks:
        got = r["missing"]
        assert got.get("raised") == "RuntimeError", got
        assert "differs between ranks" in got["message"], got
        assert "dispatch_quantizer" in got["message"] and "combine_quantizer" in got["message"]
    assert not (out / "missing.json").exists()


@pytest.mark.parametrize(("case", "cause"), [
    ("refused", "ValueError: save_scales"),
    ("broken", "RuntimeError: the writer broke on purpose"),
], ids=["writer-refuses", "writer-raises-another-error"])
def test_a_failure_of_rank_0_is_every_ranks_with_its_cause(results, case, cause):
    """Rank 0 raises its own error; rank 1 raises a RuntimeError that names rank 0's cause;
    no rank returns a path, and no file exists. Breaks: rank 0 catching only ValueError and
    OSError (rank 1 then waits in the broadcast until the group times out, and fails with
    gloo's error, not the cause); rank 1 returning the path when rank 0 failed."""
    ranks, out = results
    zero, one = ranks[0][case], ranks[1][case]
    assert "returned" not in zero and "returned" not in one, (zero, one)
    assert f"{zero['raised']}: {zero['message']}".startswith(cause), zero
    assert one["raised"] == "RuntimeError", one
    assert one["message"].startswith("save_scales: rank 0 could not write"), one
    assert cause in one["message"], one
    assert not list(out.glob("**/broken.json")) and not (out / "no-such-dir").exists()
