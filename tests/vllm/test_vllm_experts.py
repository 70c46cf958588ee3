"""moewire.integrations.vllm against the real vLLM 0.32 Mega-MoE experts, on CPU."""

from __future__ import annotations

import importlib
import itertools
import os
import re
import tempfile

import _standin as standin
import _vllm_world as _setup
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from _vllm_world import E, H, K

pytestmark = pytest.mark.vllm

vllm_mod = pytest.importorskip("moewire.integrations.vllm")
_layer_ids = itertools.count(1)


def _prefix() -> str:
    # vLLM refuses a duplicate layer name in the static forward context.
    return f"model.layers.{next(_layer_ids)}.ffn.experts"


def test_sites_of_installed_vllm_are_the_real_classes():
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_moe_ep import (
        FlashInferMoeEpExperts,
    )
    from vllm.models.deepseek_v4.amd.mega_moe import DeepseekV4AiterMegaMoEExperts
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4MegaMoEExperts
    from vllm.models.kimi_k3.nvidia.model import KimiK3MegaMoEExperts

    assert vllm_mod.vllm_version().startswith("0.32")
    found = vllm_mod.experts_sites()
    # 0.33/0.34's path does not exist in 0.32: recognised by structure, not by version.
    # 0.32 ships the ROCm aiter Mega-MoE and FlashInfer's MoE-EP modular experts too: each
    # recognised by its module, to be refused.
    assert [cls for cls, _ in found] == [DeepseekV4MegaMoEExperts, KimiK3MegaMoEExperts,
                                         FlashInferMoeEpExperts, DeepseekV4AiterMegaMoEExperts]
    assert [site.refusal is not None for _, site in found] == [False, False, True, True]
    assert issubclass(KimiK3MegaMoEExperts, DeepseekV4MegaMoEExperts)


_SITE = "vllm.models.deepseek_v4.nvidia.model"


@pytest.mark.parametrize(
    "site,why",
    [
        (vllm_mod.ExpertsSite("vllm.no_such_module", "X"), "vllm.no_such_module does not import"),
        (vllm_mod.ExpertsSite(_SITE, "NoSuchExperts"), f"{_SITE} has no NoSuchExperts"),
        (
            vllm_mod.ExpertsSite(_SITE, "DeepseekV4MegaMoEExperts", stage_fn="stage_it"),
            f"{_SITE} has no staging function stage_it",
        ),
    ],
    ids=["no-module", "no-class", "no-staging-function"],
)
def test_unrecognised_structure_is_refused_naming_what_was_looked_for(site, why):
    with pytest.raises(RuntimeError) as info:
        vllm_mod.experts_sites((site,))
    message = str(info.value)
    assert "has no Mega-MoE experts class with the structure moewire hooks" in message
    assert site.path in message and f"calling {site.stage_fn}(...)" in message
    assert why in message


_NO_CALL = """
from torch import nn
def prepare_megamoe_inputs(*args):
    pass
class Experts(nn.Module):
    def forward(self, x):
        return x
"""
_NO_KERNEL = _NO_CALL.replace("return x", "prepare_megamoe_inputs(x)\n        return x")


@pytest.mark.parametrize(
    "source,why",
    [(_NO_CALL, "never calls prepare_megamoe_inputs(...)"),
     (_NO_KERNEL, "does not reach DeepGEMM through _import_deep_gemm()")],
    ids=["staging-never-called", "no-deep-gemm-import"],
)
def test_recognise_reads_the_module_source(source, why, tmp_path, monkeypatch):
    name = f"moewire_fake_experts_{len(why)}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match=re.escape(why)):
        vllm_mod.experts_sites((vllm_mod.ExpertsSite(name, "Experts"),))


def _oracle_stage(x: torch.Tensor, pad: torch.Tensor):
    """float64 / ml_dtypes staging: UE8M0 ``2^ceil(log2(fp32(amax)/448))`` per 32."""
    xf = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.maximum(np.abs(xf).max(-1), np.float32(1e-4)).astype(np.float32)
    ratio = (amax / np.float32(448.0)).astype(np.float32)
    mant, exp = np.frexp(ratio.astype(np.float64))
    e = np.where(mant == 0.5, exp - 1, exp)  # ceil(log2) of an exact float
    q = (xf.astype(np.float64) * np.exp2(-e.astype(np.float64))[..., None]).astype(
        ml_dtypes.float8_e4m3fn
    )
    biased = (e + 127).astype(np.int64).reshape(x.shape[0], -1, 4)
    packed = (biased << (np.arange(4) * 8)).sum(-1).astype(np.uint32).view(np.int32)
    return q.reshape(x.shape[0], -1).view(np.uint8), packed


