"""The stand-in kernels' expert weights, dequantized once and cached.

:class:`Experts` hands out one expert's FP32 ``[N, K]`` weight from DeepGEMM's packed
layout (FP4 or FP8 elements with UE8M0 scales, gate and up interleaved in L1); the dense
copy is kept in :data:`WEIGHT_CACHE`, an LRU cache of at most
``MOEWIRE_REFERENCE_WEIGHT_CACHE_BYTES`` bytes whose entries hold their source tensors
weakly, die with them (a weak-reference callback), and are rebuilt after an in-place write
to a source (its ``_version`` changes). ``_kernel`` and ``nvfp4.mega_moe`` use it.

May import: torch and ``moewire.reference._numerics``.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from typing import Any

import torch

from moewire.reference._numerics import (
    dequantize_weight,
)

ENV_CACHE_BYTES = "MOEWIRE_REFERENCE_WEIGHT_CACHE_BYTES"
_DEFAULT_CACHE_BYTES = {"cpu": 1 << 30, "cuda": 16 << 30}


def _as_experts(weights: Any) -> Any:
    """A shared expert's 2-D weights as one expert ``[1, N, K]``; 3-D ones unchanged."""
    if isinstance(weights, tuple):
        return tuple(w.unsqueeze(0) if w.dim() == 2 else w for w in weights)
    return weights.unsqueeze(0) if weights.dim() == 2 else weights


def _untranspose_sf(sf: torch.Tensor) -> torch.Tensor:
    """Undo the UTCCP row permutation of ``deep_gemm.transform_weights_for_mega_moe``."""
    g, mn, cols = sf.shape
    return sf.reshape(g, mn // 128, 32, 4, cols).transpose(2, 3).reshape(g, mn, cols)


def _uninterleave_gate_up(t: torch.Tensor, gran: int = 8) -> torch.Tensor:
    """``[g0..7, u0..7, g8..15, ...]`` rows -> ``[gate | up]`` rows."""
    g, n, k = t.shape
    blocks = t.reshape(g, n // (2 * gran), 2, gran, k)
    return torch.cat([blocks[:, :, 0], blocks[:, :, 1]], dim=1).reshape(g, n, k)


def _dequantize_experts(weights: Any, first: int, last: int, is_l1: bool) -> torch.Tensor:
    """FP32 ``[last - first, N, K]`` of experts ``first..last-1`` in ``[gate | up]`` order."""
    weights = _as_experts(weights)
    if isinstance(weights, tuple):
        w, sf = weights[0][first:last], weights[1][first:last]
        dense = dequantize_weight(w, _untranspose_sf(sf))
    else:
        dense = weights[first:last].float()
    return _uninterleave_gate_up(dense) if is_l1 else dense


class _WeightCache:
    """Dequantized weights, keyed by the identity and version of the source tensors.

    Holds at most ``budget`` bytes (LRU). Entries die with their source tensors, and a new
    in-place write to a source (its ``_version`` changes) invalidates its entry.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple, tuple[list, tuple, torch.Tensor]] = OrderedDict()
        self._bytes = 0

    @staticmethod
    def budget(device: torch.device) -> int:
        env = os.environ.get(ENV_CACHE_BYTES)
        if env:
            return int(env)
        return _DEFAULT_CACHE_BYTES.get(device.type, _DEFAULT_CACHE_BYTES["cuda"])

    def get(self, sources: tuple[torch.Tensor, ...], build, nbytes: int, device) -> Any:
        key = tuple(id(s) for s in sources)
        versions = tuple(s._version for s in sources)
        entry = self._entries.get(key)
        if entry is not None:
            refs, cached_versions, value = entry
            if all(r() is s for r, s in zip(refs, sources, strict=True)) and (
                cached_versions == versions
            ):
                self._entries.move_to_end(key)
                return value
            self._drop(key)
        budget = self.budget(device)
        if nbytes > budget:
            return None
        value = build()
        while self._entries and self._bytes + nbytes > budget:
            self._drop(next(iter(self._entries)))
        refs = [weakref.ref(s, lambda _r, key=key: self._drop(key)) for s in sources]
        self._entries[key] = (refs, versions, value)
        self._bytes += nbytes
        return value

    def _drop(self, key: tuple) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry[2].numel() * entry[2].element_size()

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


WEIGHT_CACHE = _WeightCache()


class Experts:
    """One set of expert weights (routed, or a 2-D shared one) handing out ``[N, K]``.

    The cached dense copy is FP32 on CPU and BF16 on CUDA: every weight is
    ``element * 2^e`` (FP4/FP8 elements, UE8M0 scales), exact in both, and CUDA's grouped
    GEMM takes BF16 operands (torch 2.11 has no FP32 one on SM90) while still accumulating
    in FP32.
    """

    def __init__(self, weights: Any, is_l1: bool, num_experts: int, n: int, k: int) -> None:
        self.weights = weights
        self.is_l1 = is_l1
        self.n = n
        sources = weights if isinstance(weights, tuple) else (weights,)
        device = sources[0].device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.dense = WEIGHT_CACHE.get(
            sources,
            lambda: self._dequantize_all(num_experts),
            num_experts * n * k * self.dtype.itemsize,
            device,
        )

    def _dequantize_all(self, num_experts: int) -> torch.Tensor:
        first = _dequantize_experts(self.weights, 0, 1, self.is_l1).to(self.dtype)
        dense = torch.empty((num_experts, *first.shape[1:]), dtype=self.dtype,
                            device=first.device)
        dense[:1] = first
        # Two experts at a time keep the temporary unpacking tensors small.
        for e in range(1, num_experts, 2):
            last = min(e + 2, num_experts)
            dense[e:last] = _dequantize_experts(self.weights, e, last, self.is_l1)
        return dense

    def __getitem__(self, e: int) -> torch.Tensor:
        """FP32 ``[N, K]`` of expert ``e``."""
        if self.dense is not None:
            return self.dense[e].float()
        return _dequantize_experts(self.weights, e, e + 1, self.is_l1)[0]
