"""Stand-in for DeepGEMM's Mega-MoE Python API (``deep_gemm``), runnable on CPU and GPU.

Same names and signatures as the DeepGEMM bundled in vLLM (``vllm/third_party/deep_gemm``):
:func:`get_symm_buffer_for_mega_moe`, :class:`SymmBuffer`, :func:`fp8_fp4_mega_moe`,
:func:`bf16_mega_moe`, :func:`transform_weights_for_mega_moe`, :func:`per_token_cast_to_fp8`
(defined, as DeepGEMM's, in its ``utils``: ``deep_gemm.utils.per_token_cast_to_fp8`` is the
same function).
The buffer layout and the combine order follow a named *flavour*, one per kernel build
(SPEC section 1; ``moewire.megamoe.flavours`` is moewire's own, independent description of
the same builds, and the layout check is what proves the two agree):

- ``deepgemm-main``: ``fp8_fp4_mega_moe`` only; regions ``x, x_sf, topk_idx, topk_weights,
  l1_acts, l1_acts_sf, l2_acts, l2_acts_sf, combine``, the combine region last; no fused
  shared expert.
- ``vllm-0.32``: adds ``bf16_mega_moe``; a fused shared expert's row is stored at slot
  ``k`` and added last.
- ``vllm-0.33`` (the default; vLLM 0.33 and 0.34 bundle it): the shared row, still stored
  at slot ``k``, is added **first**; for ``bf16xbf16`` a ``combine_norm_buffer`` (FP32
  ``[k][Tmax][H/128]`` squared-norm partials) follows the combine region
  (``layout/mega_moe.cuh`` l.458-471), so the region is not the buffer's tail.
- ``deepgemm-sm90`` (DeepGEMM PR #323): ``fp8_fp4_mega_moe``; no fused shared expert; every
  view is a DLPack tensor that shares no storage object with ``.buffer`` (as the real SM90
  build's views), though it points into it.

The combine region is BF16 ``[num_slots][Tmax][H]``, slot-major; no view exposes it.
Choose the flavour with ``use_flavour(name)`` (a setter and a context manager) or the
environment variable ``MOEWIRE_REFERENCE_FLAVOUR``; a buffer keeps the flavour it was
built with in ``_moewire_flavour``. :func:`moewire_flavour` says which build the module
imitates now (how ``moewire.megamoe.flavours.detect`` recognises it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moewire.reference import _kernel
from moewire.reference import deep_gemm_utils as utils
from moewire.reference._alloc import align as _align
from moewire.reference._alloc import allocate as _allocate
from moewire.reference._alloc import default_device as _default_device
from moewire.reference._alloc import group_size_rank as _group_size_rank
from moewire.reference._alloc import itemsize as _itemsize
from moewire.reference._alloc import numel as _numel
from moewire.reference.deep_gemm_utils import per_token_cast_to_fp8

__all__ = [
    "FLAVOURS",
    "SymmBuffer",
    "bf16_mega_moe",
    "current_flavour",
    "fp8_fp4_mega_moe",
    "get_symm_buffer_for_mega_moe",
    "get_token_alignment_for_mega_moe",
    "moewire_flavour",
    "per_token_cast_to_fp8",
    "transform_weights_for_mega_moe",
    "use_flavour",
    "utils",
]

TOKEN_ALIGNMENT = 384
ACTIVATIONS = ("swiglu", "situ")
MMA_TYPES = ("fp8xfp4", "bf16xbf16")
# fp8xfp4 tiles K by 512 (FP4 weights, 128-byte rows); bf16 by 128.
HIDDEN_MULTIPLE = {"fp8xfp4": 512, "bf16xbf16": 128}
ENV_FLAVOUR = "MOEWIRE_REFERENCE_FLAVOUR"
DEFAULT_FLAVOUR = "vllm-0.33"
# Names before issue 12, refused with their successors named (as moewire.megamoe.flavours).
RENAMED = {
    "upstream": "deepgemm-main",
    "vllm": "vllm-0.32 (shared expert added last) or vllm-0.33 (added first)",
    "sgl": "deepgemm-sm90",
}


@dataclass(frozen=True)
class Flavour:
    """A kernel build, as the stand-in imitates it.

    Attributes:
        name: ``deepgemm-main``, ``vllm-0.32``, ``vllm-0.33`` or ``deepgemm-sm90``.
        kernels: the Mega-MoE kernel functions the build has.
        shared_position: where a fused shared expert's row (stored at slot ``k``) is added
            in the sum: ``"first"``, ``"last"``, or ``None`` (fusion refused).
        norm_after_combine: mma types whose buffer has a ``combine_norm_buffer`` after the
            combine region.
        dlpack_views: the views are DLPack tensors, not storage-sharing views.
    """

    name: str
    kernels: tuple[str, ...]
    shared_position: str | None
    norm_after_combine: tuple[str, ...] = ()
    dlpack_views: bool = False

    @property
    def mma_types(self) -> tuple[str, ...]:
        return tuple(MMA_OF_KERNEL[k] for k in self.kernels)


MMA_OF_KERNEL = {"fp8_fp4_mega_moe": "fp8xfp4", "bf16_mega_moe": "bf16xbf16"}
_BOTH = ("fp8_fp4_mega_moe", "bf16_mega_moe")

FLAVOURS: dict[str, Flavour] = {
    "deepgemm-main": Flavour("deepgemm-main", ("fp8_fp4_mega_moe",), None),
    "vllm-0.32": Flavour("vllm-0.32", _BOTH, "last"),
    "vllm-0.33": Flavour("vllm-0.33", _BOTH, "first", norm_after_combine=("bf16xbf16",)),
    "deepgemm-sm90": Flavour("deepgemm-sm90", ("fp8_fp4_mega_moe",), None, dlpack_views=True),
}

# Regions no view exposes (as in the real builds).
_HIDDEN_REGIONS = ("combine", "combine_norm_buffer")

_flavour_setting: str | None = None


def _check_flavour(name: Any, where: str) -> str:
    if isinstance(name, str) and name in RENAMED:
        raise ValueError(
            f"{where}: reference kernel flavour {name!r} was renamed (one flavour per DeepGEMM "
            f"build); use {RENAMED[name]}"
        )
    if name not in FLAVOURS:
        raise ValueError(
            f"{where}: unknown reference kernel flavour {name!r}; "
            f"use one of {sorted(FLAVOURS)}"
        )
    return name


def current_flavour() -> str:
    """The flavour new buffers get: ``use_flavour``'s, else the env var's, else
    ``vllm-0.33``."""
    if _flavour_setting is not None:
        return _flavour_setting
    env = os.environ.get(ENV_FLAVOUR)
    if env:
        return _check_flavour(env, f"environment variable {ENV_FLAVOUR}")
    return DEFAULT_FLAVOUR


def moewire_flavour() -> str:
    """The build this module imitates now (:func:`current_flavour`): the fact
    ``moewire.megamoe.flavours.detect`` reads from a stand-in module."""
    return current_flavour()


class use_flavour:  # lower case: used as a plain call (a setter) as often as in `with`
    """Select the layout flavour of buffers built from now on.

    ``use_flavour("vllm-0.32")`` sets it until changed; ``with use_flavour(...): ...`` sets it
    for the block and restores the previous setting on exit.
    """

    def __init__(self, name: str) -> None:
        global _flavour_setting
        _check_flavour(name, "use_flavour")
        self.name = name
        self._previous = _flavour_setting
        _flavour_setting = name

    def __enter__(self) -> use_flavour:
        return self

    def __exit__(self, *exc: object) -> None:
        global _flavour_setting
        _flavour_setting = self._previous


def get_token_alignment_for_mega_moe() -> int:
    """Token alignment of the buffer capacity (384, as upstream)."""
    return TOKEN_ALIGNMENT


class SymmBuffer:
    """The Mega-MoE buffer of one rank: a flat int8 tensor and typed views into it.

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
            (:func:`get_block_m_for_mega_moe`, ``nvfp4_mega_moe.shared_sf_row``); vLLM 0.32
            stages them there. The stand-in kernel reads the shared expert's input from
            ``x`` and ``x_sf``, as the routed experts'; ``None`` otherwise.
        l1_acts, l1_acts_sf: tokens this rank received, FP8 ``[R * Tmax * k, H]`` and packed
            scales (the kernel writes them, grouped by local expert).
        l2_acts, l2_acts_sf: the re-quantized ``h``, FP8 ``[R * Tmax * k, I]`` and scales.
        _moewire_flavour: the flavour this buffer was laid out for.
        _moewire_regions: ``{name: (byte offset, byte size)}`` of every region.
    """

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
        flavour: Flavour,
        device: torch.device,
    ) -> None:
        self.group = group
        self.num_ranks, self.rank = _group_size_rank(group, "get_symm_buffer_for_mega_moe")
        self.num_experts = num_experts
        self.num_experts_per_rank = num_experts // self.num_ranks
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_topk = num_topk
        self.hidden = hidden
        self.intermediate_hidden = intermediate_hidden
        self.num_shared_experts = num_shared_experts
        self.mma_type = mma_type
        self.activation = activation
        self._moewire_flavour = flavour.name
        self.num_slots = num_topk + (1 if num_shared_experts > 0 else 0)

        regions = self._regions(flavour)
        for name, dtype, _ in regions:
            if dtype is None:
                setattr(self, name, None)
        regions = [r for r in regions if r[1] is not None]
        offsets, offset = {}, 0
        for name, dtype, shape in regions:
            nbytes = _numel(shape) * _itemsize(dtype)
            offsets[name] = (offset, nbytes)
            offset += nbytes
        self._moewire_regions = offsets
        self.buffer, self.handle = _allocate(offset, device, group, self.num_ranks)
        self.buffer.zero_()
        self._slice_views(flavour)
        if self.num_ranks > 1:
            dist.barrier(group=group)

    def _slice_views(self, flavour: Flavour) -> None:
        """Set every typed view as a slice of ``.buffer`` (``_moewire_regions``)."""
        for name, dtype, shape in self._regions(flavour):
            if dtype is None or name in _HIDDEN_REGIONS:
                continue
            start, nbytes = self._moewire_regions[name]
            view = self.buffer[start : start + nbytes].view(dtype).view(shape)
            if flavour.dlpack_views:
                # Same memory, another storage object (the SM90 build's DLPack views).
                view = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(view))
            setattr(self, name, view)

    def __getstate__(self) -> dict[str, Any]:
        # The views are sliced again from `.buffer` on load: pickled one by one, each would
        # become a copy of its own, and the combine rows would no longer lie in `.buffer`.
        return {k: v for k, v in self.__dict__.items() if k not in self._moewire_regions}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name, dtype, _ in self._regions(self.flavour):
            if dtype is None:
                setattr(self, name, None)
        self._slice_views(self.flavour)

    def _regions(self, flavour: Flavour) -> list[tuple[str, Any, Any]]:
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
            ("shared_l1_acts_sf", torch.int32, (_num_max_shared_sf_tokens(tmax), h // 128))
            if fp8 and self.num_shared_experts
            else ("shared_l1_acts_sf", None, None),
            ("l1_acts", act, (recv, h)),
            ("l1_acts_sf", torch.int32, (recv, h // 128)) if fp8 else ("l1_acts_sf", None, None),
            ("l2_acts", act, (recv, i)),
            ("l2_acts_sf", torch.int32, (recv, i // 128)) if fp8 else ("l2_acts_sf", None, None),
            ("combine", torch.bfloat16, (self.num_slots, tmax, h)),
        ]
        if self.mma_type in flavour.norm_after_combine:
            regions.append(("combine_norm_buffer", torch.float32, (k, tmax, h // 128)))
        return regions

    @property
    def flavour(self) -> Flavour:
        return FLAVOURS[self._moewire_flavour]

    def destroy(self) -> None:
        """Drop the buffer and its views (upstream's ``destroy``)."""
        for name in list(self._moewire_regions) + ["buffer", "handle", "group"]:
            if hasattr(self, name):
                setattr(self, name, None)

    def __repr__(self) -> str:
        return (
            f"SymmBuffer(flavour={self._moewire_flavour}, rank={self.rank}/{self.num_ranks}, "
            f"experts={self.num_experts}, Tmax={self.num_max_tokens_per_rank}, "
            f"k={self.num_topk}, H={self.hidden}, I={self.intermediate_hidden}, "
            f"shared={self.num_shared_experts}, mma={self.mma_type})"
        )


def _positive_int(value: Any, name: str, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value!r}")
    return value


def get_symm_buffer_for_mega_moe(
    group: Any,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    intermediate_hidden: int,
    num_shared_experts: int = 0,
    mma_type: str = "fp8xfp4",
    activation: str = "swiglu",
    *,
    device: torch.device | str | None = None,
) -> SymmBuffer:
    """Allocate one rank's Mega-MoE buffer, laid out for the current flavour.

    Args:
        group: EP process group (experts are split evenly over its ranks), or ``None``.
        num_experts: routed experts over the whole group.
        num_max_tokens_per_rank: requested capacity; rounded up to a multiple of 384. Read
            the real capacity back from ``buffer.num_max_tokens_per_rank``.
        num_topk: routed slots per token.
        hidden: H, a multiple of 512 for ``fp8xfp4`` (128 for ``bf16xbf16``).
        intermediate_hidden: I per expert, same rule as ``hidden``.
        num_shared_experts: shared experts fused into the kernel (one combine slot).
        mma_type: ``"fp8xfp4"`` or ``"bf16xbf16"``.
        activation: ``"swiglu"`` or ``"situ"``.
        device: moewire extension; default CUDA when available and the group is NCCL (or
            ``None``), else CPU.

    Returns:
        The :class:`SymmBuffer`, zero-filled.
    """
    where = "get_symm_buffer_for_mega_moe"
    num_ranks, _ = _group_size_rank(group, "get_symm_buffer_for_mega_moe")
    flavour = FLAVOURS[current_flavour()]
    _positive_int(num_experts, "num_experts", where)
    _positive_int(num_max_tokens_per_rank, "num_max_tokens_per_rank", where)
    _positive_int(num_topk, "num_topk", where)
    _positive_int(num_shared_experts, "num_shared_experts", where, minimum=0)
    if num_experts % num_ranks:
        raise ValueError(
            f"{where}: num_experts={num_experts} is not divisible by the group size "
            f"{num_ranks}; experts are split evenly over the ranks"
        )
    if num_topk > num_experts:
        raise ValueError(f"{where}: num_topk={num_topk} exceeds num_experts={num_experts}")
    if mma_type not in MMA_TYPES:
        raise ValueError(f"{where}: unknown mma_type {mma_type!r}; use one of {MMA_TYPES}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    multiple = HIDDEN_MULTIPLE[mma_type]
    for name, value in (("hidden", hidden), ("intermediate_hidden", intermediate_hidden)):
        _positive_int(value, name, where)
        if value % multiple:
            raise ValueError(
                f"{where}: {name}={value} must be a multiple of {multiple} for "
                f"mma_type={mma_type!r}"
            )
    if mma_type not in flavour.mma_types:
        raise ValueError(
            f"{where}: the {flavour.name!r} kernel build has no mma_type={mma_type!r} kernel "
            f"(it has {', '.join(flavour.kernels)}); use a build that has it "
            "(deep_gemm.use_flavour) or another mma_type"
        )
    if num_shared_experts > 0 and flavour.shared_position is None:
        raise ValueError(
            f"{where}: the {flavour.name!r} kernel flavour has no fused shared expert "
            f"(num_shared_experts={num_shared_experts}); use the 'vllm-0.32' or 'vllm-0.33' "
            "flavour (deep_gemm.use_flavour) or pass the shared expert unfused"
        )
    device = torch.device(device) if device is not None else _default_device(group)
    return SymmBuffer(
        group,
        num_experts,
        _align(num_max_tokens_per_rank, TOKEN_ALIGNMENT),
        num_topk,
        hidden,
        intermediate_hidden,
        num_shared_experts,
        mma_type,
        activation,
        flavour,
        device,
    )


def _interleave_gate_up(t: torch.Tensor, gran: int = 8) -> torch.Tensor:
    """Rows ``[gate | up]`` -> ``[gate 0..7, up 0..7, gate 8..15, up 8..15, ...]``."""
    g, n = t.shape[:2]
    gate, up = t[:, : n // 2], t[:, n // 2 :]
    blocks = [b.reshape(g, n // 2 // gran, gran, *t.shape[2:]) for b in (gate, up)]
    return torch.stack(blocks, dim=2).reshape(t.shape).contiguous()


def _transpose_sf_for_utccp(sf: torch.Tensor) -> torch.Tensor:
    """Within each block of 128 rows, row ``4 * r + q`` <- row ``32 * q + r``."""
    g, mn, cols = sf.shape
    return sf.reshape(g, mn // 128, 4, 32, cols).transpose(2, 3).reshape(g, mn, cols).contiguous()


def _check_transformable(t: torch.Tensor, name: str, rows_multiple: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3):
        raise ValueError(
            f"transform_weights_for_mega_moe: {name} must be a 2-D or 3-D tensor "
            f"[(experts,) N, K], got {type(t).__name__}"
            + (f" of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else "")
        )
    if t.shape[-2] % rows_multiple:
        raise ValueError(
            f"transform_weights_for_mega_moe: {name} has {t.shape[-2]} rows; "
            f"it needs a multiple of {rows_multiple}"
        )


def transform_weights_for_mega_moe(
    l1_weights: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    l2_weights: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    activation: str = "swiglu",
) -> tuple[Any, Any]:
    """Put weights in the layout the kernel reads (upstream's permutations).

    Quantized ``(w, sf)`` pairs: L1 rows ``[gate | up]`` are interleaved in blocks of 8
    (``[g0..7, u0..7, g8..15, ...]``) for ``w`` and ``sf``, then the L1 and L2 scale rows
    are permuted within blocks of 128 (row ``4r + q`` <- row ``32q + r``, UTCCP order).
    BF16 weights: L1 interleaved, L2 copied unchanged. 2-D weights (a shared expert) are treated
    as one group.

    Args:
        l1_weights: ``(int8 [E, 2I, H/2] FP4 or FP8 E4M3 [E, 2I, H], int32 [E, 2I, H/128])``
            or BF16 ``[E, 2I, H]``.
        l2_weights: ``(int8 [E, H, I/2] or FP8 [E, H, I], int32 [E, H, I/128])`` or BF16
            ``[E, H, I]``.
        activation: ``"swiglu"`` or ``"situ"`` (the same permutation).

    Returns:
        ``(l1, l2)`` in the same structure, new contiguous tensors.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"transform_weights_for_mega_moe: activation must be one of {ACTIVATIONS}, got "
            f"{activation!r}"
        )

    def as3d(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return (t.unsqueeze(0), True) if t.dim() == 2 else (t, False)

    def back(t: torch.Tensor, squeeze: bool) -> torch.Tensor:
        return t.squeeze(0) if squeeze else t

    if isinstance(l1_weights, tuple) != isinstance(l2_weights, tuple):
        raise TypeError(
            "transform_weights_for_mega_moe: l1_weights and l2_weights must both be "
            "(weight, scale) tuples or both BF16 tensors"
        )
    if isinstance(l1_weights, tuple):
        for name, pair in (("l1_weights", l1_weights), ("l2_weights", l2_weights)):
            if len(pair) != 2:
                raise ValueError(
                    f"transform_weights_for_mega_moe: {name} must be a (weight, scale) pair"
                )
            _check_transformable(pair[0], f"{name}[0]", 16)
            _check_transformable(pair[1], f"{name}[1]", 128)
        (w1, s1), (w2, s2) = l1_weights, l2_weights
        (w1, q1), (s1, _), (w2, q2), (s2, _) = as3d(w1), as3d(s1), as3d(w2), as3d(s2)
        l1 = (
            back(_interleave_gate_up(w1), q1),
            back(_transpose_sf_for_utccp(_interleave_gate_up(s1)), q1),
        )
        l2 = (back(w2.clone(memory_format=torch.contiguous_format), q2),
              back(_transpose_sf_for_utccp(s2), q2))
        return l1, l2
    _check_transformable(l1_weights, "l1_weights", 16)
    w1, q1 = as3d(l1_weights)
    l2 = l2_weights.clone(memory_format=torch.contiguous_format)
    return back(_interleave_gate_up(w1), q1), l2


def fp8_fp4_mega_moe(
    y: torch.Tensor,
    l1_weights: tuple[torch.Tensor, torch.Tensor],
    l2_weights: tuple[torch.Tensor, torch.Tensor],
    sym_buffer: SymmBuffer,
    shared_l1_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    shared_l2_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    recipe: tuple[int, int, int] = (1, 1, 32),
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    fast_math: bool = True,
    activation_alpha: float = 1.0,
    activation_beta: float = 0.0,
    *,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
) -> None:
    """The fused FP8 x FP4 Mega-MoE: dispatch, L1, SwiGLU, L2, combine; writes ``y``.

    Reads the ``T = y.shape[0]`` staged tokens of ``sym_buffer`` (``x``, ``x_sf``,
    ``topk_idx``, ``topk_weights``). For every valid slot (``topk_idx >= 0``) of every
    token, on the rank owning expert ``e`` (experts split evenly, ``e // E_local``):

    1. ``x = fp8 * sf`` (exact); ``gu = bf16(x @ W1[e].T)`` with FP32 accumulation.
    2. ``gate = min(gate, c)``, ``up = clamp(up, -c, c)`` when ``activation_clamp = c``;
       ``h = silu(gate) * up`` then ``h *= topk_weight``, all FP32.
    3. ``h`` re-quantized: FP8 E4M3 with UE8M0 per 32 (``2^ceil(log2(amax / 448))``).
    4. ``row = bf16(h @ W2[e].T)`` (FP32 accumulation, RNE), written to the source rank's
       combine region at (slot, token). Rows of invalid slots are not written.

    A fused shared expert (``shared_*_weights``) runs on every token of this rank with
    weight 1.0 into its flavour's slot. Then ``y[t] = bf16(sum of the valid rows in the
    flavour's order, FP32 from +0.0)``; a token with no valid row gets 0.
    ``DG_COMM_KERNEL_DEBUG=1`` zeroes the whole buffer afterwards.

    Args:
        y: BF16 ``[T, H]``, ``T <= sym_buffer.num_max_tokens_per_rank``, written in place.
        l1_weights: this rank's experts, transformed (see
            :func:`transform_weights_for_mega_moe`): ``(int8 [E_local, 2I, H/2], int32
            [E_local, 2I, H/128])``, FP4 E2M1 packed two per byte with packed UE8M0 per 32.
        l2_weights: ``(int8 [E_local, H, I/2], int32 [E_local, H, I/128])``, transformed.
        sym_buffer: the buffer from :func:`get_symm_buffer_for_mega_moe` (``fp8xfp4``).
        shared_l1_weights: fused shared expert, ``(int8 [2Is, H/2] or FP8 E4M3 [2Is, H],
            int32 [2Is, H/128])`` transformed, with ``Is = num_shared_experts * I``.
        shared_l2_weights: ``(int8 [H, Is/2] or FP8 [H, Is], int32 [H, Is/128])``.
        recipe: ``(1, 1, 32)`` only.
        activation: ``"swiglu"`` or ``"situ"`` (Kimi-K3; the buffer's activation).
        activation_clamp: SwiGLU clamp ``c`` or ``None`` (SiTU takes none).
        fast_math: accepted; the reference always uses exact ``silu`` (see the docs).
        activation_alpha, activation_beta: SiTU's gate and up tanh scales (``alpha > 0``;
            ``beta = 0`` leaves ``up`` as is), as the bundled DeepGEMM names them.
        cumulative_local_expert_recv_stats: optional int32 ``[E_local]``, incremented by the
            number of (token, slot) rows each local expert received.
    """
    _kernel.mega_moe(
        "fp8_fp4_mega_moe",
        y,
        l1_weights,
        l2_weights,
        sym_buffer,
        shared_l1_weights,
        shared_l2_weights,
        recipe=recipe,
        activation=activation,
        activation_clamp=activation_clamp,
        stats=cumulative_local_expert_recv_stats,
        activation_alpha=activation_alpha,
        activation_beta=activation_beta,
    )


def bf16_mega_moe(
    y: torch.Tensor,
    l1_weights: torch.Tensor,
    l2_weights: torch.Tensor,
    sym_buffer: SymmBuffer,
    shared_l1_weights: torch.Tensor | None = None,
    shared_l2_weights: torch.Tensor | None = None,
    activation: str = "swiglu",
    activation_clamp: float | None = None,
    fast_math: bool = True,
    activation_alpha: float = 1.0,
    activation_beta: float = 0.0,
    *,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
) -> None:
    """The fused BF16 Mega-MoE; as :func:`fp8_fp4_mega_moe` without scales.

    ``x`` is staged in BF16; ``gu = bf16(x @ W1.T)``; ``h`` (clamped SwiGLU times the router
    weight, FP32) is rounded to BF16 instead of FP8; ``row = bf16(h @ W2.T)``.

    Args:
        y: BF16 ``[T, H]``.
        l1_weights: BF16 ``[E_local, 2I, H]``, transformed (gate/up interleaved by 8).
        l2_weights: BF16 ``[E_local, H, I]``.
        sym_buffer: a ``bf16xbf16`` buffer.
        shared_l1_weights: BF16 ``[2Is, H]`` transformed; shared_l2_weights: BF16 ``[H, Is]``.
        activation, activation_clamp, fast_math, cumulative_local_expert_recv_stats: as
            :func:`fp8_fp4_mega_moe`.
    """
    _kernel.mega_moe(
        "bf16_mega_moe",
        y,
        l1_weights,
        l2_weights,
        sym_buffer,
        shared_l1_weights,
        shared_l2_weights,
        recipe=None,
        activation=activation,
        activation_clamp=activation_clamp,
        stats=cumulative_local_expert_recv_stats,
        activation_alpha=activation_alpha,
        activation_beta=activation_beta,
    )


# The NVFP4 Mega-MoE of vLLM 0.33/0.34's bundled DeepGEMM (`mega/nvfp4.py`) lives in its own
# module; exported here because callers reach it through the `deep_gemm` namespace.
from moewire.reference.nvfp4_mega_moe import (  # noqa: E402
    NVFP4SymmBuffer,
    _num_max_shared_sf_tokens,
    get_block_m_for_nvfp4_mega_moe,
    get_token_alignment_for_nvfp4_mega_moe,
    nvfp4_mega_moe,
)


def get_block_m_for_mega_moe(
    num_ranks: int, num_experts: int, num_max_tokens_per_rank: int, num_tokens: int,
    num_topk: int, mma_type: str = "fp8xfp4",
) -> int:
    """BLOCK_M the kernel runs ``num_tokens`` local tokens with (the bundled DeepGEMM's
    signature; vLLM 0.32 lays the fused shared expert's input scales out by it).

    The stand-in's heuristic is :func:`get_block_m_for_nvfp4_mega_moe`'s (the real one is
    compiled into DeepGEMM's ``_C``); the staging and the reader call it with the same
    arguments, so they agree by construction.
    """
    if mma_type not in MMA_TYPES:
        raise ValueError(
            f"get_block_m_for_mega_moe: unknown mma_type {mma_type!r}; use one of {MMA_TYPES}"
        )
    return get_block_m_for_nvfp4_mega_moe(
        num_ranks, num_experts, num_max_tokens_per_rank, num_tokens, num_topk
    )


__all__ += [
    "NVFP4SymmBuffer",
    "get_block_m_for_mega_moe",
    "get_block_m_for_nvfp4_mega_moe",
    "get_token_alignment_for_nvfp4_mega_moe",
    "nvfp4_mega_moe",
]
