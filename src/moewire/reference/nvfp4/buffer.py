"""The stand-in's NVFP4 Mega-MoE buffer (``deep_gemm.NVFP4SymmBuffer``) and the numbers
its layout is built from: the token alignment, BLOCK_M, and the shared expert's scale rows.

The layout (``include/deep_gemm/layout/nvfp4_mega_moe.cuh`` of vLLM 0.34.0's bundled DeepGEMM): the
combine region starts where the L2 scale region (``l2_acts_sf``) ends, and the per-token
``x_scales`` regions **follow** it, so the combine region is not the buffer's last region.

May import: torch and the reference modules below the ``deep_gemm`` API
(``moewire.reference._alloc``, ``moewire.reference.buffer``).
"""

from __future__ import annotations

from typing import Any

import torch

from moewire.reference._alloc import align as _align
from moewire.reference._alloc import check_buffer_sizes, check_split
from moewire.reference._alloc import default_device as _default_device
from moewire.reference._alloc import fail as _fail
from moewire.reference._alloc import group_size_rank as _group_size_rank
from moewire.reference.buffer import Region, RegionBuffer, num_max_shared_sf_tokens

__all__ = [
    "NVFP4SymmBuffer",
    "get_block_m_for_nvfp4_mega_moe",
    "get_token_alignment_for_nvfp4_mega_moe",
    "shared_sf_row",
]

TOKEN_ALIGNMENT = 384
# DeepGEMM's candidate BLOCK_M values (``layout/mega_moe.cuh``, kCandidateBlockM).
CANDIDATE_BLOCK_M = (8, 16, 32, 64, 96, 128, 192, 240)
SHARED_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)


def get_token_alignment_for_nvfp4_mega_moe() -> int:
    """Token alignment of the NVFP4 buffer's capacity (the stand-in uses 384)."""
    return TOKEN_ALIGNMENT


