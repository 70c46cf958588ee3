"""The stand-in's NVFP4 x NVFP4 Mega-MoE buffer: DeepGEMM 2.8.0's ``SymmBuffer`` built with
``mma_type="fp4xfp4"`` (``deep_gemm.get_symm_buffer_for_mega_moe``).

Read from deepseek-ai/DeepGEMM 0274ad7 (2.8.0): ``deep_gemm/mega/__init__.py`` (``SymmBuffer``:
``Tmax`` aligned to ``get_token_alignment_for_mega_moe()``, the twelve views), ``csrc/apis/
mega_moe.hpp`` (``get_symm_buffer_size_for_mega_moe``: the views' dtypes and strides, H and I
multiples of 512 for NVFP4) and ``deep_gemm/include/deep_gemm/layout/mega_moe.cuh``
(``MegaMoEBuffer`` with 4-bit routed elements, 16-element scales and a BF16 shared expert;
``kLCMCandidateBlockM = 1920``). The NVFP4-only layout of PR #409 (794783a,
``layout/nvfp4_mega_moe.cuh``) orders the same regions the same way.

May import: torch and the reference modules below the ``deep_gemm`` API
(``moewire.reference._alloc``, ``moewire.reference.buffer``) and the family's package.
"""

from __future__ import annotations

from typing import Any

import torch

from moewire.reference._alloc import (
    align,
    check_buffer_sizes,
    check_split,
    default_device,
    group_size_rank,
)
from moewire.reference._alloc import fail as _fail
from moewire.reference.buffer import Region, RegionBuffer
from moewire.reference.fp4_fp4 import FLAVOUR

__all__ = ["FP4SymmBuffer", "TOKEN_ALIGNMENT"]

#: ``layout/mega_moe.cuh`` (0274ad7): the LCM of the candidate BLOCK_M values.
TOKEN_ALIGNMENT = 1920
#: NVFP4 hidden and intermediate sizes are multiples of 512 (``mega_moe.hpp``,
#: ``sf_alignment``: the smallest-token heuristic's K tile).
SIZE_MULTIPLE = 512
# Regions the views are MN-major in (strides ``(1, rows)``: ``mega_moe.hpp`` slices
# ``l1_acts_sf`` and ``l2_acts_sf`` so).
_MN_MAJOR = ("l1_acts_sf", "l2_acts_sf")


