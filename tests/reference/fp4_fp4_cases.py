"""Builders for the stand-in NVFP4 x NVFP4 kernel tests (DeepGEMM 2.8.0 ``fp4_fp4_mega_moe``)."""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from reference_cases import routing, tokens

from moewire.reference import deep_gemm
from moewire.reference.fp4_fp4.staging import prepare_megamoe_nvfp4_inputs
from moewire.reference.fp4_fp4.weights import make_fp4_fp4_weights

SMALL = {"num_experts": 8, "num_topk": 3, "hidden": 512, "intermediate": 512}


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode())


@dataclass
class Case:
    buf: Any
    weights: Any
    t: int
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    y: torch.Tensor
    clamp: float | None
    a2_scales: torch.Tensor | None
    routed_scaling_factor: float


@functools.lru_cache(maxsize=8)
def cached_weights(*args, **kwargs):
    return make_fp4_fp4_weights(*args, **kwargs)


def buffer(group=None, shared: bool = False, tmax: int = 32, device: str = "cpu"):
    with deep_gemm.use_flavour("deepgemm-2.8"):
        return deep_gemm.get_symm_buffer_for_mega_moe(
            group, SMALL["num_experts"], tmax, SMALL["num_topk"], SMALL["hidden"],
            SMALL["intermediate"], num_shared_experts=int(shared), mma_type="fp4xfp4",
            device=device,
        )


def run(buf, weights, x, clamp=None, a2_scales=None, routed_scaling_factor=1.0, **kwargs):
    t = x.shape[0]
    y = torch.empty((t, buf.hidden), dtype=torch.bfloat16, device=buf.buffer.device)
    if weights.shared_l1 is not None:
        kwargs.update(shared_l1_weights=weights.shared_l1, shared_l2_weights=weights.shared_l2,
                      x_bf16=x.bfloat16())
    deep_gemm.fp4_fp4_mega_moe(
        y, weights.l1, weights.l2, buf, activation_clamp=clamp, l1_alphas=weights.l1_alphas,
        l2_alphas=weights.l2_alphas, a2_scales=a2_scales,
        routed_scaling_factor=routed_scaling_factor, **kwargs,
    )
    return y


def build(*, t: int = 29, shared: bool = False, seed: str = "case", clamp: float | None = None,
          a2: bool = False, routed_scaling_factor: float = 1.0, device: str = "cpu") -> Case:
    """Stage ``t`` tokens the way vLLM main does and run the kernel once."""
    buf = buffer(shared=shared, device=device)
    weights = cached_weights(SMALL["num_experts"], SMALL["hidden"], SMALL["intermediate"],
                             num_shared_experts=int(shared), seed=5, device=device)
    s = seed_of(seed)
    x = tokens(t, SMALL["hidden"], seed=s).to(device)
    ids, w = routing(t, SMALL["num_experts"], SMALL["num_topk"], seed=s)
    ids, w = ids.to(device), w.to(device)
    prepare_megamoe_nvfp4_inputs(x, w, ids, buf.x[:t], buf.x_sf[:t], buf.topk_idx[:t],
                                 buf.topk_weights[:t])
    # a2 values that are not powers of two, so 1 / a2 is inexact in FP32.
    a2_scales = (torch.linspace(0.3, 1.7, SMALL["num_experts"]) if a2 else None)
    if a2_scales is not None:
        a2_scales = a2_scales.to(device)
    y = run(buf, weights, x, clamp, a2_scales, routed_scaling_factor)
    return Case(buf, weights, t, x, ids, w, y, clamp, a2_scales, routed_scaling_factor)
