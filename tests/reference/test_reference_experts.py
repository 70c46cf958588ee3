"""MegaMoEExperts: vLLM's forward contract on top of the stand-in kernel."""

from __future__ import annotations

import numpy as np
import pytest
import reference_oracle as O
import torch
from reference_cases import cached_weights, routing, tokens

import moewire.reference
from moewire.reference import (
    MegaMoEExperts,
    SharedExpert,
    deep_gemm,
    experts,
    forward_context,
    make_weights,
)

SHAPES = {"num_experts": 8, "top_k": 2, "hidden": 512, "intermediate": 512}


def _layer(**kwargs) -> MegaMoEExperts:
    if "weights" not in kwargs:
        kwargs["weights"] = cached_weights(
            8, 512, 512, mma_type=kwargs.get("mma_type", "fp8xfp4"),
            num_shared_experts=kwargs.get("num_fused_shared_experts", 0),
            seed=kwargs.pop("seed", 1),
        )
    kwargs.pop("seed", None)
    return MegaMoEExperts(**SHAPES, max_num_tokens=kwargs.pop("max_num_tokens", 24),
                          device="cpu", **kwargs)


def _inputs(t: int, seed: int = 0):
    ids, w = routing(t, 8, 2, seed, mask_ratio=0.1)
    return tokens(t, 512, seed), w, ids


def test_exported_at_package_level():
    assert moewire.reference.MegaMoEExperts is experts.MegaMoEExperts


def test_forward_equals_staging_plus_kernel_call():
    layer = _layer()
    x, w, ids = _inputs(19)
    y = layer(x, w, ids)
    buf = layer.get_symm_buffer()
    q, sf = deep_gemm.per_token_cast_to_fp8(x, True, 32, True)
    assert torch.equal(buf.x[:19].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(buf.x_sf[:19], sf) and torch.equal(buf.topk_idx[:19], ids)
    np.testing.assert_array_equal(O.resum(buf, ids.numpy(), 19), O.np_bytes(y).view(np.uint16))
    assert y.dtype == torch.bfloat16 and y.shape == (19, 512)
    assert layer.kernel_name == "fp8_fp4_mega_moe" and not layer.fused_shared
    assert layer.ep_group is None and layer.max_num_tokens == 24


def test_padding_from_forward_context_masks_every_slot():
    layer = _layer()
    x, w, ids = _inputs(10, seed=2)
    pad = torch.zeros(16, dtype=torch.bool)
    pad[[3, 7]] = True
    with forward_context(is_padding=pad):
        y = layer(x, w, ids)
    assert (layer.symm_buffer.topk_idx[[3, 7]] == -1).all()
    assert (y[[3, 7]] == 0).all() and (y[[0, 1]] != 0).any()
    assert experts.get_forward_context().is_padding is None


def test_unfused_shared_expert_is_added_after_the_kernel():
    layer = _layer()
    shared = SharedExpert(512, 256, seed=3)
    x, w, ids = _inputs(12, seed=4)
    routed = layer(x, w, ids)
    with torch.no_grad():
        total = layer(x, w, ids, shared_experts=shared)
        expected = routed.clone()
        expected += shared(x)
    assert torch.equal(total, expected)


def test_fused_shared_expert_uses_its_own_slot():
    layer = _layer(num_fused_shared_experts=1)
    x, w, ids = _inputs(9, seed=5)
    y = layer(x, w, ids)
    buf = layer.get_symm_buffer()
    assert layer.fused_shared and buf.num_shared_experts == 1
    np.testing.assert_array_equal(O.resum(buf, ids.numpy(), 9), O.np_bytes(y).view(np.uint16))
    ids_all_masked = torch.full_like(ids, -1)
    y_shared_only = layer(x, w, ids_all_masked)
    assert (y_shared_only != 0).any()  # the shared slot is always valid


def test_layers_of_the_same_shapes_share_one_buffer():
    a, b = _layer(seed=1), _layer(seed=2)
    c = _layer(seed=1, max_num_tokens=400)
    assert a.get_symm_buffer() is b.get_symm_buffer()
    assert c.get_symm_buffer() is not a.get_symm_buffer()
    with deep_gemm.use_flavour("vllm-0.32"):
        d = _layer(seed=1)
    assert d.get_symm_buffer() is not a.get_symm_buffer()
    assert d.get_symm_buffer()._moewire_flavour == "vllm-0.32"


def test_staging_and_kernel_are_looked_up_at_call_time(monkeypatch):
    layer = _layer()
    x, w, ids = _inputs(8, seed=6)
    calls = []
    real_stage, real_dg = experts.stage_mega_moe_inputs, experts.deep_gemm

    def stage(hidden_states, *args):
        calls.append("stage")
        real_stage(hidden_states, *args)

    class Namespace:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real_dg, name)

    monkeypatch.setattr(experts, "stage_mega_moe_inputs", stage)
    monkeypatch.setattr(experts, "deep_gemm", Namespace())
    layer(x, w, ids)
    assert calls == ["stage", "fp8_fp4_mega_moe"]


def test_bf16_layer_and_clamp():
    layer = _layer(mma_type="bf16xbf16", activation_clamp=0.5)
    x, w, ids = _inputs(7, seed=7)
    y = layer(x, w, ids)
    assert layer.kernel_name == "bf16_mega_moe"
    assert torch.equal(layer.symm_buffer.x[:7], x)
    unclamped = _layer(mma_type="bf16xbf16")(x, w, ids)
    assert not torch.equal(y, unclamped)


def test_make_weights_is_seeded_per_expert():
    all_experts = cached_weights(8, 512, 512, seed=9)
    upper = make_weights(8, 512, 512, seed=9, experts=range(4, 8))
    assert torch.equal(all_experts.l1[0][4:], upper.l1[0])
    assert torch.equal(all_experts.l2[1][4:], upper.l2[1])
    other = make_weights(8, 512, 512, seed=10, experts=range(4, 6))
    assert not torch.equal(other.l1[0], upper.l1[0][:2])
    assert all_experts.l1[0].dtype == torch.int8 and all_experts.l1[1].dtype == torch.int32
    assert all_experts.l1[0].shape == (8, 1024, 256) and all_experts.l1[1].shape == (8, 1024, 4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_num_tokens": 4}, "max_num_tokens=4"),
        ({"dtype": torch.float32}, "dtype"),
    ],
    ids=["too-many-tokens", "wrong-dtype"],
)
def test_forward_refusals(kwargs, match):
    layer = _layer(**kwargs)
    x, w, ids = _inputs(6, seed=8)
    with pytest.raises((ValueError, TypeError), match=match):
        layer(x, w, ids)


@pytest.mark.parametrize(
    "weights_kwargs,layer_kwargs,match",
    [
        ({"experts": range(4)}, {}, "owns"),
        ({"mma_type": "bf16xbf16"}, {}, "mma_type"),
        ({"num_shared_experts": 1}, {}, "shared"),
    ],
    ids=["wrong-experts", "wrong-mma", "unexpected-shared"],
)
def test_constructor_refusals(weights_kwargs, layer_kwargs, match):
    weights = make_weights(8, 512, 512, **weights_kwargs) if "experts" in weights_kwargs else (
        cached_weights(8, 512, 512, **weights_kwargs)
    )
    with pytest.raises(ValueError, match=match):
        _layer(weights=weights, **layer_kwargs)
