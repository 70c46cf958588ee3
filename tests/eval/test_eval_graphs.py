"""``moewire eval`` under CUDA graphs: every run's forward captured once and replayed for
every window gives the eager run's metrics bit for bit (the stand-in and the real SM90
kernel, a shorter last window, the mixed recipe's repeated captures); a forward that cannot
be captured is refused with the fix; a replay that differs from the eager forward on the
first window drops the graphs; on CPU the flag changes nothing; graphs are the default."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers.integrations.moe")

import _tiny  # noqa: E402
import torch  # noqa: E402
from eval_helpers import TEXT  # noqa: E402

from moewire.eval import EvalConfig, evaluate, metrics  # noqa: E402

#: The metrics a run reports, every one compared exactly.
METRICS = ("perplexity", "kl_mean", "kl_p99", "top1_agreement", "layer_rel_l2")


def _metrics(report: dict) -> list[dict]:
    return [{k: run[k] for k in ("name", *METRICS)} for run in report["pairs"]]


def _both(path, config: EvalConfig) -> tuple[dict, dict]:
    eager = evaluate(path, dataclasses.replace(config, cuda_graph=False), log=lambda s: None)
    graphed = evaluate(path, dataclasses.replace(config, cuda_graph=True), log=lambda s: None)
    return eager, graphed


def test_on_cpu_the_flag_changes_nothing(checkpoint):
    config = EvalConfig(pairs=[("fp8", "nvfp4")], text=TEXT, max_tokens=64, seq_len=32,
                        device="cpu")
    eager, graphed = _both(checkpoint("qwen3_moe"), config)
    assert graphed["cuda_graph"]["used"] is False
    assert _metrics(graphed) == _metrics(eager)
    assert eager["pairs"][1]["kl_mean"] > 0.0


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("max_tokens", [128, 100], ids=["full-windows", "short-last-window"])
def test_graphed_equals_eager_bit_for_bit_on_the_stand_in(checkpoint, max_tokens):
    config = EvalConfig(pairs=[("fp8", "fp8"), ("fp8", "nvfp4"), ("nvfp4", "nvfp4")],
                        text=TEXT, max_tokens=max_tokens, seq_len=32, device="cuda")
    eager, graphed = _both(checkpoint("qwen3_moe"), config)
    assert eager["cuda_graph"]["used"] is False and graphed["cuda_graph"]["used"] is True
    assert graphed["cuda_graph"]["pool_bytes"] > 0
    assert _metrics(graphed) == _metrics(eager)
    assert [r["kl_mean"] > 0.0 for r in eager["pairs"]] == [False, True, True, True]
    assert eager["pairs"][1]["kl_mean"] != eager["pairs"][2]["kl_mean"]  # each its own graph


@pytest.mark.gpu
@needs_cuda
def test_graphed_equals_eager_through_the_mixed_recipe(checkpoint):
    config = EvalConfig(pairs=[("fp8", "fp8")], text=TEXT, max_tokens=96, seq_len=32,
                        device="cuda", per_layer=("nvfp4", "nvfp4"), budget=1.0)
    eager, graphed = _both(checkpoint("qwen3_moe"), config)
    assert _metrics(graphed) == _metrics(eager)
    assert graphed["per_layer"] == eager["per_layer"]
    assert any(r["name"].startswith("mixed") for r in graphed["pairs"])


@pytest.mark.gpu
@pytest.mark.real_kernel
@needs_cuda
def test_graphed_equals_eager_bit_for_bit_on_the_real_sm90_kernel(tmp_path_factory):
    from moewire.integrations import deepgemm_sm90

    ok, why = deepgemm_sm90.available()
    if not ok:
        pytest.skip(f"real SM90 Mega-MoE kernel unavailable: {why}")
    path = _tiny.checkpoint("qwen3_moe", tmp_path_factory.mktemp("sm90"), hidden=512,
                            intermediate=256)
    config = EvalConfig(pairs=[("fp8", "nvfp4")], text=TEXT, max_tokens=128, seq_len=32,
                        device="cuda", kernel="deepgemm-sm90")
    eager, graphed = _both(path, config)
    assert graphed["cuda_graph"]["used"] is True
    assert _metrics(graphed) == _metrics(eager)
    assert eager["pairs"][1]["kl_mean"] > 0.0


@pytest.mark.gpu
@needs_cuda
def test_a_forward_that_cannot_be_captured_is_refused_with_the_fix(checkpoint, monkeypatch):
    real = metrics.Totals.add_layer

    def syncing_add_layer(self, run, layer, y, y0):
        float(y.sum())  # a host sync: not allowed while a graph is being captured
        return real(self, run, layer, y, y0)

    monkeypatch.setattr(metrics.Totals, "add_layer", syncing_add_layer)
    with pytest.raises(RuntimeError, match=r"the forward of run fp8:nvfp4 cannot be captured "
                       r"in a CUDA graph .*--no-cuda-graph"):
        evaluate(checkpoint("qwen3_moe"), [("fp8", "nvfp4")], text=TEXT, max_tokens=64,
                 seq_len=32, device="cuda", cuda_graph=True, log=lambda s: None)
    # Eagerly the same forward runs.
    report = evaluate(checkpoint("qwen3_moe"), [("fp8", "nvfp4")], text=TEXT, max_tokens=64,
                      seq_len=32, device="cuda", cuda_graph=False, log=lambda s: None)
    assert report["pairs"][1]["kl_mean"] > 0.0


@pytest.mark.gpu
@needs_cuda
def test_a_replay_that_differs_from_the_eager_forward_drops_the_graphs(checkpoint,
                                                                      monkeypatch):
    """Break: keep the graphs (or keep the first window's sums) after the first window's
    check fails: the report would say graphs were used, or the sums would count window 0
    twice and differ from the eager run."""
    from moewire.eval import graphs

    monkeypatch.setattr(graphs.WindowGraphs, "agrees", lambda self, run, logits: run != 1)
    config = EvalConfig(pairs=[("fp8", "nvfp4")], text=TEXT, max_tokens=96, seq_len=32,
                        device="cuda")
    eager, graphed = _both(checkpoint("qwen3_moe"), config)
    assert graphed["cuda_graph"]["used"] is False
    assert graphed["cuda_graph"]["fallback"] == (
        "the replayed forward of run fp8:nvfp4 differs from its eager forward on the first "
        "window; every window ran eagerly")
    assert eager["cuda_graph"]["fallback"] is None
    assert _metrics(graphed) == _metrics(eager)


@pytest.mark.parametrize(("argv", "want"),
                         [([], True), (["--no-cuda-graph"], False), (["--cuda-graph"], True)],
                         ids=["default-graphed", "off", "on"])
def test_the_cli_captures_graphs_unless_told_not_to(checkpoint, tmp_path, monkeypatch, argv,
                                                    want):
    """Graphs are the default (the GPU tier shows them equal to the eager run);
    ``--no-cuda-graph`` runs every window eagerly, and the API's default is the CLI's."""
    import moewire.eval as eval_pkg
    from moewire.cli import main

    seen: list[EvalConfig] = []

    def fake(path, config, **kwargs):
        seen.append(config)
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_pkg, "evaluate", fake)
    assert main(["eval", str(checkpoint("qwen3_moe")), "--out", str(tmp_path / "o"),
                 *argv]) == 130
    assert [c.cuda_graph for c in seen] == [want]
    assert EvalConfig().cuda_graph is True