class FP4SymmBuffer(RegionBuffer):
    """One rank's ``fp4xfp4`` Mega-MoE buffer: a flat int8 tensor and typed views into it.

    Constructor as DeepGEMM 2.8.0's ``SymmBuffer`` (``mma_type="fp4xfp4"``), plus the keyword
    ``device``; ``num_max_tokens_per_rank`` is aligned up to 1920 here, as there. Regions in
    the order of ``layout/mega_moe.cuh`` (``R`` ranks, ``Tmax`` the aligned capacity, ``Is =
    num_shared_experts * I``, ``N = R * Tmax * k`` rows: every row a rank can receive; the
    real ring is smaller and reused):

    ``workspace`` (int32 ``[align(E_local, 4)]``: rows received per local expert by the last
    call; the real one holds the kernel's signals and metadata), ``routed_topk_weights``
    (FP32 ``[N]``, no view: the received rows' router weights, applied after L2), ``x``
    (uint8 ``[Tmax, H/2]``, packed E2M1), ``x_sf`` (int32 ``[Tmax, H/64]``, four E4M3 bytes per
    int), ``topk_idx`` (int64 ``[Tmax, k]``), ``topk_weights`` (FP32 ``[Tmax, k]``),
    ``shared_l2_acts`` (BF16 ``[Tmax, Is]``, with a fused shared expert only), ``l1_acts`` /
    ``l1_acts_sf`` (uint8 ``[N, H/2]`` / int32 ``[N, H/64]`` MN-major), ``l2_acts`` /
    ``l2_acts_sf`` (uint8 ``[N, I/2]`` / int32 ``[N, I/64]`` MN-major), then the combine region
    (BF16 ``[num_slots, Tmax, H]``, no view), which is the buffer's last: it starts where
    ``l2_acts_sf`` ends. ``shared_l1_acts``, ``shared_l1_acts_sf`` and ``shared_l2_acts_sf``
    are ``None`` (DeepGEMM returns undefined tensors: the shared expert is BF16 and reads the
    caller's ``x_bf16``), as is ``shared_l2_acts`` without a shared expert.

    Attributes:
        group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
        num_shared_experts, mma_type (``"fp4xfp4"``), activation (``"swiglu"``): as given
        (``num_max_tokens_per_rank`` aligned).
        buffer: int8 ``[nbytes]``; handle: the symmetric-memory handle or None.
        num_ranks, rank, num_experts_per_rank, num_slots: derived.
        _moewire_flavour: ``"deepgemm-2.8"``; _moewire_regions: ``{name: (offset, size)}``.
    """

    _HIDDEN = ("combine", "routed_topk_weights")

    def __init__(
        self,
        group: Any,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        hidden: int,
        intermediate_hidden: int,
        num_shared_experts: int = 0,
        mma_type: str = "fp4xfp4",
        activation: str = "swiglu",
        base: FP4SymmBuffer | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        where = "SymmBuffer(mma_type='fp4xfp4')"
        num_ranks, _ = group_size_rank(group, where)
        check_buffer_sizes(
            where, num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank,
            num_topk=num_topk, hidden=hidden, intermediate_hidden=intermediate_hidden,
            num_shared_experts=num_shared_experts,
        )
        if mma_type != "fp4xfp4" or activation != "swiglu":
            _fail(
                where,
                f"the NVFP4 x NVFP4 buffer takes mma_type='fp4xfp4' and activation='swiglu', "
                f"got {mma_type!r} and {activation!r}",
            )
        check_split(where, num_experts, num_ranks, num_topk, num_shared_experts)
        for name, value in (("hidden", hidden), ("intermediate_hidden", intermediate_hidden)):
            if value % SIZE_MULTIPLE:
                _fail(where, f"{name}={value} must be a multiple of {SIZE_MULTIPLE} for NVFP4")
        self._set_sizes(
            group, where, num_experts, align(num_max_tokens_per_rank, TOKEN_ALIGNMENT),
            num_topk, hidden, intermediate_hidden,
        )
        self._set_experts(num_shared_experts)
        self.mma_type = mma_type
        self.activation = activation
        self._moewire_flavour = FLAVOUR
        offset = self._lay_out()
        if base is None:
            self._allocate(offset, torch.device(device) if device is not None
                           else default_device(group))
        else:
            if not isinstance(base, FP4SymmBuffer) or base.buffer is None or (
                base.group is not group
            ):
                _fail(where, "base must be a live fp4xfp4 SymmBuffer of the same group")
            self._share(base, offset, where)
        self._slice_views()
        for name in ("shared_l1_acts", "shared_l1_acts_sf", "shared_l2_acts_sf"):
            setattr(self, name, None)

    @property
    def num_rows(self) -> int:
        """``N``: the rows this rank can receive (every rank's tokens times ``k``)."""
        return self.num_ranks * self.num_max_tokens_per_rank * self.num_topk

    def _regions(self) -> list[Region]:
        tmax, k, h, i = (
            self.num_max_tokens_per_rank, self.num_topk, self.hidden, self.intermediate_hidden
        )
        n = self.num_rows
        shared = self.num_shared_experts > 0
        return [
            ("workspace", torch.int32, (align(self.num_experts_per_rank, 4),)),
            ("routed_topk_weights", torch.float32, (n,)),
            ("x", torch.uint8, (tmax, h // 2)),
            ("x_sf", torch.int32, (tmax, h // 64)),
            ("topk_idx", torch.int64, (tmax, k)),
            ("topk_weights", torch.float32, (tmax, k)),
            ("shared_l2_acts", torch.bfloat16, (tmax, self.num_shared_experts * i))
            if shared else ("shared_l2_acts", None, None),
            ("l1_acts", torch.uint8, (n, h // 2)),
            ("l1_acts_sf", torch.int32, (n, h // 64)),
            ("l2_acts", torch.uint8, (n, i // 2)),
            ("l2_acts_sf", torch.int32, (n, i // 64)),
            ("combine", torch.bfloat16, (self.num_slots, tmax, h)),
        ]

    def _slice_views(self) -> None:
        super()._slice_views()
        if self.buffer is None:
            return
        for name in _MN_MAJOR:
            rows, cols = getattr(self, name).shape
            setattr(self, name, self.region(name).view(torch.int32).view(cols, rows).t())

    def __repr__(self) -> str:
        return (
            f"SymmBuffer(mma_type='fp4xfp4', rank={self.rank}/{self.num_ranks}, "
            f"experts={self.num_experts}, Tmax={self.num_max_tokens_per_rank}, "
            f"k={self.num_topk}, H={self.hidden}, I={self.intermediate_hidden}, "
            f"shared={self.num_shared_experts})"
        )
