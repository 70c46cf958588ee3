"""Shared builders for the reference-kernel tests: random tokens, routing and a kernel call."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from moewire.reference import deep_gemm, make_weights, stage_mega_moe_inputs

SMALL = {"num_experts": 8, "num_topk": 3, "hidden": 512, "intermediate": 512}


@dataclass
class Case:
    buf: Any
    weights: Any
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    y: torch.Tensor
    clamp: float | None


def tokens(t: int, hidden: int, seed: int) -> torch.Tensor:
    """BF16 ``[T, H]`` N(0, 1) with three outlier channels 20x larger (as real activations)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((t, hidden), generator=gen)
    x[:, :3] *= 20.0
    return x.bfloat16()


def routing(
    t: int, num_experts: int, k: int, seed: int, mask_ratio: float = 0.2,
    experts: range | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct expert ids per token with a fraction of slots masked (-1, weight 0)."""
    gen = torch.Generator().manual_seed(seed + 7)
    pool = torch.arange(num_experts) if experts is None else torch.tensor(list(experts))
    picks = [pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(t)]
    ids = (torch.stack(picks) if picks else torch.empty((0, k))).long()
    weights = torch.rand((t, k), generator=gen) + 0.05
    masked = torch.rand((t, k), generator=gen) < mask_ratio
    return ids.masked_fill(masked, -1), weights.masked_fill(masked, 0.0)


@functools.lru_cache(maxsize=16)
def cached_weights(*args, **kwargs):
    """make_weights, memoized: the tests that share weights never write to them."""
    return make_weights(*args, **kwargs)


def kernel_name(mma: str) -> str:
    return "fp8_fp4_mega_moe" if mma == "fp8xfp4" else "bf16_mega_moe"


def run_kernel(buf, weights, t: int, clamp: float | None = None) -> torch.Tensor:
    y = torch.empty((t, buf.hidden), dtype=torch.bfloat16, device=buf.buffer.device)
    kwargs = {}
    if weights.shared_l1 is not None:
        kwargs = {"shared_l1_weights": weights.shared_l1, "shared_l2_weights": weights.shared_l2}
    getattr(deep_gemm, kernel_name(buf.mma_type))(
        y, weights.l1, weights.l2, buf, activation_clamp=clamp, **kwargs
    )
    return y


def build(
    *, t: int = 37, flavour: str = "vllm-0.33", mma: str = "fp8xfp4", shared: int = 0,
    seed: int = 0, weights_seed: int = 0, mask_ratio: float = 0.2,
    clamp: float | None = None, tmax: int | None = None,
    run: bool = True, cache_weights: bool = True, **shapes: int,
) -> Case:
    s = {**SMALL, **shapes}
    with deep_gemm.use_flavour(flavour):
        buf = deep_gemm.get_symm_buffer_for_mega_moe(
            None, s["num_experts"], tmax or max(t, 1), s["num_topk"], s["hidden"],
            s["intermediate"], num_shared_experts=shared, mma_type=mma, device="cpu",
        )
    weights = (cached_weights if cache_weights else make_weights)(
        s["num_experts"], s["hidden"], s["intermediate"], mma_type=mma,
        num_shared_experts=shared, seed=weights_seed,
    )
    x = tokens(t, s["hidden"], seed)
    ids, w = routing(t, s["num_experts"], s["num_topk"], seed, mask_ratio)
    stage_mega_moe_inputs(x, ids, w, buf)
    y = run_kernel(buf, weights, t, clamp) if run else None
    return Case(buf, weights, x, ids, w, y, clamp)
