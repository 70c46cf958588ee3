"""Scales calibrated in transformers, served by SGLang: end to end, on CPU.

A tiny DeepSeek-V4 with FP4 experts is calibrated in transformers (its own Mega-MoE,
``experts_implementation="deepgemm_megamoe"``, on the stand-in of the kernels-hub DeepGEMM)
and its scales written under SGLang's names (``save_scales(model, path, host="sglang")``), by
``tests/hf_transformers/serving_scales_source.py`` run with the Python that has transformers
5.23 (``.venv``, or ``$MOEWIRE_TRANSFORMERS_PYTHON``). Here SGLang 0.5.23's released SM100
Mega-MoE path (``mega_moe.build_mega_moe_experts_weights`` on the checkpoint's expert tensors,
then ``run_mega_routed_experts``: SGLang's own MXFP8 cast and ``deep_gemm.fp8_fp4_mega_moe``,
on the CPU stand-ins of ``_sgl_standin.sm100_module``) loads the file through the plugin's own
function (``quantize_sglang_model(model, recipe, scales)``).

On the same tokens its quantized output equals transformers' bit for bit: both stage the
tokens as MXFP8 (UE8M0 scale per 32 channels), run ``fp8_fp4_mega_moe`` on the same FP4
weights and quantize its router-weighted combine rows to NVFP4 with the same amax, re-summed
in slot order. A file with vLLM's names, another layer count or another format is refused
by the loader, naming the file and the fix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import _released
import pytest
import torch
from torch import nn

import serving_scales
from moewire.integrations import sglang as sg
from moewire.megamoe import api
from moewire.reference import hub_deep_gemm

pytestmark = pytest.mark.sglang

if _released.wheel_root() is None:  # before the module's fixture runs transformers
    pytest.skip("the sglang 0.5.23 wheel is not installed (make test-sglang)",
                allow_module_level=True)

RECIPE = serving_scales.RECIPE
CLAMP = 10.0  # DeepseekV4Config.swiglu_limit (SGLang passes moe_runner_config.swiglu_limit)
E, K, H, INTER = 8, 2, 512, 512  # the tiny DeepSeek-V4 (tests/hf_transformers/_tiny.py V4)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> Path:
    """The directory ``serving_scales_source.py`` wrote (checkpoint, scales, batch)."""
    return serving_scales.calibrate(tmp_path_factory.mktemp("serving-scales"))


@pytest.fixture
def mega_moe(sglang_sm100, monkeypatch):
    """SGLang's ``mega_moe`` on the SM100 stand-in, whose ``deep_gemm`` also has the scale
    packing SGLang's weight build imports (the kernels-hub stand-in's, DeepGEMM's
    ``transform_sf_into_required_layout`` for recipe ``(1, 32)``)."""
    monkeypatch.setattr(sys.modules["deep_gemm"], "transform_sf_into_required_layout",
                        hub_deep_gemm.transform_sf_into_required_layout, raising=False)
    monkeypatch.setenv("SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK", "16")
    return sglang_sm100


class Experts(nn.Module):
    """What SGLang's FusedMoE holds of an FP4 DeepSeek-V4 checkpoint before
    ``build_mega_moe_experts_weights``: ``w13_weight`` int8 ``[E, 2I, H/2]`` (``w1`` then
    ``w3``), ``w2_weight`` int8 ``[E, H, I/2]``, FP32 power-of-two scales per 32."""

    def __init__(self, checkpoint: Path) -> None:
        from safetensors.torch import load_file

        super().__init__()
        tensors = load_file(checkpoint / "model.safetensors")

        def stacked(names: tuple[str, ...], part: str) -> torch.Tensor:
            return torch.stack([torch.cat([
                tensors[f"model.layers.0.ffn.experts.{e}.{n}.{part}"] for n in names])
                for e in range(E)])

        self.num_experts = E
        self._mega_moe_nvfp4 = False  # set by SGLang's FusedMoE.__init__
        self._mega_moe_w4a4 = False
        for name, parts in (("w13", ("w1", "w3")), ("w2", ("w2",))):
            weight = nn.Parameter(stacked(parts, "weight"), requires_grad=False)
            scale = nn.Parameter(stacked(parts, "scale").float(), requires_grad=False)
            self.register_parameter(f"{name}_weight", weight)
            self.register_parameter(f"{name}_weight_scale_inv", scale)


def _model(mega_moe, checkpoint: Path) -> nn.Module:
    """A model tree with SGLang's DeepSeek names (``model.layers.0.mlp.experts``)."""
    experts = Experts(checkpoint)
    mega_moe.build_mega_moe_experts_weights(experts)
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.experts = experts
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([layer])
    return root


def _run(mega_moe, experts, batch) -> torch.Tensor:
    x = batch["x"]
    return mega_moe.run_mega_routed_experts(
        experts, x, batch["idx"], batch["w"], hidden_size=H, intermediate_size=INTER,
        top_k=K, num_tokens=x.shape[0], routed_scaling_factor=1.0, activation_clamp=CLAMP)


def test_sglang_serves_transformers_scales_bit_for_bit(mega_moe, calibrated):
    batch = torch.load(calibrated / "batch.pt")
    model = _model(mega_moe, calibrated / "v4-fp4")
    experts = model.model.layers[0].mlp.experts
    plain = _run(mega_moe, experts, batch)
    assert sg.quantize_sglang_model(model, RECIPE, str(calibrated / "scales-sglang.json")) == 1
    y = _run(mega_moe, experts, batch)
    assert float(experts.dispatch_quantizer.static_amax) == float(batch["dispatch_amax"])
    assert float(experts.combine_quantizer.static_amax) == float(batch["combine_amax"])
    assert not torch.equal(y, plain)
    assert torch.equal(y.view(torch.int16), batch["y"].view(torch.int16))


REFUSED = serving_scales.refused("mlp", "ffn", "vllm")


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_sglang_refuses_a_file_of_other_names_layers_or_format(mega_moe, calibrated, tmp_path,
                                                               case):
    make, recipe, message = REFUSED[case]
    path = make(calibrated / "scales-sglang.json", tmp_path / "bad.json")
    model = _model(mega_moe, calibrated / "v4-fp4")
    with pytest.raises(ValueError, match=message):
        sg.quantize_sglang_model(model, recipe, str(path))
    assert model.model.layers[0].mlp.experts.combine_quantizer.static_amax is None
    api.unquantize(model)
