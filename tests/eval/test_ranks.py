"""``moewire eval`` across ranks: ``torchrun --nproc-per-node 2 -m moewire eval`` (real
torchrun, gloo on the CPU, a timeout) on a tiny Qwen3-MoE against a one-rank run of the same
command, and the refusals of a distributed launch, each before the model loads.

With the dense layers whole on every rank (``--no-tensor-parallel``) the two ranks give the
one-rank numbers bit for bit: expert parallelism (``MegaMoeEP``, the amaxes reduced over the
EP group) changes no sum. With the model's tensor-parallel plan, attention's row-parallel
output projection adds two partial BF16 sums, which moves the logits by BF16 roundings and
the calibrated amaxes with them: the bounds below are the ones docs/eval.md states from
measurements on three families. Only rank 0 writes (an audit hook records every file each
rank opens for writing, ``rank_main.py``) and prints the table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers.distributed.expert_parallel")
pytest.importorskip("accelerate")  # transformers' distributed loading needs it

import torch  # noqa: E402
from eval_helpers import TEXT, torchrun_eval  # noqa: E402

from moewire.cli import main  # noqa: E402
from moewire.eval import EvalError, evaluate, plan, runner  # noqa: E402
from moewire.outputs import MANIFEST  # noqa: E402

TIMEOUT_S = 300
ARGS = ["--pairs", "fp8:nvfp4", "--max-tokens", "64", "--seq-len", "32"]
METRICS = ("perplexity", "kl_mean", "kl_p99", "top1_agreement")


def _torchrun(checkpoint: Path, tmp: Path, *extra: str,
              device: str = "cpu") -> tuple[dict, list[list[str]], str]:
    """Two ranks of ``rank_main.py eval`` under torchrun (:func:`eval_helpers.torchrun_eval`)."""
    return torchrun_eval(checkpoint, tmp, 2, [*ARGS, "--device", device, *extra], TIMEOUT_S)


def _one_rank(checkpoint: Path, device: str = "cpu") -> dict:
    return evaluate(checkpoint, [("fp8", "nvfp4")], text=TEXT, max_tokens=64, seq_len=32,
                    device=device, log=lambda s: None)


def _check_files(written: list[list[str]], stdout: str, tmp: Path) -> None:
    """Rank 0 wrote the results and the plot, rank 1 nothing; the table is printed once."""
    assert written[1] == [], written[1]
    # Each file is written to a temporary ".<name>.<random>.tmp" and renamed into place.
    names = {Path(p).name for p in written[0]}
    assert {n[1:].rsplit(".", 2)[0] if n.endswith(".tmp") else n
            for n in names} >= {"results.json", "kl.png"}
    assert sorted(p.name for p in (tmp / "out").iterdir()) == [MANIFEST, "kl.png",
                                                              "results.json"]
    assert stdout.count("run ") == 1 and stdout.count("wrote ") == 1, stdout


@pytest.mark.slow
def test_two_ranks_with_whole_dense_layers_equal_one_rank_bit_for_bit(checkpoint, tmp_path):
    path = checkpoint("qwen3_moe")
    two, written, stdout = _torchrun(path, tmp_path, "--no-tensor-parallel")
    one = _one_rank(path)
    assert two["ranks"] == 2 and two["tensor_parallel"] is False and one["ranks"] == 1
    base, pair = two["pairs"]
    assert base["kl_mean"] == 0.0 and base["kl_p99"] == 0.0 and base["top1_agreement"] == 1.0
    assert pair["kl_mean"] > 0.0
    for got, want in zip(two["pairs"], one["pairs"], strict=True):
        assert {k: got[k] for k in (*METRICS, "layer_rel_l2", "name")} == {
            k: want[k] for k in (*METRICS, "layer_rel_l2", "name")}
    _check_files(written, stdout, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_with_whole_dense_layers_equal_one_gpu_bit_for_bit(checkpoint, tmp_path):
    """The same on two GPUs (NCCL, cuda:LOCAL_RANK) against one GPU."""
    path = checkpoint("qwen3_moe")
    two, written, stdout = _torchrun(path, tmp_path, "--no-tensor-parallel", device="cuda")
    one = _one_rank(path, "cuda")
    assert two["device"] == "cuda:0" and two["ranks"] == 2
    for got, want in zip(two["pairs"], one["pairs"], strict=True):
        assert {k: got[k] for k in (*METRICS, "layer_rel_l2")} == {
            k: want[k] for k in (*METRICS, "layer_rel_l2")}
    _check_files(written, stdout, tmp_path)


@pytest.mark.slow
def test_two_ranks_with_tensor_parallelism_are_within_the_stated_bounds(checkpoint, tmp_path):
    """The bounds of docs/eval.md ("Across ranks"): the baseline exact against itself, its
    perplexity within 0.2% of one rank's, a pair's perplexity within 1% and its mean KL
    within a factor 1.3 (the roundings move every calibrated scale of a quantized run)."""
    path = checkpoint("qwen3_moe")
    two, written, stdout = _torchrun(path, tmp_path)
    one = _one_rank(path)
    assert two["tensor_parallel"] is True
    (base, pair), (base1, pair1) = two["pairs"], one["pairs"]
    assert base["kl_mean"] == 0.0 and base["kl_p99"] == 0.0 and base["top1_agreement"] == 1.0
    assert set(base["layer_rel_l2"].values()) == {0.0}
    assert base["perplexity"] == pytest.approx(base1["perplexity"], rel=2e-3)
    # Not bit for bit: tensor parallelism moved the numbers.
    assert base["perplexity"] != base1["perplexity"]
    assert pair["perplexity"] == pytest.approx(pair1["perplexity"], rel=1e-2)
    assert 1 / 1.3 <= pair["kl_mean"] / pair1["kl_mean"] <= 1.3
    _check_files(written, stdout, tmp_path)


# -- refusals of a distributed launch, before any process group or model -------------------


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded (or the ranks joined) before the refusal")

    monkeypatch.setattr(runner, "_load", refuse)
    monkeypatch.setattr(plan, "_join", refuse)


def _launch(world: int = 2, rank: int = 0, local_world: int | None = None, **more: str):
    env = {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world if local_world is None else local_world)}
    return env | more


def _gpus(count: int):
    def patch(monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return patch


# (torchrun's variables, argv after the checkpoint, a monkeypatch, the message's start)
REFUSALS = {
    "world-does-not-divide-experts": (
        _launch(3), [], None,
        "--nproc-per-node: 3 ranks do not divide the model's 8 routed experts"),
    "device-index": (_launch(), ["--device", "cuda:1"], None,
                     "--device: 'cuda:1' under torchrun"),
    "cpu-on-a-cuda-machine": (_launch(), ["--device", "cpu"], _gpus(2),
                              "--device: cpu under torchrun on a machine with CUDA"),
    "fewer-gpus-than-local-ranks": (
        _launch(4, local_world=4), ["--device", "cuda"], _gpus(2),
        "--device: torchrun starts 4 ranks on this node and torch sees 2 CUDA device(s)"),
    "ep-size-flag": ({}, ["--ep-size", "4"], None,
                     "--ep-size: moewire eval runs the model on the ranks torchrun starts"),
    "no-tensor-parallel-on-one-rank": ({}, ["--no-tensor-parallel"], None,
                                       "--no-tensor-parallel: one rank has no tensor"),
    "torchrun-variables-broken": (_launch(RANK="x"), [], None,
                                  "torchrun: RANK='x' is not an integer"),
}


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_a_distributed_mistake_is_one_line_before_the_ranks_join(case, checkpoint, tmp_path,
                                                                no_model, monkeypatch, capsys):
    env, argv, patch, message = REFUSALS[case]
    # Written before the patches: a faked CUDA device count would reach torch's fork_rng.
    path = checkpoint("mixtral")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if patch is not None:
        patch(monkeypatch)
    capsys.readouterr()
    code = main(["eval", str(path), "--device", "cpu", "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("moewire eval: error: " + message), err
    assert not (tmp_path / "out").exists()


def test_only_rank_0_prints_a_refusal(checkpoint, tmp_path, no_model, monkeypatch, capsys):
    """Every rank refuses alike (the same arguments and files); rank 0 says it once."""
    for name, value in _launch(3, rank=1).items():
        monkeypatch.setenv(name, value)
    path = checkpoint("mixtral")  # built (its progress bars printed) before the capture
    capsys.readouterr()
    code = main(["eval", str(path), "--device", "cpu", "--out", str(tmp_path / "out")])
    assert code == 2 and capsys.readouterr().err == ""


def test_the_time_models_ep_size_is_not_the_ranks(checkpoint, no_model):
    """The Python API's time-model EP size is ``time_ep_size``; ``ep_size`` is no keyword."""
    with pytest.raises(TypeError, match="ep_size"):
        evaluate(checkpoint("mixtral"), ep_size=2, device="cpu", log=lambda s: None)
    with pytest.raises(EvalError, match="--no-tensor-parallel"):
        evaluate(checkpoint("mixtral"), tensor_parallel=False, device="cpu",
                 log=lambda s: None)
