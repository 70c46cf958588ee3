"""A small model of stand-in Mega-MoE layers, a calibration loop, and a model snapshot."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from moewire.megamoe.api import quantizers
from moewire.reference import MegaMoEExperts

E, K, H, INTER, TMAX = 8, 4, 128, 128, 24

FP8 = {"num_bits": (4, 3)}
NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
RECIPE = {"quant_cfg": [
    {"quantizer_name": "*dispatch_quantizer", "cfg": FP8},
    {"quantizer_name": "*combine_quantizer", "cfg": NVFP4},
]}


def seed_of(text: str) -> int:
    return zlib.crc32(text.encode())


class Model(nn.Module):
    """``layers.<i>.experts``: ``n`` stand-in experts modules (bf16 x bf16, H = 128)."""

    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Module() for _ in range(n))
        for j, layer in enumerate(self.layers):
            layer.experts = MegaMoEExperts(E, K, H, INTER, TMAX, mma_type="bf16xbf16", seed=j)

    def forward(self, x, w, ids):
        return [layer.experts(x, w, ids) for layer in self.layers]


def batch(t: int, seed: int, scale: float = 1.0):
    """BF16 tokens [t, H], FP32 router weights and int64 ids [t, K] with some slots -1."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, H, generator=g) * scale).bfloat16()
    w, ids = torch.randn(t, E, generator=g).softmax(-1).topk(K)
    ids = torch.where(torch.rand(t, K, generator=g) < 0.2, -1, ids)
    return x, w.float(), ids


def loop(model: nn.Module) -> None:
    for step in range(2):
        model(*batch(16, seed_of(f"calib{step}"), scale=1.0 + step))


def calibrated(n: int = 2, recipe=RECIPE) -> Model:
    import moewire

    return moewire.quantize(Model(n), recipe, forward_loop=loop)


def snapshot(model: nn.Module) -> list[tuple]:
    """Everything a load or quantize may change: class, each quantizer's object, format,
    mode, amax bits and amax source."""
    out = [(name, type(m).__name__) for name, m in model.named_modules()]
    for name, _, q in quantizers(model):
        out.append((name, id(q), q.fmt.name, q.mode, q.has_amax, q.amax_source,
                    q.constant_amax, q.amax.clone().view(torch.int32).item()))
    return out


def outputs(model: nn.Module, seed: int = 7) -> list[torch.Tensor]:
    return [y.clone() for y in model(*batch(12, seed))]


TRIED = {"cases": 0}


def tried(n: int = 1) -> None:
    """Count ``n`` cases (a parametrized case, or one hypothesis example)."""
    TRIED["cases"] += n