def get_block_m_for_nvfp4_mega_moe(
    num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, num_tokens: int,
    num_topk: int,
) -> int:
    """BLOCK_M the kernel runs ``num_tokens`` local tokens with (DeepGEMM's signature).

    vLLM lays the fused shared expert's MXFP8 input scales out by it
    (:func:`shared_sf_row`). The real heuristic is compiled into DeepGEMM's ``_C``; the
    stand-in's: the smallest candidate BLOCK_M holding the expected rows per expert,
    ``ceil(num_ranks * num_tokens * num_topk / num_experts)`` (240 at most). The kernel
    and the staging call it with the same arguments, so they agree by construction.
    """
    expected = -(-num_ranks * max(num_tokens, 1) * num_topk // max(num_experts, 1))
    return next((c for c in CANDIDATE_BLOCK_M if c >= expected), CANDIDATE_BLOCK_M[-1])


def shared_sf_row(token: torch.Tensor, block_m: int) -> torch.Tensor:
    """Row of ``token`` in the shared expert's MN-major (UTCCP) scale pages.

    vLLM's ``prepare_megamoe.py::_shared_sf_row``: pages of ``ceil(block_m / 128) * 128``
    rows per BLOCK_M tokens; inside a page, token ``m`` goes to row
    ``(m // 128) * 128 + (m % 32) * 4 + (m % 128) // 32``.
    """
    aligned = -(-block_m // 128) * 128
    block, m = token // block_m, token % block_m
    return block * aligned + (m // 128) * 128 + (m % 32) * 4 + (m % 128) // 32


class NVFP4SymmBuffer(RegionBuffer):
    """One rank's NVFP4 Mega-MoE buffer: a flat int8 tensor and typed views into it.

    Constructor as DeepGEMM's (``mega/nvfp4.py``), plus the keyword ``device``. Regions in
    the order of ``layout/nvfp4_mega_moe.cuh`` (``R`` ranks, ``Tmax`` the aligned capacity,
    ``Is = num_shared_experts * I``, ``N = R * Tmax * k`` ring rows: every row a rank can
    receive; the real ring is smaller and reused):

    ``workspace`` (int32 ``[align(E_local, 4)]``: rows received per local expert by the
    last call), ``x`` (int8 ``[Tmax, H/2]``, packed E2M1), ``x_sf`` (int32 ``[Tmax,
    H/64]``, four E4M3 bytes per int), ``topk_idx`` (int64 ``[Tmax, k]``), ``topk_weights``
    (FP32 ``[Tmax, k]``), ``shared_l1_acts`` (``shared_dtype`` ``[Tmax, H]``),
    ``shared_l1_acts_sf`` (int32 ``[ceil(Tmax/8) * 128, H/128]``, rows by
    :func:`shared_sf_row`), ``shared_l2_acts`` (``[Tmax, Is]``), ``shared_l2_acts_sf``
    (int32 ``[ceil(Tmax/8) * 128, Is/128]``; the stand-in fills its first ``T`` rows in
    token order) -- the four shared views are empty without a fused shared expert, the
    ``_sf`` ones also for BF16 --, ``l1_acts`` / ``l1_acts_sf`` (``[N, H/2]`` /
    ``[N, H/64]``), ``l2_acts`` / ``l2_acts_sf`` (``[N, I/2]`` / ``[N, I/64]``), the
    combine region (BF16 ``[num_slots, Tmax, H]``, no view: it starts where
    ``l2_acts_sf`` ends), ``x_scales`` (FP32 ``[Tmax]``), then the received rows' per-token
    scales (FP32 ``[N]``, no view).

    Attributes:
        group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
        num_shared_experts, shared_dtype: as given (``num_max_tokens_per_rank`` aligned).
        mma_type: ``"nvfp4"``; activation: ``"swiglu"``.
        buffer: int8 ``[nbytes]``; handle: the symmetric-memory handle or None.
        num_ranks, rank, num_experts_per_rank, num_slots: derived.
        _moewire_regions: ``{name: (byte offset, byte size)}`` of every region.

    ``region``, ``combine_rows``, ``destroy`` and pickling as every
    :class:`~moewire.reference.buffer.RegionBuffer`.
    """

    _HIDDEN = ("combine", "l1_x_scales")

    def __init__(
        self,
        group: Any,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        hidden: int,
        intermediate_hidden: int,
        num_shared_experts: int = 0,
        base: NVFP4SymmBuffer | None = None,
        shared_dtype: torch.dtype = torch.float8_e4m3fn,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        where = "NVFP4SymmBuffer"
        num_ranks, _ = _group_size_rank(group, where)
        check_buffer_sizes(
            where, num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank,
            num_topk=num_topk, hidden=hidden, intermediate_hidden=intermediate_hidden,
            num_shared_experts=num_shared_experts,
        )
        check_split(where, num_experts, num_ranks, num_topk, num_shared_experts)
        for name, value in (("hidden", hidden), ("intermediate_hidden", intermediate_hidden)):
            if value % 128:
                _fail(where, f"{name}={value} must be a multiple of 128")
        if shared_dtype not in SHARED_DTYPES:
            _fail(
                where,
                f"shared_dtype must be torch.float8_e4m3fn (MXFP8 shared expert) or "
                f"torch.bfloat16, got {shared_dtype!r}",
            )

        self._set_sizes(
            group, where, num_experts, _align(num_max_tokens_per_rank, TOKEN_ALIGNMENT),
            num_topk, hidden, intermediate_hidden,
        )
        self._set_experts(num_shared_experts)
        self.mma_type = "nvfp4"
        self.activation = "swiglu"
        self.shared_dtype = shared_dtype

        offset = self._lay_out()
        if base is None:
            if device is not None:
                device = torch.device(device)
            else:
                device = _default_device(group)
            self._allocate(offset, device)
        else:
            if not isinstance(base, NVFP4SymmBuffer) or base.buffer is None:
                _fail(where, "base must be a live NVFP4SymmBuffer (not destroyed)")
            if base.group is not group:
                _fail(where, "base was built for another process group; pass one of the same")
            self._share(base, offset, where)
        self._slice_views()

    def _regions(self) -> list[Region]:
        tmax, k, h, i = (
            self.num_max_tokens_per_rank, self.num_topk, self.hidden, self.intermediate_hidden
        )
        ring = self.num_ranks * tmax * k
        shared = self.num_shared_experts > 0
        shared_i = self.num_shared_experts * i
        shared_tokens = tmax if shared else 0
        sf_tokens = num_max_shared_sf_tokens(tmax) if shared and self.shared_with_sf else 0
        return [
            ("workspace", torch.int32, (_align(self.num_experts_per_rank, 4),)),
            ("x", torch.int8, (tmax, h // 2)),
            ("x_sf", torch.int32, (tmax, h // 64)),
            ("topk_idx", torch.int64, (tmax, k)),
            ("topk_weights", torch.float32, (tmax, k)),
            ("shared_l1_acts", self.shared_dtype, (shared_tokens, h)),
            ("shared_l1_acts_sf", torch.int32, (sf_tokens, h // 128)),
            ("shared_l2_acts", self.shared_dtype, (shared_tokens, shared_i)),
            ("shared_l2_acts_sf", torch.int32, (sf_tokens, shared_i // 128)),
            ("l1_acts", torch.int8, (ring, h // 2)),
            ("l1_acts_sf", torch.int32, (ring, h // 64)),
            ("l2_acts", torch.int8, (ring, i // 2)),
            ("l2_acts_sf", torch.int32, (ring, i // 64)),
            ("combine", torch.bfloat16, (self.num_slots, tmax, h)),
            ("x_scales", torch.float32, (tmax,)),
            ("l1_x_scales", torch.float32, (ring,)),
        ]

    @property
    def shared_with_sf(self) -> bool:
        """True when a fused shared expert takes MXFP8 inputs (scales in the buffer)."""
        return self.shared_dtype == torch.float8_e4m3fn

    def __repr__(self) -> str:
        return (
            f"NVFP4SymmBuffer(rank={self.rank}/{self.num_ranks}, experts={self.num_experts}, "
            f"Tmax={self.num_max_tokens_per_rank}, k={self.num_topk}, H={self.hidden}, "
            f"I={self.intermediate_hidden}, shared={self.num_shared_experts}, "
            f"shared_dtype={self.shared_dtype})"
        )
