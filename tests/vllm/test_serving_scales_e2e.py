"""Scales calibrated in transformers, served by vLLM: end to end, on CPU.

A tiny DeepSeek-V4 with FP4 experts is calibrated in transformers (its own Mega-MoE,
``experts_implementation="deepgemm_megamoe"``, on the stand-in of the kernels-hub DeepGEMM)
and its scales written under vLLM's names (``save_scales(model, path, host="vllm")``), by
``tests/hf_transformers/serving_scales_source.py`` run with the Python that has transformers
5.23 (``.venv``, or ``$MOEWIRE_TRANSFORMERS_PYTHON``). Here vLLM 0.32's real
``DeepseekV4MegaMoEExperts`` (``vllm/models/deepseek_v4/nvidia/model.py``) holds the same
checkpoint's expert tensors (``w1``/``w3`` stacked into ``w13_weight``, the UE8M0 scales as
bytes, as vLLM's loader does), on moewire's stand-in of the DeepGEMM it calls, and loads the
file through the plugin's own function (``quantize_vllm_model(model, recipe, scales)``).

On the same tokens its quantized output equals transformers' bit for bit: both stage the
tokens as MXFP8 (UE8M0 scale per 32 channels), run DeepGEMM's ``fp8_fp4_mega_moe`` on the
same FP4 weights and quantize its router-weighted combine rows to NVFP4 with the same amax.
A file with transformers' names, another layer count or another format is refused by the
loader, naming the file and the fix.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import _standin as standin
import pytest
import torch
from torch import nn

import serving_scales

pytestmark = pytest.mark.vllm

vllm_mod = pytest.importorskip("moewire.integrations.vllm")

from moewire.megamoe import api  # noqa: E402

RECIPE = serving_scales.RECIPE
CLAMP = 10.0  # DeepseekV4Config.swiglu_limit
E, K, H, INTER = 8, 2, 512, 512  # the tiny DeepSeek-V4 (tests/hf_transformers/_tiny.py V4)
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> Path:
    """The directory ``serving_scales_source.py`` wrote (checkpoint, scales, batch)."""
    return serving_scales.calibrate(tmp_path_factory.mktemp("serving-scales"))


def _experts(config, checkpoint: Path) -> nn.Module:
    """vLLM's DeepseekV4MegaMoEExperts of layer 0, holding the checkpoint's expert tensors
    under a model tree with vLLM's names (``model.layers.0.ffn.experts``)."""
    from safetensors.torch import load_file
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4MegaMoEExperts

    experts = DeepseekV4MegaMoEExperts(
        config, num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K,
        hidden_size=H, intermediate_size=INTER, num_shared_experts=0,
        # vLLM refuses a layer name twice in one process's forward context.
        prefix=f"scales_e2e.{next(_prefixes)}.ffn.experts")
    tensors = load_file(checkpoint / "model.safetensors")
    for e in range(E):
        w1, w3, w2 = ({part: tensors[f"model.layers.0.ffn.experts.{e}.{w}.{part}"].view(
            torch.uint8) for part in ("weight", "scale")} for w in ("w1", "w3", "w2"))
        experts.w13_weight.data[e] = torch.cat([w1["weight"], w3["weight"]])
        experts.w13_weight_scale.data[e] = torch.cat([w1["scale"], w3["scale"]])
        experts.w2_weight.data[e] = w2["weight"]
        experts.w2_weight_scale.data[e] = w2["scale"]
    layer = nn.Module()
    layer.ffn = nn.Module()
    layer.ffn.experts = experts
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([layer])
    return root


def _forward(config, experts, x, idx, w):
    from vllm.forward_context import create_forward_context, override_forward_context

    with override_forward_context(create_forward_context(None, config)):
        return experts(x, w, idx, activation_clamp=CLAMP)


def test_vllm_serves_transformers_scales_bit_for_bit(vllm_config, calibrated):
    batch = torch.load(calibrated / "batch.pt")
    vllm_mod.register_vllm_experts()
    with standin.use_reference_deep_gemm("vllm-0.32"):
        model = _experts(vllm_config, calibrated / "v4-fp4")
        experts = model.model.layers[0].ffn.experts
        experts.finalize_weights()
        plain = _forward(vllm_config, experts, batch["x"], batch["idx"], batch["w"])
        vllm_mod.quantize_vllm_model(model, RECIPE, str(calibrated / "scales-vllm.json"))
        y = _forward(vllm_config, experts, batch["x"], batch["idx"], batch["w"])
    assert float(experts.dispatch_quantizer.static_amax) == float(batch["dispatch_amax"])
    assert float(experts.combine_quantizer.static_amax) == float(batch["combine_amax"])
    assert not torch.equal(y, plain)
    assert torch.equal(y.view(torch.int16), batch["y"].view(torch.int16))


REFUSED = serving_scales.refused("ffn", "mlp", "transformers")


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_vllm_refuses_a_file_of_other_names_layers_or_format(vllm_config, calibrated, tmp_path,
                                                             case):
    make, recipe, message = REFUSED[case]
    path = make(calibrated / "scales-vllm.json", tmp_path / "bad.json")
    vllm_mod.register_vllm_experts()
    with standin.use_reference_deep_gemm("vllm-0.32"):
        model = _experts(vllm_config, calibrated / "v4-fp4")
        experts = model.model.layers[0].ffn.experts
        experts.finalize_weights()
        with pytest.raises(ValueError, match=message):
            vllm_mod.quantize_vllm_model(model, recipe, str(path))
    assert experts.combine_quantizer.static_amax is None
    api.unquantize(model)
