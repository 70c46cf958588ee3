"""A small model of stand-in Mega-MoE layers, inputs, and test-only buffer access."""

from __future__ import annotations

import torch
from torch import nn

from moewire.reference import MegaMoEExperts, SharedExpert

E, K, TMAX_REQ = 8, 4, 24
SHAPES = {"bf16xbf16": (128, 128), "fp8xfp4": (512, 512)}


def make_experts(mma="bf16xbf16", seed=0, fused=0, max_tokens=TMAX_REQ, group=None, device="cpu"):
    h, i = SHAPES[mma]
    return MegaMoEExperts(
        E,
        K,
        h,
        i,
        max_tokens,
        mma_type=mma,
        seed=seed,
        num_fused_shared_experts=fused,
        device=device,
        group=group,
    )


class Layer(nn.Module):
    def __init__(self, experts: nn.Module, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.experts = experts
        self.shared = shared

    def forward(self, x, w, ids):
        return self.experts(x, w, ids, shared_experts=self.shared)


class Model(nn.Module):
    """``layers.<i>.experts``: stand-in experts of identical shapes (one shared buffer)."""

    def __init__(self, n=2, mma="bf16xbf16", fused=0, shared=False, group=None):
        super().__init__()
        h, i = SHAPES[mma]
        self.layers = nn.ModuleList(
            Layer(
                make_experts(mma, seed=j, fused=fused, group=group),
                SharedExpert(h, i, seed=j) if shared else None,
            )
            for j in range(n)
        )

    def forward(self, x, w, ids):
        return [layer(x, w, ids) for layer in self.layers]


def batch(t, hidden, seed, masked=0.2, scale=1.0):
    """BF16 tokens, FP32 router weights and int64 ids ``[t, K]`` with some slots -1."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, hidden, generator=g) * scale).bfloat16()
    w, ids = torch.randn(t, E, generator=g).softmax(-1).topk(K)
    ids = torch.where(torch.rand(t, K, generator=g) < masked, -1, ids)
    return x, w.float(), ids


def region(buf) -> torch.Tensor:
    """The combine region from the stand-in's own bookkeeping (test-only)."""
    start, nbytes = buf._moewire_regions["combine"]
    return (
        buf.buffer[start : start + nbytes]
        .view(torch.bfloat16)
        .view(buf.num_slots, buf.num_max_tokens_per_rank, buf.hidden)
    )
