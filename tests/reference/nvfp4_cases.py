"""Builders for the stand-in NVFP4 kernel tests: buffer, weights, staging and a kernel call."""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from reference_cases import routing, tokens

from moewire.reference import deep_gemm, make_nvfp4_weights, prepare_megamoe_nvfp4_inputs

SMALL = {"num_experts": 8, "num_topk": 3, "hidden": 256, "intermediate": 256}
SHARED = {"routed": None, "mxfp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}


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
    l2_alpha: torch.Tensor
    y: torch.Tensor | None
    clamp: float | None
    l2_activation_scale: float
    shared_sf_rows: torch.Tensor | None


@functools.lru_cache(maxsize=8)
def cached_weights(*args, **kwargs):
    return make_nvfp4_weights(*args, **kwargs)


def stage(buf, x, ids, w, weights, l2_alpha, l2_activation_scale, group_size=1,
          is_padding=None):
    """Stage ``x`` as vLLM 0.34's ``DeepGemmMegaMoEExperts.forward`` does."""
    t = x.shape[0]
    shared_x = shared_x_sf = block_m = None
    if buf.num_shared_experts:
        shared_x = buf.shared_l1_acts[:t]
        if buf.shared_with_sf:
            shared_x_sf = buf.shared_l1_acts_sf
            block_m = deep_gemm.get_block_m_for_nvfp4_mega_moe(
                group_size, buf.num_experts, buf.num_max_tokens_per_rank, t, buf.num_topk
            )
    prepare_megamoe_nvfp4_inputs(
        x, w, ids, buf.x[:t], buf.x_sf[:t], buf.x_scales[:t], buf.topk_idx[:t],
        buf.topk_weights[:t], is_padding=is_padding, shared_x=shared_x,
        shared_x_sf=shared_x_sf, shared_block_m=block_m,
        w2_global_scale=weights.l2_global_scale, l2_alpha=l2_alpha,
        l2_activation_scale=l2_activation_scale,
    )
    if block_m is None:
        return None
    from moewire.reference.nvfp4.mega_moe import shared_sf_row

    return shared_sf_row(torch.arange(t), block_m)


def run(buf, weights, t, l2_alpha, clamp=None, l2_activation_scale=1.0, **kwargs):
    y = torch.empty((t, buf.hidden), dtype=torch.bfloat16, device=buf.buffer.device)
    if weights.shared_l1 is not None:
        kwargs.update(shared_l1_weights=weights.shared_l1, shared_l2_weights=weights.shared_l2)
    deep_gemm.nvfp4_mega_moe(
        y, weights.l1, weights.l2, buf, activation_clamp=clamp, l1_alpha=weights.l1_global_scale,
        l2_alpha=l2_alpha, l2_activation_scale=l2_activation_scale, use_x_scales=True, **kwargs,
    )
    return y


def build(*, t: int = 29, shared: str = "routed", seed: str = "case", tmax: int | None = None,
          clamp: float | None = None, l2_activation_scale: float = 1.0, mask_ratio: float = 0.2,
          run_kernel: bool = True, is_padding: torch.Tensor | None = None, **shapes) -> Case:
    s = {**SMALL, **shapes}
    shared_dtype = SHARED[shared]
    n_shared = 0 if shared_dtype is None else 1
    buf = deep_gemm.NVFP4SymmBuffer(
        None, s["num_experts"], tmax or max(t, 1), s["num_topk"], s["hidden"],
        s["intermediate"], num_shared_experts=n_shared,
        shared_dtype=shared_dtype or torch.float8_e4m3fn, device="cpu",
    )
    weights = cached_weights(
        s["num_experts"], s["hidden"], s["intermediate"], num_shared_experts=n_shared,
        shared_dtype=shared_dtype or torch.float8_e4m3fn, seed=1,
    )
    base = seed_of(seed) % 100_000
    x = tokens(t, s["hidden"], base)
    ids, w = routing(t, s["num_experts"], s["num_topk"], base, mask_ratio)
    l2_alpha = torch.empty(s["num_experts"], dtype=torch.float32)
    rows = stage(buf, x, ids, w, weights, l2_alpha, l2_activation_scale, is_padding=is_padding)
    y = run(buf, weights, t, l2_alpha, clamp, l2_activation_scale) if run_kernel else None
    return Case(buf, weights, t, x, ids, w, l2_alpha, y, clamp, l2_activation_scale, rows)
