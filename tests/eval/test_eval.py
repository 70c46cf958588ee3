"""``moewire eval`` on tiny random checkpoints of each family: the exact baseline, the
metrics against an independent computation, the budget verdict, the per-layer mixed recipe
and the refusals."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers.integrations.moe")

import _tiny  # noqa: E402
import torch  # noqa: E402
from eval_helpers import TEXT  # noqa: E402

import moewire
from moewire.cli import main
from moewire.eval import EvalError, choose_layers, evaluate, mixed_recipe_yaml

FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral")


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_runs_each_family_with_an_exact_baseline(family, checkpoint, tmp_path):
    report = evaluate(checkpoint(family), [("fp8", "nvfp4")], text=TEXT, max_tokens=64,
                      seq_len=32, device="cpu", out_dir=tmp_path, log=lambda s: None)
    base, pair = report["pairs"]
    assert base["name"] == "bf16:bf16"
    # The BF16 wire through the same contract is the reference itself: bit for bit.
    assert base["kl_mean"] == 0.0 and base["kl_p99"] == 0.0 and base["top1_agreement"] == 1.0
    assert all(v == 0.0 for v in base["layer_rel_l2"].values())
    assert pair["kl_mean"] > 0.0 and 0.0 < pair["top1_agreement"] <= 1.0
    assert set(pair["layer_rel_l2"]) == {"model.layers.0.mlp.experts",
                                         "model.layers.1.mlp.experts"}
    assert pair["bytes_per_token"] < base["bytes_per_token"] and pair["wire_us"] < base["wire_us"]
    assert json.loads((tmp_path / "results.json").read_text())["pairs"][1]["name"] == "fp8:nvfp4"
    assert (tmp_path / "kl.png").stat().st_size > 0


def test_eval_runs_on_the_nvfp4_x_nvfp4_build(tmp_path_factory, tmp_path):
    """``moewire eval --mma fp4xfp4``: DeepGEMM 2.8.0's NVFP4 x NVFP4 kernel (the stand-in),
    the BF16 wire its exact baseline, an FP8 and an NVFP4 combine measured against it."""
    path = _tiny.checkpoint("deepseek_v3", tmp_path_factory.mktemp("dsv3-512"), hidden=512,
                            intermediate=512, layers=1)
    report = evaluate(path, [("bf16", "fp8"), ("bf16", "nvfp4")], text=TEXT, max_tokens=32,
                      seq_len=32, mma_type="fp4xfp4", device="cpu", out_dir=tmp_path,
                      log=lambda s: None)
    base, fp8, nvfp4 = report["pairs"]
    assert report["mma_type"] == "fp4xfp4"
    assert base["kl_mean"] == 0.0 and base["top1_agreement"] == 1.0
    assert 0.0 < fp8["kl_mean"] < nvfp4["kl_mean"]
    assert nvfp4["bytes_per_token"] < fp8["bytes_per_token"] < base["bytes_per_token"]


def test_metrics_match_an_independent_computation(checkpoint):
    """Perplexity, KL (mean and p99), top-1 and each layer's error recomputed in float64
    from the two models' logits and experts outputs, on the whole text at once."""
    import numpy as np
    import transformers as tf

    import moewire.integrations.transformers as mt

    path = checkpoint("qwen3_moe")
    report = evaluate(path, [("nvfp4", "nvfp4")], text=TEXT, max_tokens=64, seq_len=32,
                      device="cpu", log=lambda s: None)
    ids = torch.tensor(list(TEXT.encode()))[:65] % _tiny.VOCAB
    windows = ids[:64].view(2, 32)
    mt.register()
    model = mt.prepare(tf.AutoModelForCausalLM.from_pretrained(
        path, experts_implementation="moewire", dtype=torch.bfloat16), max_num_tokens=32)
    outputs = {}
    handles = [m.register_forward_hook(
        lambda mod, a, y, n=n: outputs.setdefault(n, []).append(y.double()))
        for n, m in mt.experts_modules(model)]

    def run():
        outputs.clear()
        with torch.no_grad():
            logits = torch.cat([model(w[None]).logits[0].double() for w in windows])
        return logits, {n: torch.cat(v) for n, v in outputs.items()}

    base, base_layers = run()
    moewire.quantize(model, {"quant_cfg": [
        {"quantizer_name": "*_quantizer", "cfg": {"format": "nvfp4"}}]},
        lambda m: m(windows[:1]))
    quant, quant_layers = run()
    for h in handles:
        h.remove()
    logp, logp0 = quant.log_softmax(-1), base.log_softmax(-1)
    kl = (logp0.exp() * (logp0 - logp)).sum(-1)
    ppl = math.exp(-logp.gather(-1, ids[1:65, None]).mean().item())
    got = report["pairs"][1]
    # KL(p0 || p) and KL(p || p0) differ by about 1e-4 relative here: the test tells them apart.
    assert got["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-9)
    assert got["kl_p99"] == pytest.approx(np.quantile(kl.numpy(), 0.99), rel=1e-9)
    assert got["perplexity"] == pytest.approx(ppl, rel=1e-12)
    assert got["top1_agreement"] == (quant.argmax(-1) == base.argmax(-1)).double().mean()
    assert got["layer_rel_l2"] == {
        n: pytest.approx(((quant_layers[n] - y0).norm() / y0.norm()).item(), rel=1e-9)
        for n, y0 in base_layers.items()}


def test_budget_verdict(checkpoint, tmp_path):
    report = evaluate(checkpoint("qwen3_moe"), [("fp8", "fp8"), ("nvfp4", "nvfp4")],
                      text=TEXT, max_tokens=64, seq_len=32, device="cpu", budget=1e-2,
                      out_dir=tmp_path, log=lambda s: None)
    by_name = {p["name"]: p for p in report["pairs"]}
    within = [n for n, p in by_name.items() if n != "bf16:bf16" and p["kl_mean"] <= 1e-2]
    cheapest = min(within, key=lambda n: by_name[n]["bytes_per_token"]) if within else None
    assert report["budget"]["verdict"] == cheapest


@pytest.mark.parametrize(
    ("sensitivity", "budget", "expected"),
    [
        ({0: 3e-3, 1: 1e-3, 2: 2e-3}, 3e-3, [1, 2]),       # 1e-3 + 2e-3 fits exactly
        ({0: 3e-3, 1: 1e-3, 2: 2e-3}, 2.9e-3, [1]),        # the next one would pass it
        ({0: 1e-3, 1: 1e-3, 2: 1e-3}, 2e-3, [0, 1]),       # ties: lower layer first
        ({0: 5e-3, 1: 6e-3}, 1e-3, []),                     # none fits
        ({3: 1e-4, 7: 5e-2, 5: 1e-4}, 1.0, [3, 5, 7]),     # all fit
    ],
    ids=["exact-fit", "next-passes", "ties", "none", "all"],
)
def test_choose_layers(sensitivity, budget, expected):
    assert choose_layers(sensitivity, budget) == expected


def test_mixed_recipe_selects_exactly_the_layers_it_names():
    """The YAML loads as a recipe; the 4-bit pair reaches the layers named, in transformers',
    vLLM's (DeepSeek-V4 ``ffn``, Mixtral ``block_sparse_moe``) and SGLang's names, and no
    other layer (layer 1 is not layer 10..19)."""
    import yaml

    text = mixed_recipe_yaml(("nvfp4", "nvfp4"), [1, 3], ("fp8", "fp8"), "test")
    path_entries = yaml.safe_load(text)["quant_cfg"]
    recipe = moewire.recipes.Recipe.from_entries(path_entries, modelopt=True)
    from moewire.quantizer.config import parse_cfg

    for prefix in ("model.layers.{n}.mlp.experts", "model.layers.{n}.ffn.experts",
                   "model.layers.{n}.block_sparse_moe.experts"):
        for n in (0, 1, 2, 3, 10, 13, 31):
            for kind in ("dispatch", "combine"):
                cfg = recipe.match(f"{prefix.format(n=n)}.{kind}_quantizer")
                want = "nvfp4" if n in (1, 3) else "fp8"
                assert parse_cfg(cfg).fmt == want, (prefix, n, kind)


def test_mixed_recipe_file_quantizes_the_named_layers(checkpoint, tmp_path):
    import transformers as tf

    import moewire.integrations.transformers as mt

    path = tmp_path / "mixed.yaml"
    path.write_text(mixed_recipe_yaml(("nvfp4", "nvfp4"), [1], ("fp8", "fp8"), "test"))
    mt.register()
    model = mt.prepare(tf.AutoModelForCausalLM.from_pretrained(
        checkpoint("mixtral"), experts_implementation="moewire"))
    moewire.quantize(model, str(path), lambda m: m(torch.arange(16)[None]))
    fmts = {n: q.fmt.name for n, _, q in moewire.megamoe.api.quantizers(model)}
    assert fmts == {
        "model.layers.0.mlp.experts.dispatch_quantizer": "fp8",
        "model.layers.0.mlp.experts.combine_quantizer": "fp8",
        "model.layers.1.mlp.experts.dispatch_quantizer": "nvfp4",
        "model.layers.1.mlp.experts.combine_quantizer": "nvfp4",
    }


def _llama(tmp_path):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    return tmp_path


def _olmoe(tmp_path):
    import transformers as tf

    cfg = tf.OlmoeConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         num_experts=4, num_experts_per_tok=2)
    cfg.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "absent", "is not a directory"),
        (_llama, "'llama' model without routed experts"),
        (_olmoe, "unknown architecture 'olmoe'"),
        (lambda tmp: _tiny.checkpoint("gpt_oss", tmp), "gpt-oss's experts have biases"),
    ],
    ids=["missing-directory", "non-moe", "unknown-architecture", "gpt-oss"],
)
def test_refusals(make, message, tmp_path, capsys):
    path = make(tmp_path)
    with pytest.raises(EvalError, match=message):
        evaluate(path, text=TEXT, device="cpu", log=lambda s: None)
    assert main(["eval", str(path), "--device", "cpu"]) == 2
    assert message.split("'")[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "argv", "message"),
    [
        ({"kernel": "deepgemm-sm90"}, ["--kernel", "deepgemm-sm90"],
         "--kernel deepgemm-sm90: DeepGEMM's real SM90 fp8_mega_moe cannot run here "
         "\\(no CUDA device\\)"),
        ({"kernel": "deepgemm-sm90", "mma_type": "bf16xbf16"},
         ["--kernel", "deepgemm-sm90", "--mma", "bf16xbf16"],
         "--mma: kernel 'deepgemm-sm90' has the builds fp8xfp8, not 'bf16xbf16'"),
        ({"mma_type": "fp8xfp8"}, ["--mma", "fp8xfp8"],
         "--mma: kernel 'stand-in' has the builds bf16xbf16, fp8xfp4, fp4xfp4, not 'fp8xfp8'"),
        ({"kernel": "cutlass"}, None, "--kernel: 'cutlass' is not one of stand-in"),
    ],
    ids=["sm90-without-hopper", "sm90-stand-in-build", "stand-in-sm90-build", "unknown-kernel"],
)
def test_kernel_refusals(kwargs, argv, message, checkpoint, monkeypatch, capsys):
    """Refused before the model loads; without a Hopper GPU the real kernel says why."""
    from moewire.integrations import deepgemm_sm90

    monkeypatch.setattr(deepgemm_sm90, "available", lambda: (False, "no CUDA device"))
    path = checkpoint("mixtral")
    with pytest.raises(EvalError, match=message):
        evaluate(path, text=TEXT, device="cpu", log=lambda s: None, **kwargs)
    if argv is not None:
        assert main(["eval", str(path), "--device", "cpu", *argv]) == 2
        assert message.split(" (")[0].replace("\\", "") in capsys.readouterr().err


