"""vLLM 0.33's and 0.34's ``DeepGemmMegaMoEExperts`` NVFP4 path (``MEGA_MOE_NVFP4``) on the
stand-in.

vLLM's own module source (fetched by ``make test-vllm`` into ``.venv-vllm/vllm-<v>-src``
with ``tests/vllm/fetch_vllm_src.py``; 0.34's NVFP4 branch also passes ``eplb_state`` to the
staging)
builds the experts, loads an NVFP4 checkpoint through its own
weight loader (``weight``, ``weight_scale``, ``weight_scale_2``, ``input_scale``), stages
with ``prepare_megamoe_nvfp4_inputs`` (the stand-in's torch version) and calls
``deep_gemm.nvfp4_mega_moe`` of the stand-in. Checked: its output equals the stand-in
experts module on the same weights bit for bit; moewire's combine quantizer re-sums the
unweighted rows with the FMA (checked against the rows); the dispatch quantizer reaches the
NVFP4 staging call; calibration collects unweighted rows.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import _standin as standin
import pytest
import torch

pytestmark = pytest.mark.vllm

vllm_mod = pytest.importorskip("moewire.integrations.vllm")
# Where each version's module sources are: 0.33's are fetched by `make test-vllm`; 0.34's
# (deep_gemm_mega_moe.py, prepare_megamoe.py, eplb_triton.py) by the 0.34 fetch when the
# Makefile has it (else this version is skipped, saying so).
SOURCES = {
    "0.33": Path(os.environ.get("MOEWIRE_VLLM033_SRC", ".venv-vllm/vllm-0.33.0-src")),
    "0.34": Path(os.environ.get("MOEWIRE_VLLM034_SRC", ".venv-vllm/vllm-0.34.0-src")),
}
FILES = {"0.33": ("prepare_megamoe",), "0.34": ("eplb_triton", "prepare_megamoe")}
E, K, H, INTER = 4, 2, 256, 256
_LAYERS = iter(range(930, 1000))


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=list(SOURCES), ids=[f"vllm-{v}" for v in SOURCES])
def vllm_module(request):
    """vLLM's ``deep_gemm_mega_moe`` module of one version, loaded from its source files.

    Its helper modules are loaded under their real names for the duration and restored
    afterwards (the other vLLM tests import the installed 0.32 ones).
    """
    version = request.param
    src = SOURCES[version]
    if not (src / "deep_gemm_mega_moe.py").is_file():
        pytest.fail(f"vLLM {version} sources missing in {src}: run `make test-vllm`")
    saved = {}
    for helper in FILES[version]:
        name = f"vllm.model_executor.layers.fused_moe.{helper}"
        saved[name] = sys.modules.get(name)
        _load(name, src / f"{helper}.py")
    name = f"vllm{version.replace('.', '')}_nvfp4_deep_gemm_mega_moe"
    module = _load(name, src / "deep_gemm_mega_moe.py")
    site = vllm_mod.ExpertsSite(name, "DeepGemmMegaMoEExperts", read_from=version,
                                extra_stage_fns=(vllm_mod.NVFP4_STAGE_FN,))
    vllm_mod.register_site(module.DeepGemmMegaMoEExperts, site)
    yield module
    for key, value in saved.items():
        if value is None:
            sys.modules.pop(key, None)
        else:
            sys.modules[key] = value


def _prefix() -> str:
    return f"model.layers.{next(_LAYERS)}.ffn.experts"


def _weights():
    from moewire.reference import make_nvfp4_weights

    return make_nvfp4_weights(E, H, INTER, seed=3)


def _make(module, config, prefix: str, weights):
    """vLLM's NVFP4 experts, loaded shard by shard from the stand-in's raw NVFP4 weights."""
    experts = module.DeepGemmMegaMoEExperts(
        config, num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K,
        hidden_size=H, intermediate_size=INTER,
        activation=module.MegaMoEActivation(clamp=10.0),
        weight_format=module.MEGA_MOE_NVFP4, prefix=prefix,
    )
    params = dict(experts.named_parameters())
    for e in range(E):
        for which, (w, sf), gs in (("w13", weights.l1_raw, weights.l1_global_scale),
                                   ("w2", weights.l2_raw, weights.l2_global_scale)):
            rows = [("w2", slice(None))] if which == "w2" else [
                ("w1", slice(0, INTER)), ("w3", slice(INTER, 2 * INTER))]
            for shard_id, part in rows:
                scale_bytes = sf[e].contiguous().view(torch.uint8)[part]
                experts.weight_loader(params[f"{which}_weight"], w[e][part],
                                      f"{prefix}.{which}_weight", shard_id, e)
                experts.weight_loader(params[f"{which}_weight_scale"],
                                      scale_bytes.view(torch.float8_e4m3fn),
                                      f"{prefix}.{which}_weight_scale", shard_id, e)
                experts.weight_loader(params[f"{which}_weight_scale_2"], gs[e].reshape(1),
                                      f"{prefix}.{which}_weight_scale_2", shard_id, e)
        experts.weight_loader(params["w2_input_scale"], torch.tensor([0.5]),
                              f"{prefix}.w2_input_scale", "w2", e)
    assert experts.l2_activation_scale == 0.5
    return experts


def _routing(t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((t, H), generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    w = torch.rand((t, K), generator=g) + 0.1
    return x, ids, w


def _reference(weights, x, w, ids):
    from moewire.reference import NVFP4MegaMoEExperts

    ref = NVFP4MegaMoEExperts(E, K, H, INTER, 64, activation_clamp=10.0,
                              l2_activation_scale=0.5, weights=weights, device="cpu")
    return ref(x, w, ids), ref


def test_nvfp4_experts_equal_the_stand_in_bit_for_bit(vllm_config, vllm_module):
    weights = _weights()
    x, ids, w = _routing(8, seed=1)
    with standin.use_reference_deep_gemm("vllm-0.33"):
        experts = _make(vllm_module, vllm_config, _prefix(), weights)
        y = experts(x, w, ids)
        assert vllm_mod.kernel_flavour(experts) == "vllm-0.33"
        assert type(experts.get_symm_buffer()).__name__ == "NVFP4SymmBuffer"
        y_ref, _ = _reference(weights, x, w, ids)
    assert torch.equal(y.view(torch.int16), y_ref.view(torch.int16))


def test_nvfp4_quantized_combine_and_dispatch(vllm_config, vllm_module):
    import moewire
    from moewire import formats
    from moewire.megamoe import layout
    from moewire.megamoe.resum import resum

    weights = _weights()
    x, ids, w = _routing(8, seed=2)
    ids[3, 1] = -1
    recipe = [{"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}},
              {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "mxfp8"}}]
    with standin.use_reference_deep_gemm("vllm-0.33"):
        experts = _make(vllm_module, vllm_config, _prefix(), weights)
        holder = torch.nn.Module()
        holder.experts = experts
        moewire.quantize(holder, recipe)
        keep = x.clone()
        y = experts(x, w, ids)
        assert torch.equal(x, keep)
        buf = experts.get_symm_buffer()
        rows = layout.combine_rows(buf, "vllm-0.33", "nvfp4_mega_moe")
        want = resum(rows, buf.topk_idx[:8], 8, weights=buf.topk_weights,
                     row_quantizer=formats.get("mxfp8").qdq)
        # The dispatch quantizer reached prepare_megamoe_nvfp4_inputs: the staged tokens
        # are those of the MXFP8-quantized hidden states.
        _, ref = _reference(weights, formats.get("mxfp8").qdq(x), w, ids)
        ref_buf = ref.get_symm_buffer()
        assert torch.equal(buf.x[:8], ref_buf.x[:8]) and torch.equal(buf.x_sf[:8],
                                                                      ref_buf.x_sf[:8])
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


def test_nvfp4_calibration_sees_unweighted_rows(vllm_config, vllm_module):
    import moewire
    from moewire.megamoe import layout, quant_experts

    weights = _weights()
    x, ids, w = _routing(8, seed=4)
    with standin.use_reference_deep_gemm("vllm-0.33"):
        experts = _make(vllm_module, vllm_config, _prefix(), weights)
        holder = torch.nn.Module()
        holder.experts = experts
        moewire.quantize(holder, [{"quantizer_name": "*combine_quantizer",
                                   "cfg": {"format": "nvfp4"}}],
                         forward_loop=lambda m: m.experts(x, w * 3.0, ids))
        buf = experts.get_symm_buffer()
        rows = layout.combine_rows(buf, "vllm-0.33", "nvfp4_mega_moe")
    amax = float(experts.combine_quantizer.static_amax)
    assert amax == float(rows[:, :8].float().abs().max())
    assert quant_experts.amax_rows(experts) == "unweighted"
