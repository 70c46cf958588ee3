"""``moewire eval`` on eight ranks: ``torchrun --nproc-per-node 8 -m moewire eval`` (real
torchrun, gloo on the CPU, a timeout) on a tiny DeepSeek-V4 whose 8 routed experts are spread
one per rank by expert parallelism (``MegaMoeEP`` over all 8 ranks), one pair, against a
one-rank run of the same command.

With the dense layers whole on every rank (``--no-tensor-parallel``) the eight ranks give the
one-rank numbers bit for bit: each rank's kernel call takes its slice of the shared batch,
the tokens' rows go to the rank of their expert and come back, and every token's rows are
re-summed in slot order on its own rank, as on one rank; the amaxes are reduced over the EP
group. Only rank 0 writes (``rank_main.py``'s audit hook) and prints the table.

Kept cheap for 2 cores running 8 ranks: one layer, 32 tokens in windows of 16.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers.distributed.expert_parallel")
pytest.importorskip("accelerate")  # transformers' distributed loading needs it

from eval_helpers import TEXT, save_byte_tokenizer, torchrun_eval, write_task  # noqa: E402

from moewire.eval import evaluate  # noqa: E402

RANKS = 8
TIMEOUT_S = 300
ARGS = ["--pairs", "fp8:nvfp4", "--max-tokens", "32", "--seq-len", "16", "--device", "cpu",
        "--no-tensor-parallel"]
COMPARED = ("name", "perplexity", "kl_mean", "kl_p99", "top1_agreement", "layer_rel_l2")


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory) -> Path:
    """The tiny BF16 DeepSeek-V4 (8 routed experts, top-2, one layer) with a byte tokenizer."""
    import _tiny

    root = tmp_path_factory.mktemp("v4-eight")
    _, bf16 = _tiny.deepseek_v4_checkpoints(root)
    assert _tiny.V4["experts"] % RANKS == 0
    save_byte_tokenizer(bf16)
    return bf16


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network, and the datasets cache of this test only (also for the ranks)."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


def _torchrun(checkpoint: Path, tmp: Path, *extra: str) -> tuple[dict, list[list[str]], str]:
    """Eight ranks of ``rank_main.py eval`` (:func:`eval_helpers.torchrun_eval`)."""
    return torchrun_eval(checkpoint, tmp, RANKS, [*ARGS, *extra], TIMEOUT_S)


def _check(eight: dict, one: dict, written: list[list[str]], stdout: str,
           out: Path) -> None:
    assert eight["ranks"] == RANKS and eight["tensor_parallel"] is False
    assert one["ranks"] == 1
    base, pair = eight["pairs"]
    assert base["kl_mean"] == 0.0 and base["top1_agreement"] == 1.0
    assert pair["kl_mean"] > 0.0
    for got, want in zip(eight["pairs"], one["pairs"], strict=True):
        assert {k: got[k] for k in COMPARED} == {k: want[k] for k in COMPARED}
    assert all(w == [] for w in written[1:]), written[1:]
    assert written[0] and {"results.json", "kl.png"} <= {p.name for p in out.iterdir()}
    assert stdout.count("wrote ") == 1, stdout


@pytest.mark.slow
def test_eight_ranks_task_accuracy_equals_one_rank(deepseek_v4, tmp_path, offline):
    """Eight ranks with ``--tasks`` on a local multiple-choice task: the metrics equal one
    rank's bit for bit, every rank runs lm-eval's requests in step (the model's EP
    collectives), and the accuracy and its stderr are the one-rank run's."""
    task = write_task(tmp_path / "tasks")
    eight, written, stdout = _torchrun(deepseek_v4, tmp_path, "--tasks", task, "--tasks-path",
                                       str(tmp_path / "tasks"))
    one = evaluate(deepseek_v4, [("fp8", "nvfp4")], text=TEXT, max_tokens=32, seq_len=16,
                   device="cpu", tasks=[task], tasks_path=tmp_path / "tasks",
                   log=lambda s: None)
    _check(eight, one, written, stdout, tmp_path / "out")
    assert [p["tasks"] for p in eight["pairs"]] == [p["tasks"] for p in one["pairs"]]
    assert all(p["tasks"][task]["acc"]["stderr"] is not None for p in eight["pairs"])