def test_refuses_what_does_not_fit_in_memory(checkpoint, monkeypatch):
    from moewire.eval import plan

    monkeypatch.setattr(plan, "_available_bytes", lambda device: 1024)
    with pytest.raises(EvalError, match="memory: about .* GiB needed"):
        evaluate(checkpoint("mixtral"), text=TEXT, device="cpu", log=lambda s: None)


def test_cli_eval_prints_the_table(checkpoint, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    code = main(["eval", str(checkpoint("mixtral")), "--pairs", "fp8:fp8", "--text", str(text),
                 "--recipe", "moe_dispatch_mxfp4",
                 "--max-tokens", "32", "--seq-len", "32", "--device", "cpu", "--budget", "1",
                 "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0
    assert "bf16:bf16" in out and "fp8:fp8" in out and "moe_dispatch_mxfp4" in out
    # Without a terminal: plain progress lines on stderr, each with the time to go; no bar.
    progress = [line for line in captured.err.splitlines() if line.startswith("eval: window")]
    assert progress == [line for line in progress if line.endswith(" s to go")]
    assert progress[-1].startswith("eval: window 1/1: ") and "\x1b" not in captured.err
    # Both within budget; fp8:fp8 moves 256 bytes per token, MXFP4 dispatch + BF16 combine 324.
    assert "budget KL 1: fp8:fp8" in out
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(p["dispatch"], p["combine"]) for p in report["pairs"]] == [
        ("bf16", "bf16"), ("fp8", "fp8"), ("mxfp4", "bf16")]


def test_cli_eval_takes_the_shipped_combines_and_fnuz(checkpoint, tmp_path, capsys):
    """``--pairs`` names FlashInfer's and MoRI's combines and ``fp8_e4m3fnuz`` (calibrated
    as a dispatch format, like ``fp8``) as any registered format."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    pairs = ["fp8_e4m3fnuz:mori_fp8_blockwise_fnuz", "bf16:flashinfer_nvfp4"]
    code = main(["eval", str(checkpoint("mixtral")), "--pairs", *pairs, "--text", str(text),
                 "--max-tokens", "32", "--seq-len", "32", "--device", "cpu",
                 "--out", str(tmp_path / "out")])
    assert code == 0
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    got = {p["name"]: p for p in report["pairs"]}
    assert set(got) == {"bf16:bf16", *pairs}
    for name in pairs:
        assert got[name]["kl_mean"] > 0.0, name
        assert got[name]["bytes_per_token"] < got["bf16:bf16"]["bytes_per_token"], name


def test_the_terminal_bar_has_one_task_per_stage_with_the_time_to_go():
    import io

    from rich.console import Console
    from rich.progress import TimeRemainingColumn

    from moewire import cli

    bar = cli._rich_bar(Console(file=io.StringIO()))
    progress = cli._eval_progress(bar)
    progress("calibration", 0, 3)
    progress("calibration", 2, 3)
    progress("window", 1, 8)
    assert [(t.description, t.completed, t.total) for t in bar.tasks] == [
        ("calibration", 2, 3), ("window", 1, 8)]
    assert any(isinstance(c, TimeRemainingColumn) for c in bar.columns)


def test_the_kl_plot_puts_the_baseline_on_the_edge_and_draws_the_budget():
    """KL 0 has no place on a log axis: the baseline is a star on the bottom edge (axes
    coordinates), labelled, never at an invented KL; the budget is a horizontal line."""
    import matplotlib.pyplot as plt

    from moewire.eval.report import kl_figure

    pairs = [{"name": "bf16:bf16", "kl_mean": 0.0, "bytes_per_token": 512.0, "wire_us": 60.0},
             {"name": "fp8:fp8", "kl_mean": 2e-4, "bytes_per_token": 256.0, "wire_us": 40.0},
             {"name": "nvfp4:nvfp4", "kl_mean": 3e-3, "bytes_per_token": 144.0,
              "wire_us": 30.0}]
    report = {"pairs": pairs, "budget": {"kl": 1e-3}, "interconnect": "nvlink-h200",
              "time_ep_size": 8, "checkpoint": "/x/ckpt", "tokens": 64, "kernel": "stand-in",
              "mma_type": "bf16xbf16"}
    fig = kl_figure(report)
    try:
        for ax, key in zip(fig.axes, ("bytes_per_token", "wire_us"), strict=True):
            data = [tuple(o) for c in ax.collections if c.get_offset_transform() == ax.transData
                    for o in c.get_offsets()]
            assert sorted(data) == sorted((p[key], p["kl_mean"]) for p in pairs[1:])
            edge = [c for c in ax.collections if c.get_offset_transform() != ax.transData]
            assert [tuple(c.get_offsets()[0]) for c in edge] == [(pairs[0][key], 0.0)]
            assert any(t.get_text() == "bf16:bf16: KL 0 (the reference)" for t in ax.texts)
            lines = [tuple(line.get_ydata()) for line in ax.get_lines()]
            assert (1e-3, 1e-3) in lines
            assert ax.get_ylim()[0] > 0
    finally:
        plt.close(fig)