@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "padding"])
def test_reference_staging_matches_oracle(padding):
    g = torch.Generator().manual_seed(11)
    t = 7
    x = (torch.randn(t, H, generator=g) * torch.logspace(-3, 3, H)).bfloat16()
    ids = torch.randint(0, 4, (t, K), generator=g, dtype=torch.int32)
    w = torch.rand(t, K, generator=g)
    pad = torch.rand(t, generator=g) < 0.4 if padding else torch.zeros(t, dtype=torch.bool)
    x_fp8 = torch.empty(t, H, dtype=torch.float8_e4m3fn)
    x_sf = torch.empty(t, H // 128, dtype=torch.int32)
    idx = torch.empty(t, K, dtype=torch.int64)
    wo = torch.empty(t, K, dtype=torch.float32)
    standin.prepare_megamoe_inputs_reference(
        x, w, ids, x_fp8, x_sf, idx, wo, is_padding=pad if padding else None
    )
    q, packed = _oracle_stage(x, pad)
    np.testing.assert_array_equal(x_fp8.view(torch.uint8).numpy(), q)
    np.testing.assert_array_equal(x_sf.numpy(), packed)
    assert torch.equal(idx, torch.where(pad[:, None], -1, ids.long()))
    assert torch.equal(wo, torch.where(pad[:, None], 0.0, w))


def _forward(experts, x, ids, w, pad=None):
    from vllm.forward_context import create_forward_context, override_forward_context

    config = experts_config()
    with override_forward_context(create_forward_context(None, config, is_padding=pad)):
        return experts(x, w, ids, activation_clamp=10.0)


def experts_config():
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config()


@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "padding"])
def test_real_dsv4_forward_reaches_reference_kernel(vllm_config, padding):
    """vLLM's own forward, staging and backend, through the bridge into the stand-in."""
    vllm_mod.register_vllm_experts()
    experts = _setup.make_experts(vllm_config, prefix=_prefix())
    t = 9
    x, ids, w = _setup.routing(t, seed=3)
    pad = torch.zeros(t, dtype=torch.bool)
    if padding:
        pad[[1, 4, 8]] = True
    with standin.use_reference_deep_gemm("vllm-0.32"):
        experts.finalize_weights()
        y = _forward(experts, x, ids, w, pad if padding else None)
        buffer = experts.get_symm_buffer()
        assert vllm_mod.kernel_flavour(experts) == "vllm-0.32"
    # The stand-in's buffer (reference.buffer.SymmBuffer, exported as deep_gemm.SymmBuffer).
    assert type(buffer) is importlib.import_module("moewire.reference.deep_gemm").SymmBuffer
    assert torch.equal(buffer.topk_idx[:t], torch.where(pad[:, None], -1, ids.long()))
    rows = _setup.oracle_rows(buffer, K)
    expected = _setup.oracle_resum(rows, buffer.topk_idx, t)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
    assert not torch.equal(y[~pad], torch.zeros_like(y[~pad]))
    if padding:
        assert torch.equal(y[pad], torch.zeros_like(y[pad]))


def test_kernel_flavour_without_deep_gemm_is_refused(vllm_config):
    vllm_mod.register_vllm_experts()
    experts = _setup.make_experts(vllm_config, prefix=_prefix())
    with pytest.raises(RuntimeError, match="imports no DeepGEMM"):
        vllm_mod.kernel_flavour(experts)


def test_plugin_does_nothing_without_recipe(monkeypatch):
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    monkeypatch.delenv(vllm_mod.ENV_RECIPE, raising=False)
    before = BaseModelLoader.load_model
    vllm_mod.register()
    assert BaseModelLoader.load_model is before


def test_plugin_entry_point_is_declared():
    entry = [
        e for e in importlib.metadata.entry_points(group="vllm.general_plugins")
        if e.name == "moewire"
    ]
    assert [e.value for e in entry] == ["moewire.integrations.vllm:register"]
    assert entry[0].load() is vllm_mod.register


