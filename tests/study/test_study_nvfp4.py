"""``moewire study --mma nvfp4``: the study on the NVFP4 Mega-MoE stand-in (vLLM 0.33/0.34's
``nvfp4_mega_moe``: unweighted combine rows, FMA combine)."""

import json

import torch
from study_helpers import LAYER

from moewire import cli
from moewire.reference import NVFP4MegaMoEExperts
from moewire.study import StudyConfig
from moewire.study.layer import build_layer

TINY = ["study", "--model", "tiny", "--tokens", "16", "--calib-batches", "1",
        "--eval-batches", "1", "--dispatch", "fp8", "--combine", "nvfp4,mxfp8", "--mma", "nvfp4"]


def test_study_runs_on_the_nvfp4_kernel(tmp_path):
    out = tmp_path / "nv"
    assert cli.main([*TINY, "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["layer"]["mma"] == "nvfp4"
    by_pair = {(r["dispatch"], r["combine"]): r for r in doc["results"]}
    assert by_pair["bf16", "bf16"]["rel_l2"] == 0
    combine = by_pair["bf16", "nvfp4"]
    assert combine["calibrated"] and combine["amax"]["combine"] > 0
    assert 0 < combine["rel_l2"] < 1


def test_nvfp4_layer_from_a_checkpoint(checkpoint):
    path, _ = checkpoint
    cfg = StudyConfig(model="tiny", weights=path, layer=LAYER, mma="nvfp4", tokens=8)
    layer = build_layer(cfg, torch.Generator().manual_seed(0))
    experts = layer.fresh().experts
    assert isinstance(experts, NVFP4MegaMoEExperts)
    assert layer.weights.l1_global_scale.shape == (layer.num_experts,)
    x = torch.randn((8, layer.hidden), generator=torch.Generator().manual_seed(1)).bfloat16()
    ids = torch.arange(8 * layer.top_k).reshape(8, layer.top_k) % layer.num_experts
    y = experts(x, torch.full((8, layer.top_k), 0.5), ids)
    assert y.shape == (8, layer.hidden) and torch.isfinite(y.float()).all()
