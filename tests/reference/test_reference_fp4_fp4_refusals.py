"""Every refusal of the stand-in NVFP4 x NVFP4 Mega-MoE (buffer, staging, kernel, experts)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fp4_fp4_cases import SMALL, buffer, cached_weights
from reference_cases import routing, tokens

from moewire.reference import deep_gemm
from moewire.reference.fp4_fp4.buffer import FP4SymmBuffer
from moewire.reference.fp4_fp4.experts import FP4MegaMoEExperts
from moewire.reference.fp4_fp4.staging import prepare_megamoe_nvfp4_inputs

E, K, H, INTER = (SMALL[k] for k in ("num_experts", "num_topk", "hidden", "intermediate"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden": 256}, "hidden=256 must be a multiple of 512"),
        ({"intermediate_hidden": 768}, "intermediate_hidden=768 must be a multiple of 512"),
        ({"activation": "situ"}, "activation='swiglu'"),
        ({"num_experts": 2}, "num_topk=3 exceeds"),
        ({"num_topk": 32, "num_experts": 64, "num_shared_experts": 1}, "one warp"),
    ],
    ids=["hidden", "intermediate", "situ", "topk-over-experts", "topk-plus-shared-over-32"],
)
def test_buffer_refusals(kwargs, match):
    args = {"group": None, "num_experts": E, "num_max_tokens_per_rank": 8, "num_topk": K,
            "hidden": H, "intermediate_hidden": INTER, "device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=match):
        FP4SymmBuffer(**args)


@pytest.mark.parametrize("flavour", ["vllm-0.33", "deepgemm-main"], ids=["vllm-0.33", "main"])
def test_an_fp4xfp4_buffer_needs_the_28_build(flavour):
    with deep_gemm.use_flavour(flavour), pytest.raises(ValueError, match="no mma_type='fp4xfp4'"):
        deep_gemm.get_symm_buffer_for_mega_moe(None, E, 8, K, H, INTER, mma_type="fp4xfp4",
                                               device="cpu")


def test_the_experts_module_builds_its_buffer_on_the_28_build():
    """The module's kernel is DeepGEMM 2.8.0's whatever the stand-in's other kernels imitate;
    a direct fp4xfp4 buffer still needs that build (above)."""
    with deep_gemm.use_flavour("vllm-0.33"):
        experts = FP4MegaMoEExperts(E, K, H, INTER, 8, device="cpu")
    assert experts.get_symm_buffer()._moewire_flavour == "deepgemm-2.8"


@pytest.mark.parametrize(
    ("hidden", "ids_shape", "match"),
    [(384, (4, K), "multiple of 256"), (512, (4, K + 1), "same shape")],
    ids=["hidden-384", "topk-shapes"],
)
def test_staging_refusals(hidden, ids_shape, match):
    x = torch.zeros((4, hidden), dtype=torch.bfloat16)
    ids = torch.zeros(ids_shape, dtype=torch.int64)
    w = torch.zeros((4, K))
    out = torch.empty(0)
    with pytest.raises(ValueError, match=match):
        prepare_megamoe_nvfp4_inputs(x, w, ids, out, out, out, out)


@dataclasses.dataclass
class _Call:
    buf: object
    weights: object
    kwargs: dict


def _call(shared: bool = False) -> _Call:
    buf = buffer(shared=shared)
    weights = cached_weights(E, H, INTER, num_shared_experts=int(shared), seed=5, device="cpu")
    t = 6
    x = tokens(t, H, seed=1)
    ids, w = routing(t, E, K, seed=1)
    prepare_megamoe_nvfp4_inputs(x, w, ids, buf.x[:t], buf.x_sf[:t], buf.topk_idx[:t],
                                 buf.topk_weights[:t])
    kwargs = {"y": torch.empty((t, H), dtype=torch.bfloat16), "l1_weights": weights.l1,
              "l2_weights": weights.l2, "sym_buffer": buf}
    if shared:
        kwargs.update(shared_l1_weights=weights.shared_l1,
                      shared_l2_weights=weights.shared_l2, x_bf16=x)
    return _Call(buf, weights, kwargs)


def _bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.bfloat16)


KERNEL_REFUSALS = {
    "nvfp4-buffer": (lambda c: {"sym_buffer": deep_gemm.NVFP4SymmBuffer(
        None, E, 8, K, H, INTER, device="cpu")}, "requires an fp4xfp4 symmetric buffer"),
    "recipe": (lambda c: {"recipe": (1, 1, 32)}, r"recipe must be \(1, 1, 16\)"),
    "activation": (lambda c: {"activation": "situ"}, "activation mismatch"),
    "x-bf16-alone": (lambda c: {"x_bf16": torch.zeros((6, H), dtype=torch.bfloat16)},
                     "must be given together"),
    "shared-count": (lambda c: {"shared_l1_weights": _bf16(2 * INTER, H),
                                "shared_l2_weights": _bf16(H, INTER), "x_bf16": _bf16(6, H)},
                     "shared-expert layout mismatch"),
    "a2-zero": (lambda c: {"a2_scales": torch.zeros(E)}, "finite and > 0"),
    "a2-shape": (lambda c: {"a2_scales": torch.ones(E, 2)}, "a2_scales must have shape"),
    "l1-alphas-shape": (lambda c: {"l1_alphas": torch.ones(E)}, "l1_alphas must have shape"),
    "rsf-nan": (lambda c: {"routed_scaling_factor": float("nan")}, "finite float"),
    "clamp-negative": (lambda c: {"activation_clamp": -1.0}, "float >= 0"),
    "l1-fp8": (lambda c: {"l1_weights": (c.weights.l1[0].view(torch.float8_e4m3fn),
                                         c.weights.l1[1])}, "l1_weights\\[0\\] must have dtype"),
    "too-many-tokens": (lambda c: {"y": torch.empty((2000, H), dtype=torch.bfloat16)},
                        "num_max_tokens_per_rank=1920"),
}


@pytest.mark.parametrize("name", list(KERNEL_REFUSALS), ids=list(KERNEL_REFUSALS))
def test_kernel_refusals(name):
    change, match = KERNEL_REFUSALS[name]
    call = _call()
    with pytest.raises((ValueError, TypeError), match=match):
        deep_gemm.fp4_fp4_mega_moe(**{**call.kwargs, **change(call)})


def test_shared_weights_must_be_bf16():
    call = _call(shared=True)
    bad = call.kwargs["shared_l1_weights"].float()
    with pytest.raises(TypeError, match="shared_l1_weights must have dtype"):
        deep_gemm.fp4_fp4_mega_moe(**{**call.kwargs, "shared_l1_weights": bad})


def test_out_of_range_ids_are_refused():
    call = _call()
    call.buf.topk_idx[0, 0] = E
    with pytest.raises(ValueError, match="expert ids outside"):
        deep_gemm.fp4_fp4_mega_moe(**call.kwargs)