def _two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    with _setup.vllm_world(rank, 2, init_file) as config:
        vllm_mod.register_vllm_experts()
        experts = _setup.make_experts(config, rank=rank, world_size=2)
        t = 6 + rank
        x, ids, w = _setup.routing(t, seed=20 + rank)
        pad = torch.zeros(t, dtype=torch.bool)
        pad[0] = True
        with standin.use_reference_deep_gemm("vllm-0.32"):
            experts.finalize_weights()
            y = _forward(experts, x, ids, w, pad)
            buffer = experts.get_symm_buffer()
        rows = _setup.oracle_rows(buffer, K)
        expected = _setup.oracle_resum(rows, buffer.topk_idx, t)
        torch.save(
            {"y": y, "expected": expected, "remote": int((ids[~pad] // 2 != rank).sum())},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )


def test_two_rank_gloo_ep_group():
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "init")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_two_rank_worker, args=(r, init_file, out_dir)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        assert [p.exitcode for p in procs] == [0, 0]
        for rank in (0, 1):
            result = torch.load(os.path.join(out_dir, f"rank{rank}.pt"))
            assert torch.equal(result["y"].view(torch.int16), result["expected"].view(torch.int16))
            assert result["remote"] > 0


def test_kimi_k3_situ_forward_is_quantized(vllm_config):
    """Kimi-K3 (a DeepseekV4MegaMoEExperts subclass, SiTU): its real forward runs on the
    stand-in's SiTU kernel; the combine is re-summed from reference-quantized rows."""
    api = pytest.importorskip("moewire.megamoe.api")
    from vllm.models.kimi_k3.nvidia.model import KimiK3MegaMoEExperts

    from moewire.megamoe.registry import adapter_for

    vllm_mod.register_vllm_experts()
    prefix = _prefix()
    experts = KimiK3MegaMoEExperts(
        vllm_config, num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K,
        hidden_size=H, intermediate_size=_setup.INTER, prefix=prefix, activation="situ",
        activation_beta=2.5, activation_linear_beta=1.5,
    )
    reference = _setup.make_experts(vllm_config, prefix=prefix + ".ckpt")
    for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
        getattr(experts, name).data.copy_(getattr(reference, name).data)
    assert adapter_for(experts).name == "vllm-KimiK3MegaMoEExperts"
    model = torch.nn.ModuleDict({"experts": experts})
    x, ids, w = _setup.routing(6, seed=41)
    with standin.use_reference_deep_gemm("vllm-0.32"):
        plain = experts(x, w, ids, activation_clamp=None)
        buffer = experts.get_symm_buffer()
        assert buffer.activation == "situ"
        rows = _setup.oracle_rows(buffer, K).clone()
        assert torch.equal(
            plain.view(torch.int16), _setup.oracle_resum(rows, buffer.topk_idx, 6).view(
                torch.int16)
        )
        api.quantize(model, "moe_combine_mxfp8")
        y = experts(x, w, ids, activation_clamp=None)
    mxfp8 = pytest.importorskip("moewire.formats").get("mxfp8")
    rows = _setup.oracle_rows(buffer, K)[:, :6]
    expected = _setup.oracle_resum(
        torch.stack([mxfp8.reference(r, None) for r in rows]), buffer.topk_idx, 6
    )
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
    assert not torch.equal(y.view(torch.int16), plain.view(torch.int16))


def test_quantize_without_deep_gemm_is_refused(vllm_config):
    vllm_mod.register_vllm_experts()
    model = torch.nn.ModuleDict({"experts": _setup.make_experts(vllm_config, prefix=_prefix())})
    with pytest.raises(RuntimeError, match="vLLM imports no DeepGEMM"):
        vllm_mod.quantize_vllm_model(model, "moe_combine_nvfp4")


def test_bridge_keeps_vllm_behaviour_without_deep_gemm():
    """On a machine with no DeepGEMM vLLM's import returns None, through the bridge too."""
    import vllm.utils.deep_gemm as vllm_deep_gemm
    from vllm.models.deepseek_v4.nvidia import model as dsv4
    from vllm.models.deepseek_v4.nvidia.ops.prepare_megamoe import prepare_megamoe_inputs

    from moewire.integrations.vllm import bridge as _vllm_bridge

    vllm_mod.register_vllm_experts()
    assert vllm_deep_gemm._import_deep_gemm is _vllm_bridge.import_deep_gemm
    assert vllm_deep_gemm._import_deep_gemm() is None
    assert not hasattr(_vllm_bridge, "deep_gemm")
    stage_global = _vllm_bridge.stage_global_name(dsv4.__name__)
    assert getattr(_vllm_bridge, stage_global) is prepare_megamoe_inputs
    assert dsv4.prepare_megamoe_inputs._moewire_trampoline == stage_global
