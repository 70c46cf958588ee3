"""``benchmarks/flashinfer_4120.py`` at a tiny shape: its fast weight casts equal moewire's
formats, its data follow FlashInfer's benchmark, and its pipeline equals an independent
token-by-token oracle, so the published comparison cannot rot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moewire import formats

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "flashinfer_4120.py"
SHAPE = dict(tokens=8, experts=16, top_k=4, hidden=128, inter=64)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("flashinfer_4120", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the dataclass reads its module's namespace
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _weights_like() -> torch.Tensor:
    """Rows like the benchmark's weights (N(0, 1/15^2) in BF16), rows far smaller (E4M3
    block scales in the subnormals), and rows on the rounding edges: NVFP4 blocks of amax 6
    (block scale 1) holding every E2M1 midpoint, and an MXFP8 block whose scale
    ``fl(amax * fl(1/448))`` is a power of two (the UE8M0 ceiling must not round it up), with
    elements small enough to land in E4M3's subnormals, where a doubled scale changes them."""
    g = torch.Generator().manual_seed(11)
    rows = torch.randn(64, 256, generator=g).bfloat16().float() / 15
    rows[8:16] *= 1e-2
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    rows[16] = torch.cat([mids, -mids]).repeat(16)
    amax = torch.tensor(448.0 * 2.0 ** -7)
    assert float(amax * torch.tensor(1 / 448, dtype=torch.float32)) == 2.0 ** -7
    rows[17, :32] = torch.linspace(-1, 1, 32) * amax
    rows[17, 1:9] = torch.arange(1, 9) * 1.1e-5  # E4M3 subnormals: the scale shows there
    return rows


@pytest.mark.parametrize("name", ["fp8_b32_ue8m0", "nvfp4"], ids=["mxfp8", "nvfp4"])
def test_the_fast_weight_casts_equal_moewires_formats(bench, name):
    x = _weights_like()
    amax = bench.NVFP4_UNIT_AMAX if name == "nvfp4" else None
    assert torch.equal(bench.fast_qdq(name, x), formats.get(name).qdq(x, amax).float())


def test_the_data_are_flashinfers_draws(bench):
    """Tokens ``randn(bf16) / 10``, routing weights the raw top-k scores (no softmax),
    weights ``randn(bf16) / 15`` per expert from a generator of its own."""
    x, w, ids = bench.make_batch(3, 8, 256, 8, 128)
    g = torch.Generator().manual_seed(3)
    assert torch.equal(x, torch.randn(8, 128, dtype=torch.bfloat16, generator=g) / 10)
    scores = torch.randn(8, 256, generator=g)
    assert torch.equal(w, scores.gather(1, ids)) and bool((w > 1).all())
    assert torch.equal(w.sort(-1).values, scores.topk(8).values.sort(-1).values)
    w13, w2 = bench.make_expert(3, 5, 128, 64)
    assert w13.shape == (128, 128) and w2.shape == (128, 64)
    assert torch.equal(w13, bench.make_expert(3, 5, 128, 64)[0])
    assert not torch.equal(w13, bench.make_expert(3, 6, 128, 64)[0])
    assert 0.06 < float(w13.float().std()) < 0.074


def test_relative_l2_is_flashinfers_acc_loss(bench):
    ref = torch.tensor([[3.0, -4.0], [0.0, 12.0]])
    assert bench.relative_l2(ref * 1.1, ref) == pytest.approx(10.0)
    assert bench.relative_l2(ref + torch.tensor([[0.0, 0.0], [0.0, 13.0]]), ref) == (
        pytest.approx(100.0))


