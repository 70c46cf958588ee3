"""Two edges of ``moewire eval`` that the ordinary runs never reach: ``--seq-len`` exactly at
the model's ``max_position_embeddings`` (accepted) and one past it (refused), and a NaN in the
metrics buffer under several ranks (NaN on every rank agrees; NaN on some ranks and a number
on the others disagrees)."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import pytest
import torch

from moewire.eval.checks import EvalError, preflight

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 120
POSITIONS = 256


def _checkpoint(tmp_path: Path) -> Path:
    """A checkpoint directory with a qwen3_moe config.json (``max_position_embeddings``
    256) and an empty weights file: enough for every check, never loaded."""
    path = tmp_path / "ckpt"
    path.mkdir()
    cfg = {"model_type": "qwen3_moe", "num_experts": 8, "hidden_size": 128,
           "vocab_size": 256, "num_hidden_layers": 2, "max_position_embeddings": POSITIONS}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").write_bytes(b"")
    return path


def _preflight(path: Path, seq_len: int):
    return preflight(path, [("fp8", "nvfp4")], recipes=(), per_layer=None, max_tokens=1024,
                     seq_len=seq_len, kernel="stand-in", mma_type=None, device="cpu",
                     budget=None)


def test_seq_len_at_max_position_embeddings_is_accepted_and_one_more_refused(tmp_path):
    """The boundary itself: a window of exactly ``max_position_embeddings`` tokens is one the
    model was built for; one token more is refused, naming the limit. Breaks: ``>=`` (the
    boundary refused) or ``> positions + 1`` (one past it accepted)."""
    path = _checkpoint(tmp_path)
    assert _preflight(path, POSITIONS).number("max_position_embeddings") == POSITIONS
    with pytest.raises(EvalError) as refused:
        _preflight(path, POSITIONS + 1)
    assert str(refused.value).startswith(
        f"--seq-len: {POSITIONS + 1} tokens per window is more than the model's "
        f"max_position_embeddings {POSITIONS}; use --seq-len {POSITIONS} or less")


def _nan_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    try:
        import torch.distributed as dist

        from moewire.eval.metrics import Totals

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        found = {}
        # Run 0: NaN on every rank (agrees); run 1: NaN on one rank only, a number elsewhere
        # (disagrees); run 2: the same numbers everywhere (agrees). The NaN rank is put first
        # and last in turn: a MAX or MIN reduction may keep either operand of a NaN.
        for nan_rank in range(world):
            totals = Totals(3, ["layers.0"], 4, torch.device("cpu"))
            totals.buffer[:] = torch.arange(totals.buffer.numel(), dtype=torch.float64).view(
                totals.buffer.shape)
            totals.buffer[0, 0] = float("nan")
            if rank == nan_rank:
                totals.buffer[1, 1] = float("nan")
            found[str(nan_rank)] = totals.differing_runs()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.mark.parametrize("world", [2, 3], ids=["2-ranks", "3-ranks"])
def test_a_nan_on_every_rank_agrees_and_on_some_ranks_differs(world, tmp_path):
    """Every rank reports only run 1 as differing, whichever rank holds its NaN. Breaks:
    comparing with ``==`` alone (run 0's NaN everywhere reported as differing); taking a NaN
    beside a number as agreement."""
    sys.path.insert(0, str(HERE.parent))
    from spawn_ranks import run_ranks

    results = run_ranks(_nan_worker, world, tmp_path, TIMEOUT_S)
    assert results == [{str(r): [1] for r in range(world)}] * world
