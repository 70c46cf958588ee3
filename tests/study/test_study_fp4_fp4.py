"""``moewire study --mma fp4xfp4``: the study on the stand-in of DeepGEMM 2.8.0's NVFP4 x NVFP4
``fp4_fp4_mega_moe`` (vLLM main's DeepSeek V3.2 / GLM-5.2 NVFP4 kernel: NVFP4 staging per 16,
router-weighted combine rows)."""

import json

import torch
from study_helpers import LAYER

from moewire import cli
from moewire.reference.fp4_fp4.experts import FP4MegaMoEExperts
from moewire.study import StudyConfig
from moewire.study.layer import build_layer

TINY = ["study", "--model", "tiny", "--tokens", "16", "--calib-batches", "1",
        "--eval-batches", "1", "--dispatch", "fp8", "--combine", "nvfp4,mxfp8",
        "--mma", "fp4xfp4"]


def test_study_runs_on_the_nvfp4_x_nvfp4_kernel(tmp_path):
    out = tmp_path / "fp4"
    assert cli.main([*TINY, "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["layer"]["mma"] == "fp4xfp4"
    by_pair = {(r["dispatch"], r["combine"]): r for r in doc["results"]}
    assert by_pair["bf16", "bf16"]["rel_l2"] == 0
    combine = by_pair["bf16", "nvfp4"]
    assert combine["calibrated"] and combine["amax"]["combine"] > 0
    assert 0 < by_pair["bf16", "mxfp8"]["rel_l2"] < combine["rel_l2"] < 1


def test_fp4xfp4_layer_from_a_checkpoint(checkpoint):
    """Dense checkpoint weights become ModelOpt-style NVFP4 with per-expert global scales."""
    path, _ = checkpoint
    cfg = StudyConfig(model="tiny", weights=path, layer=LAYER, mma="fp4xfp4", tokens=8)
    layer = build_layer(cfg, torch.Generator().manual_seed(0))
    experts = layer.fresh().experts
    assert isinstance(experts, FP4MegaMoEExperts)
    assert layer.weights.l1_alphas.shape == (layer.num_experts, 2)
    assert (layer.weights.l1_alphas[:, 0] != layer.weights.l1_alphas[:, 1]).any()
    x = torch.randn((8, layer.hidden), generator=torch.Generator().manual_seed(1)).bfloat16()
    ids = torch.arange(8 * layer.top_k).reshape(8, layer.top_k) % layer.num_experts
    y = experts(x, torch.full((8, layer.top_k), 0.5), ids)
    assert y.shape == (8, layer.hidden) and torch.isfinite(y.float()).all()