def _oracle(bench, config, variant: str, seed: int) -> float:
    """The same pipeline token by token and slot by slot, with the formats' own references
    (never the fast casts); the rows summed in top-k order."""
    x, topk_w, ids = bench.make_batch(seed, SHAPE["tokens"], SHAPE["experts"], SHAPE["top_k"],
                                      SHAPE["hidden"])
    quantize_weights = variant in ("all", "compute")
    quantize_wire = variant in ("all", "wire")
    out, ref = [], []
    for t in range(SHAPE["tokens"]):
        y, y_ref = torch.zeros(SHAPE["hidden"]), torch.zeros(SHAPE["hidden"])
        for k in range(SHAPE["top_k"]):
            w13, w2 = (w.float() for w in bench.make_expert(seed, int(ids[t, k]),
                                                             SHAPE["hidden"], SHAPE["inter"]))

            def expert(tokens, a, b, inter_fmt):
                g1 = tokens @ a.t()
                gate = g1[:, :SHAPE["inter"]].clamp(max=10.0)
                up = g1[:, SHAPE["inter"]:].clamp(-10.0, 10.0)
                return bench.qdq(inter_fmt, F.silu(gate) * up) @ b.t()

            tok = x[t:t + 1].float()
            y_ref += (expert(tok, w13, w2, None) * topk_w[t, k])[0]
            if quantize_weights:
                w13, w2 = bench.qdq(config.weights, w13), bench.qdq(config.weights, w2)
            if quantize_wire:
                tok = bench.qdq(config.dispatch, tok)
            row = expert(tok, w13, w2, config.inter if quantize_weights else None) * topk_w[t, k]
            if quantize_wire:
                row = formats.get(config.combine).qdq(row.bfloat16()).float()
            y += row[0]
        out.append(y.bfloat16().float() if quantize_wire else y)
        ref.append(y_ref)
    return bench.relative_l2(torch.stack(out), torch.stack(ref))


@pytest.fixture(scope="module")
def seed_1(bench):
    return bench.run_seed(1, **SHAPE)


@pytest.mark.parametrize("variant", ["all", "compute", "wire"])
def test_the_split_equals_an_independent_oracle(bench, seed_1, variant):
    """Break: the dispatch format left out of ``all``, the SwiGLU requantization left out
    of ``compute``, or the combine rounding left out of ``wire``."""
    configs = {c.name: c for c in bench.CONFIGS}
    got = seed_1
    for name in ("mxfp8", "nvfp4", "nvfp4, combine nvfp4"):
        assert got[name][variant] == pytest.approx(_oracle(bench, configs[name], variant, 1),
                                                   rel=1e-3)


def test_exact_steps_leave_only_the_output_rounding(bench):
    exact = bench.Config("exact", None, None, None, None)
    got = bench.run_seed(2, **SHAPE, configs=(exact,))["exact"]
    assert got["compute"] == 0.0
    assert 0.0 < got["all"] == got["wire"] < 0.3


def test_a_run_writes_medians_and_the_published_numbers(bench, tmp_path, capsys):
    """One process, and the same run as two expert shards added up by ``--merge``: the same
    numbers. Break: a shard keeping rows of another shard's experts."""
    args = ["--seeds", "2", "--ranks", "2", "--tokens-per-rank", "2", "--experts", "16",
            "--top-k", "4", "--hidden", "128", "--intermediate", "64"]
    assert bench.main([*args, "--out", str(tmp_path / "one")]) == 0
    for shard in ("0/2", "1/2"):
        assert bench.main([*args, "--shard", shard, "--out", str(tmp_path / "sharded")]) == 0
    assert bench.main(["--merge", "--out", str(tmp_path / "sharded")]) == 0
    record = json.loads((tmp_path / "one" / "flashinfer_4120.json").read_text())
    merged = json.loads((tmp_path / "sharded" / "flashinfer_4120.json").read_text())
    assert merged["runs"] == record["runs"]
    assert record["seeds"] == [0, 1] and record["published"] == bench.PUBLISHED
    for name, med in record["median"].items():
        runs = [r[name]["all"] for r in record["runs"]]
        assert med["all"] == pytest.approx(sum(runs) / 2)
        assert med["compute"] < med["all"] and med["wire"] < med["all"]
    assert "| nvfp4 | 23.324 |" in capsys.readouterr().out


def test_merge_refuses_a_missing_shard(bench, tmp_path):
    args = ["--seeds", "1", "--experts", "8", "--top-k", "2", "--hidden", "64",
            "--intermediate", "32", "--out", str(tmp_path)]
    assert bench.main([*args, "--shard", "0/2"]) == 0
    with pytest.raises(SystemExit):
        bench.main(["--merge", "--out", str(tmp_path)])
