"""The stand-in's Mega-MoE buffers: a flat int8 tensor laid out as named regions.

:class:`RegionBuffer` is the region-layout machinery both buffers share: regions back to
back in a listed order, their byte offsets in ``_moewire_regions``, typed views sliced from
``.buffer``, the raw bytes of a region, the combine rows, ``destroy`` and pickling.
:class:`SymmBuffer` is the buffer of ``deep_gemm.get_symm_buffer_for_mega_moe``, laid out
for a :class:`~moewire.reference.builds.KernelBuild`; ``nvfp4.buffer.NVFP4SymmBuffer``
is the other one.

May import: torch, ``moewire.reference._alloc`` and ``moewire.reference.builds``. The
kernel (``_kernel``), ``nvfp4.buffer`` and the ``deep_gemm`` API import this module, never
the reverse.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moewire.reference._alloc import allocate, fail, group_size_rank, itemsize, numel
from moewire.reference.builds import KERNEL_BUILDS, KernelBuild

# The smallest BLOCK_M of the Mega-MoE kernels (``layout/mega_moe.cuh``, kCandidateBlockM).
MIN_BLOCK_M = 8


def num_max_shared_sf_tokens(tmax: int) -> int:
    """``layout/mega_moe.cuh::get_num_max_shared_sf_tokens``: pages for the smallest BLOCK_M."""
    return -(-tmax // MIN_BLOCK_M) * 128

__all__ = ["Region", "RegionBuffer", "SymmBuffer"]

# (name, dtype, shape); a dtype of None: the region is absent (no bytes, attribute None).
Region = tuple[str, "torch.dtype | None", "tuple[int, ...] | None"]


class RegionBuffer:
    """A flat int8 ``.buffer`` laid out as the regions of :meth:`_regions`, in order.

    Subclasses set the sizes every build's buffer has with :meth:`_set_sizes` and then
    ``num_slots`` (the combine region is BF16 ``[num_slots, Tmax, H]``), list their regions
    in :meth:`_regions`, and call :meth:`_lay_out`, then :meth:`_allocate` (or share another
    buffer's bytes), then :meth:`_slice_views`. Regions named in ``_HIDDEN`` get no view, as
    in the real builds.

    Attributes:
        buffer: int8 ``[nbytes]``; handle: the symmetric-memory handle or None.
        _moewire_regions: ``{name: (byte offset, byte size)}`` of every present region.
    """

    _HIDDEN: tuple[str, ...] = ("combine",)

    def _regions(self) -> list[Region]:
        raise NotImplementedError

    def _set_sizes(
        self, group: Any, where: str, num_experts: int, num_max_tokens_per_rank: int,
        num_topk: int, hidden: int, intermediate_hidden: int,
    ) -> None:
        """Set ``group``, ``num_ranks``, ``rank`` and the sizes as given (``Tmax`` already
        aligned); ``where`` names the call in the error for a bad group."""
        self.group = group
        self.num_ranks, self.rank = group_size_rank(group, where)
        self.num_experts = num_experts
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_topk = num_topk
        self.hidden = hidden
        self.intermediate_hidden = intermediate_hidden

    def _set_experts(self, num_shared_experts: int) -> None:
        """After :meth:`_set_sizes`: ``num_experts_per_rank`` (the experts split evenly over
        the ranks), ``num_shared_experts`` as given, and ``num_slots``: ``k``, plus one for
        a fused shared expert."""
        self.num_experts_per_rank = self.num_experts // self.num_ranks
        self.num_shared_experts = num_shared_experts
        self.num_slots = self.num_topk + (1 if num_shared_experts > 0 else 0)

    @property
    def _dlpack_views(self) -> bool:
        """Views are DLPack tensors sharing no storage object with ``.buffer``."""
        return False

    def _lay_out(self) -> int:
        """Set ``_moewire_regions`` (and ``None`` for absent regions); the total bytes."""
        offsets, offset = {}, 0
        for name, dtype, shape in self._regions():
            if dtype is None:
                setattr(self, name, None)
                continue
            nbytes = numel(shape) * itemsize(dtype)
            offsets[name] = (offset, nbytes)
            offset += nbytes
        self._moewire_regions = offsets
        return offset

    def _allocate(self, num_bytes: int, device: torch.device) -> None:
        """A zero-filled buffer of ``num_bytes`` (symmetric memory over several CUDA
        ranks); every rank of the group waits for the others."""
        self.buffer, self.handle = allocate(num_bytes, device, self.group, self.num_ranks)
        self.buffer.zero_()
        if self.num_ranks > 1:
            dist.barrier(group=self.group)

    def _share(self, base: RegionBuffer, num_bytes: int, where: str) -> None:
        """Use ``base``'s bytes instead of allocating (the caller checked that ``base`` is a
        live buffer of its type and group); ``where`` names the call in the error.

        Raises:
            ValueError: this layout needs more than ``num_bytes`` of ``base``.
        """
        if num_bytes > base.buffer.numel():
            fail(where, f"this configuration needs {num_bytes} bytes but base holds "
                        f"{base.buffer.numel()}; build it without base")
        self.buffer, self.handle = base.buffer, base.handle

    def _view_names(self) -> list[str]:
        return [n for n in self._moewire_regions if n not in self._HIDDEN]

    def _slice_views(self) -> None:
        """Set every typed view as a slice of ``.buffer``."""
        views = set(self._view_names())
        for name, dtype, shape in self._regions():
            if name in views:
                view = self.region(name).view(dtype).view(shape)
                if self._dlpack_views:
                    # Same memory, another storage object (the SM90 build's DLPack views).
                    view = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(view))
                setattr(self, name, view)

    def region(self, name: str) -> torch.Tensor:
        """The raw bytes (int8) of region ``name`` of ``_moewire_regions``."""
        start, nbytes = self._moewire_regions[name]
        return self.buffer[start : start + nbytes]

    def combine_rows(self) -> torch.Tensor:
        """BF16 ``[num_slots, Tmax, H]`` view of the combine region (routed slot ``s`` at
        ``s``, a fused shared expert at ``k``)."""
        tmax, h = self.num_max_tokens_per_rank, self.hidden
        return self.region("combine").view(torch.bfloat16).view(self.num_slots, tmax, h)

    def destroy(self) -> None:
        """Drop the buffer and its views (DeepGEMM's ``destroy``)."""
        for name in [*self._view_names(), "buffer", "handle", "group"]:
            setattr(self, name, None)

    def __getstate__(self) -> dict[str, Any]:
        # The views are sliced again from `.buffer` on load: pickled one by one, each would
        # become a copy of its own, and the combine rows would no longer lie in `.buffer`.
        return {k: v for k, v in self.__dict__.items() if k not in self._moewire_regions}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.buffer is not None:
            self._slice_views()
        else:  # destroyed: its views stay None
            for name in self._view_names():
                setattr(self, name, None)


class SymmBuffer(RegionBuffer):
    """The Mega-MoE buffer of one rank: a flat int8 tensor and typed views into it.

    Regions in order: ``x``, ``x_sf``, ``topk_idx``, ``topk_weights``, ``l1_acts``,
    ``l1_acts_sf``, ``l2_acts``, ``l2_acts_sf``, the combine region (BF16 ``[num_slots][Tmax]
    [H]``, slot-major, no view; with ``use_fp8_combine``, FP8 ``[num_slots][Tmax][H]`` then
    the UE8M0 bytes ``combine_sf`` ``[num_slots][Tmax][H/128]``), and in builds with
    ``norm_after_combine`` for this mma type the ``combine_norm_buffer`` (FP32
    ``[k][Tmax][H/128]``, no view).

    Attributes:
        group: the EP process group (``None`` for one rank).
        num_experts: experts over the whole group; ``num_experts_per_rank`` per rank.
        num_max_tokens_per_rank: capacity ``Tmax`` (a multiple of 384).
        num_topk, hidden, intermediate_hidden, num_shared_experts, mma_type, activation.
        buffer: int8 ``[nbytes]``.
        x: FP8 E4M3 ``[Tmax, H]`` (BF16 for ``bf16xbf16``), the staged tokens.
        x_sf: int32 ``[Tmax, H / 128]``, packed UE8M0 per 32 (None for ``bf16xbf16``, as
            are ``l1_acts_sf`` and ``l2_acts_sf``).
        topk_idx: int64 ``[Tmax, k]``; topk_weights: FP32 ``[Tmax, k]``.
        shared_l1_acts_sf: with a fused shared expert and ``fp8xfp4`` only: int32
            ``[ceil(Tmax / 8) * 128, H / 128]``, the tokens' packed scales at the rows of
            DeepGEMM's MN-major shared-expert layout for the call's BLOCK_M
            (``deep_gemm.get_block_m_for_mega_moe``, ``nvfp4.buffer.shared_sf_row``);
            vLLM 0.32 stages them there. The stand-in kernel reads the shared expert's input
            from ``x`` and ``x_sf``, as the routed experts'; ``None`` otherwise.
        l1_acts, l1_acts_sf: tokens this rank received, FP8 ``[R * Tmax * k, H]`` and packed
            scales (the kernel writes them, grouped by local expert).
        l2_acts, l2_acts_sf: the re-quantized ``h``, FP8 ``[R * Tmax * k, I]`` and scales.
        _moewire_flavour: the flavour (kernel build) this buffer was laid out for.
        _moewire_regions: ``{name: (byte offset, byte size)}`` of every region.
    """

    _HIDDEN = ("combine", "combine_sf", "combine_norm_buffer")

    def __init__(
        self,
        group: Any,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_topk: int,
        hidden: int,
        intermediate_hidden: int,
        num_shared_experts: int,
        mma_type: str,
        activation: str,
        build: KernelBuild,
        device: torch.device,
        use_fp8_combine: bool = False,
    ) -> None:
        self._set_sizes(
            group, "get_symm_buffer_for_mega_moe", num_experts, num_max_tokens_per_rank,
            num_topk, hidden, intermediate_hidden,
        )
        self._set_experts(num_shared_experts)
        self.use_fp8_combine = use_fp8_combine
        self.mma_type = mma_type
        self.activation = activation
        self._moewire_flavour = build.name
        self._allocate(self._lay_out(), device)
        self._slice_views()

    @property
    def build(self) -> KernelBuild:
        """The kernel build this buffer was laid out for."""
        return KERNEL_BUILDS[self._moewire_flavour]

    @property
    def _dlpack_views(self) -> bool:
        return self.build.dlpack_views

    def _regions(self) -> list[Region]:
        tmax, k, h, i = (
            self.num_max_tokens_per_rank,
            self.num_topk,
            self.hidden,
            self.intermediate_hidden,
        )
        recv = self.num_ranks * tmax * k
        fp8 = self.mma_type == "fp8xfp4"
        act = torch.float8_e4m3fn if fp8 else torch.bfloat16
        # BF16 has no scale regions: those views are None and take no bytes.
        regions = [
            ("x", act, (tmax, h)),
            ("x_sf", torch.int32, (tmax, h // 128)) if fp8 else ("x_sf", None, None),
            ("topk_idx", torch.int64, (tmax, k)),
            ("topk_weights", torch.float32, (tmax, k)),
            ("shared_l1_acts_sf", torch.int32, (num_max_shared_sf_tokens(tmax), h // 128))
            if fp8 and self.num_shared_experts
            else ("shared_l1_acts_sf", None, None),
            ("l1_acts", act, (recv, h)),
            ("l1_acts_sf", torch.int32, (recv, h // 128)) if fp8 else ("l1_acts_sf", None, None),
            ("l2_acts", act, (recv, i)),
            ("l2_acts_sf", torch.int32, (recv, i // 128)) if fp8 else ("l2_acts_sf", None, None),
        ]
        if self.use_fp8_combine:
            # layout/mega_moe.cuh (sgl-deep-gemm 0.2.5) with use_fp8_combine: H FP8 bytes per
            # row, then combine_sf_buffer, one UE8M0 byte per 128 columns, same slot-major
            # order, right after the rows.
            regions += [
                ("combine", torch.uint8, (self.num_slots, tmax, h)),
                ("combine_sf", torch.uint8, (self.num_slots, tmax, h // 128)),
            ]
        else:
            regions.append(("combine", torch.bfloat16, (self.num_slots, tmax, h)))
        if self.mma_type in self.build.norm_after_combine:
            regions.append(("combine_norm_buffer", torch.float32, (k, tmax, h // 128)))
        return regions

    def combine_fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        """With ``use_fp8_combine``: the FP8 combine rows, float8_e4m3fn ``[num_slots, Tmax,
        H]``, and their UE8M0 scale bytes, uint8 ``[num_slots, Tmax, H / 128]`` (views)."""
        if not self.use_fp8_combine:
            raise ValueError(
                "SymmBuffer.combine_fp8: this buffer holds BF16 combine rows (it was built "
                "without DG_USE_FP8_COMBINE=1); read them with combine_rows()"
            )
        tmax, h = self.num_max_tokens_per_rank, self.hidden
        q = self.region("combine").view(torch.float8_e4m3fn).view(self.num_slots, tmax, h)
        sf = self.region("combine_sf").view(torch.uint8).view(self.num_slots, tmax, h // 128)
        return q, sf

    def combine_norms(self) -> torch.Tensor | None:
        """FP32 ``[k, Tmax, H/128]`` view of the ``combine_norm_buffer``, or None where the
        build has none for this mma type."""
        if "combine_norm_buffer" not in self._moewire_regions:
            return None
        k, tmax, h = self.num_topk, self.num_max_tokens_per_rank, self.hidden
        norms = self.region("combine_norm_buffer").view(torch.float32)
        return norms.view(k, tmax, h // 128)

    def __repr__(self) -> str:
        return (
            f"SymmBuffer(flavour={self._moewire_flavour}, rank={self.rank}/{self.num_ranks}, "
            f"experts={self.num_experts}, Tmax={self.num_max_tokens_per_rank}, "
            f"k={self.num_topk}, H={self.hidden}, I={self.intermediate_hidden}, "
            f"shared={self.num_shared_experts}, mma={self.mma_type}"
            f"{', fp8_combine' if self.use_fp8_combine else ''})"
        )
