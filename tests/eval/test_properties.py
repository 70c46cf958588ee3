"""Three properties of ``moewire eval``, each against a computation of the test's own, on data
where the plausible wrong answers differ visibly from the right one:

- the reported ``kl_p99`` is numpy's default (``method="linear"``, Hyndman and Fan's
  definition 7) 99th percentile of every token's KL, computed here in numpy float64 from the
  logits of a separately loaded model;
- ``layer_rel_l2`` of each experts layer is ``||y - y0|| / ||y0||`` over the whole
  evaluation, ``y`` and ``y0`` captured by the test's own forward hooks;
- a budget that no quantized pair meets gives the verdict "keep the BF16 wire"
  (``verdict: null``): the baseline, whose KL is 0, is never a candidate.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.integrations.moe")

import _tiny  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from eval_helpers import TEXT  # noqa: E402

import moewire
from moewire.cli import main
from moewire.eval import evaluate

#: 151 tokens in windows of 32: four full windows and a short last one (23 tokens), so a
#: per-window statistic differs from the whole evaluation's; the 99th percentile's position,
#: 0.99 x 150 = 148.5, lies halfway between two order statistics, so every interpolation
#: method gives another value.
TOKENS, SEQ_LEN = 151, 32
PAIR = ("nvfp4", "nvfp4")


def _independent(path, pair):
    """``(logits, outputs)`` of the baseline and of ``pair``: the logits of the first
    ``TOKENS`` tokens of the text, numpy float64 ``[TOKENS, V]``, and each experts layer's
    outputs ``{name: [windows] of [T_w, H]}``, from a model loaded here and run in windows
    of ``SEQ_LEN`` (the last one shorter), the pair's quantizers calibrated on the first
    window; the outputs come from this test's own hooks."""
    import transformers as tf

    import moewire.integrations.transformers as mt

    ids = torch.tensor(list(TEXT.encode()))[:TOKENS] % _tiny.VOCAB
    windows = ids.split(SEQ_LEN)
    mt.register()
    model = mt.prepare(tf.AutoModelForCausalLM.from_pretrained(
        path, experts_implementation="moewire", dtype=torch.bfloat16), max_num_tokens=SEQ_LEN)
    outputs: dict[str, list[np.ndarray]] = {}
    handles = [m.register_forward_hook(
        lambda mod, a, y, n=n: outputs.setdefault(n, []).append(y.detach().double().numpy()))
        for n, m in mt.experts_modules(model)]

    def run():
        outputs.clear()
        with torch.no_grad():
            logits = [model(w[None]).logits[0].double().numpy() for w in windows]
        return np.concatenate(logits), {n: list(v) for n, v in outputs.items()}

    try:
        base = run()
        moewire.quantize(model, {"quant_cfg": [
            {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": pair[0]}},
            {"quantizer_name": "*combine_quantizer", "cfg": {"format": pair[1]}}]},
            lambda m: m(windows[0][None]))
        quant = run()
    finally:
        for h in handles:
            h.remove()
        moewire.unquantize(model)
    return base, quant


def _log_softmax(z: np.ndarray) -> np.ndarray:
    shifted = z - z.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _evaluate(path, pairs, **kwargs):
    kwargs.setdefault("log", lambda s: None)
    return evaluate(path, pairs, text=TEXT, max_tokens=TOKENS, seq_len=SEQ_LEN, device="cpu",
                    **kwargs)


def test_kl_p99_is_numpys_linear_99th_percentile_of_every_tokens_kl(checkpoint):
    path = checkpoint("qwen3_moe")
    report = _evaluate(path, [PAIR])
    assert (report["tokens"], report["windows"]) == (TOKENS, 5)  # the short window counts
    (logits0, _), (logits, _) = _independent(path, PAIR)
    logp0, logp = _log_softmax(logits0), _log_softmax(logits)
    kl = (np.exp(logp0) * (logp0 - logp)).sum(-1)
    want = np.quantile(kl, 0.99, method="linear")
    got = report["pairs"][1]
    assert got["kl_mean"] == pytest.approx(kl.mean(), rel=1e-9)  # the same tokens
    assert got["kl_p99"] == pytest.approx(want, rel=1e-9)
    # The data tells the 99th percentile from its plausible misreadings by far more than the
    # tolerance: another quantile, the maximum, another interpolation, one window's tail.
    wrong = {
        "p95": np.quantile(kl, 0.95), "p90": np.quantile(kl, 0.90), "max": kl.max(),
        **{m: np.quantile(kl, 0.99, method=m) for m in ("lower", "higher", "nearest")},
        "q*n position": np.sort(kl)[min(int(0.99 * kl.size), kl.size - 1)],
        "first window": np.quantile(kl[:SEQ_LEN], 0.99),
        "mean of windows": np.mean([np.quantile(kl[i:i + SEQ_LEN], 0.99)
                                    for i in range(0, kl.size, SEQ_LEN)]),
    }
    assert {k: v for k, v in wrong.items() if abs(v - want) < 1e-4 * want} == {}
    assert got["kl_p99"] > got["kl_mean"] > 0


def test_layer_rel_l2_is_the_norm_of_the_error_over_the_norm_of_the_baseline(checkpoint):
    path = checkpoint("qwen3_moe")
    report = _evaluate(path, [PAIR])
    (_, y0s), (_, ys) = _independent(path, PAIR)
    got = report["pairs"][1]["layer_rel_l2"]
    assert report["pairs"][0]["layer_rel_l2"] == dict.fromkeys(got, 0.0)
    assert list(got) == list(y0s) == ["model.layers.0.mlp.experts",
                                      "model.layers.1.mlp.experts"]
    for name in y0s:
        y0, y = np.concatenate(y0s[name]), np.concatenate(ys[name])
        assert y0.shape == (TOKENS, 128)
        want = np.linalg.norm(y - y0) / np.linalg.norm(y0)
        assert got[name] == pytest.approx(want, rel=1e-9), name
        wrong = {
            "squared": want**2,
            "over ||y||": np.linalg.norm(y0 - y) / np.linalg.norm(y),
            "mean of windows": np.mean([np.linalg.norm(a - b) / np.linalg.norm(b)
                                        for a, b in zip(ys[name], y0s[name], strict=True)]),
            "first window": np.linalg.norm(ys[name][0] - y0s[name][0])
                            / np.linalg.norm(y0s[name][0]),
            "elementwise mean": np.mean(np.abs(y - y0)) / np.mean(np.abs(y0)),
        }
        assert {k: v for k, v in wrong.items() if abs(v - want) < 1e-6 * want} == {}, name
    # Two layers with different errors: a swap of the layers' sums would show.
    first, second = got.values()
    assert abs(first - second) > 1e-3 * max(first, second)


def test_a_budget_no_quantized_pair_meets_keeps_the_bf16_wire(checkpoint, tmp_path, capsys):
    """Budget 0: the baseline's KL (exactly 0) meets it, no quantized pair does (the CLI
    refuses it before any work; the API answers it); then a positive budget half the
    smallest quantized KL; and, to show the data can name a pair, a budget exactly that KL
    (within: ``<=``)."""
    path = checkpoint("qwen3_moe")
    pairs = [("fp8", "fp8"), ("nvfp4", "nvfp4")]
    assert main(["eval", str(path), "--budget", "0", "--out", str(tmp_path / "cli")]) == 2
    assert "argument --budget: must be a finite number > 0" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()
    lines: list[str] = []
    report = _evaluate(path, pairs, budget=0.0, log=lines.append)
    assert report["budget"] == {"kl": 0.0, "verdict": None}
    assert report["pairs"][0]["name"] == "bf16:bf16" and report["pairs"][0]["kl_mean"] == 0.0
    assert any(line.endswith("no pair is within budget; keep the BF16 wire") for line in lines)

    kls = {p["name"]: p["kl_mean"] for p in report["pairs"][1:]}
    smallest = min(kls.values())
    assert smallest > 0
    lines = []
    half = _evaluate(path, pairs, budget=smallest / 2, log=lines.append)
    assert {p["name"]: p["kl_mean"] for p in half["pairs"][1:]} == kls  # the same KLs
    assert half["budget"] == {"kl": smallest / 2, "verdict": None}
    assert any(line.endswith("no pair is within budget; keep the BF16 wire") for line in lines)

    exact = _evaluate(path, pairs, budget=smallest)
    assert exact["budget"]["verdict"] == min(kls, key=kls.get) != "bf16:bf16"
