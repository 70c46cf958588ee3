"""Stand-in for DeepGEMM's Mega-MoE Python API (``deep_gemm``), runnable on CPU and GPU.

Same names and signatures as the DeepGEMM bundled in vLLM (``vllm/third_party/deep_gemm``):
:func:`get_symm_buffer_for_mega_moe`, :class:`SymmBuffer`, :func:`fp8_fp4_mega_moe`,
:func:`bf16_mega_moe`, :func:`transform_weights_for_mega_moe`, :func:`per_token_cast_to_fp8`
(defined, as DeepGEMM's, in its ``utils``: ``deep_gemm.utils.per_token_cast_to_fp8`` is the
same function), and the NVFP4 kernel's (``nvfp4_mega_moe``). A thin API, as DeepGEMM's
``mega/__init__.py``: it checks the arguments and hands over to the buffer
(``reference.buffer``), the kernel body (``reference._kernel``) and the casts
(``reference.deep_gemm_utils``, ``reference._numerics``); DeepGEMM 2.8.0's NVFP4 x NVFP4
``fp4_fp4_mega_moe`` and its ``fp4xfp4`` buffer are the subpackage ``reference.fp4_fp4``'s.

The buffer layout and the combine order follow a named *flavour*, one per kernel build
(``reference.builds``: DeepGEMM main, vLLM 0.32-0.34's bundled copies, PR #323):

- ``deepgemm-main``: ``fp8_fp4_mega_moe`` and (DeepGEMM 54e2261) ``bf16_mega_moe``; regions
  ``x, x_sf, topk_idx, topk_weights, l1_acts, l1_acts_sf, l2_acts, l2_acts_sf, combine``, the
  combine region last; no fused shared expert. (Upstream sizes ``l1_acts``/``l2_acts`` by
  ``num_ring_tokens``; the stand-in keeps them pool-sized, which moves no combine row.)
- ``vllm-0.32``: both kernels; a fused shared expert's row is stored at slot
  ``k`` and added last.
- ``vllm-0.33`` (the default; vLLM 0.33 and 0.34 bundle it): the shared row, still stored
  at slot ``k``, is added **first**; for ``bf16xbf16`` a ``combine_norm_buffer`` (FP32
  ``[k][Tmax][H/128]`` squared-norm partials) follows the combine region
  (``layout/mega_moe.cuh`` l.458-471), so the region is not the buffer's tail.
- ``deepgemm-sm90`` (DeepGEMM PR #323): ``fp8_fp4_mega_moe``; no fused shared expert; every
  view is a DLPack tensor that shares no storage object with ``.buffer`` (as the real SM90
  build's views), though it points into it.
- ``deepgemm-vllm-situ`` (vllm-project/DeepGEMM's 2.6.1 SiTU line, 51655f2, which vLLM
  main's stored ``KimiK3MegaMoEExperts`` calls): ``fp8_fp4_mega_moe`` with SiTU's scales
  spelled ``activation_beta`` (gate) and ``activation_linear_beta`` (up); the shared row
  added last.
- ``deepgemm-vllm-dev`` (vllm-project/DeepGEMM dev, 2.8.1 at 63aa62a): both kernels, the
  shared row added first, the combine region last (no norm buffer after it).
- ``deepgemm-2.8`` (DeepGEMM 2.8.0, 0274ad7): ``fp4_fp4_mega_moe`` only, on the ``fp4xfp4``
  buffer (``get_symm_buffer_for_mega_moe(..., mma_type="fp4xfp4")``, ``reference.fp4_fp4``):
  the combine region is the buffer's last and starts where ``l2_acts_sf`` ends; a BF16
  shared expert's row (slot ``k``) is added last, after the routed sum is rounded to BF16.

The combine region is BF16 ``[num_slots][Tmax][H]``, slot-major; no view exposes it.
Choose the flavour with ``use_flavour(name)`` (a setter and a context manager) or the
environment variable ``MOEWIRE_REFERENCE_FLAVOUR``; a buffer keeps the flavour it was
built with in ``_moewire_flavour``. :func:`moewire_flavour` says which build the module
imitates now (how ``moewire.megamoe.flavours.detect`` recognises it).

May import: torch and the reference modules below the API (``_alloc``, ``_numerics``,
``deep_gemm_utils``, ``builds``, ``buffer``, ``_kernel``, ``nvfp4.buffer``, ``nvfp4.mega_moe``,
``fp4_fp4.buffer``, ``fp4_fp4.mega_moe``); none of them imports it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from moewire.reference import _kernel
from moewire.reference import deep_gemm_utils as utils
from moewire.reference._alloc import align as _align
from moewire.reference._alloc import check_split as _check_split
from moewire.reference._alloc import default_device as _default_device
from moewire.reference._alloc import group_size_rank as _group_size_rank
from moewire.reference._alloc import positive_int as _positive_int
from moewire.reference.buffer import SymmBuffer
from moewire.reference.builds import (
    DEFAULT_FLAVOUR,
    ENV_FLAVOUR,
    KERNEL_BUILDS,
    RENAMED,
    KernelBuild,
    current_flavour,
    moewire_flavour,
    use_flavour,
)
from moewire.reference.catalogue import MMA_OF_KERNEL, STAND_IN, builds
from moewire.reference.deep_gemm_utils import per_token_cast_to_fp8
from moewire.reference.fp4_fp4.buffer import FP4SymmBuffer
from moewire.reference.fp4_fp4.mega_moe import fp4_fp4_mega_moe
from moewire.reference.nvfp4.buffer import (
    NVFP4SymmBuffer,
    get_block_m_for_nvfp4_mega_moe,
    get_token_alignment_for_nvfp4_mega_moe,
)
from moewire.reference.nvfp4.mega_moe import nvfp4_mega_moe

__all__ = [
    "DEFAULT_FLAVOUR",
    "ENV_FLAVOUR",
    "KERNEL_BUILDS",
    "MMA_OF_KERNEL",
    "NVFP4SymmBuffer",
    "RENAMED",
    "KernelBuild",
    "SymmBuffer",
    "bf16_mega_moe",
    "current_flavour",
    "fp4_fp4_mega_moe",
    "fp8_fp4_mega_moe",
    "get_block_m_for_mega_moe",
    "get_block_m_for_nvfp4_mega_moe",
    "get_symm_buffer_for_mega_moe",
    "get_token_alignment_for_mega_moe",
    "get_token_alignment_for_nvfp4_mega_moe",
    "moewire_flavour",
    "nvfp4_mega_moe",
    "per_token_cast_to_fp8",
    "transform_weights_for_mega_moe",
    "use_flavour",
    "utils",
]

TOKEN_ALIGNMENT = 384
# sgl-deep-gemm 0.2.5's switch for the FP8 combine (read by its C++ buffer sizing and JIT).
ENV_FP8_COMBINE = "DG_USE_FP8_COMBINE"
ACTIVATIONS = ("swiglu", "situ")
# The builds of get_symm_buffer_for_mega_moe (the NVFP4 Mega-MoE has a buffer of its own),
# and what H and I must be multiples of (moewire.reference.catalogue).
_BUILDS = tuple(b for b in builds(STAND_IN) if b.function != "nvfp4_mega_moe")
MMA_TYPES = tuple(b.mma_type for b in _BUILDS)
HIDDEN_MULTIPLE = {b.mma_type: b.hidden_multiple for b in _BUILDS}


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


def get_token_alignment_for_mega_moe() -> int:
    """Token alignment of the buffer capacity (384, as upstream)."""
    return TOKEN_ALIGNMENT


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
) -> SymmBuffer | FP4SymmBuffer:
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
        mma_type: ``"fp8xfp4"``, ``"bf16xbf16"`` or (the ``deepgemm-2.8`` flavour)
            ``"fp4xfp4"``: DeepGEMM 2.8.0's NVFP4 buffer (``fp4_fp4.buffer.FP4SymmBuffer``,
            ``Tmax`` aligned to 1920 instead).
        activation: ``"swiglu"`` or ``"situ"`` (``"swiglu"`` only for ``fp4xfp4``).
        device: moewire extension; default CUDA when available and the group is NCCL (or
            ``None``), else CPU.

    Returns:
        The :class:`SymmBuffer`, zero-filled. With ``DG_USE_FP8_COMBINE=1`` in the
        environment (read here, as sgl-deep-gemm 0.2.5 sizes its buffer from it) the combine
        rows are FP8 with one UE8M0 byte per 128 columns (``SymmBuffer.combine_fp8``), and
        the kernels write and reduce them as DeepGEMM's FP8 combine does.
    """
    where = "get_symm_buffer_for_mega_moe"
    num_ranks, _ = _group_size_rank(group, "get_symm_buffer_for_mega_moe")
    build = KERNEL_BUILDS[current_flavour()]
    _positive_int(num_experts, "num_experts", where)
    _positive_int(num_max_tokens_per_rank, "num_max_tokens_per_rank", where)
    _positive_int(num_topk, "num_topk", where)
    _positive_int(num_shared_experts, "num_shared_experts", where, minimum=0)
    _check_split(where, num_experts, num_ranks, num_topk)
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
    if mma_type not in build.mma_types:
        raise ValueError(
            f"{where}: the {build.name!r} kernel build has no mma_type={mma_type!r} kernel "
            f"(it has {', '.join(build.kernels)}); use a build that has it "
            "(deep_gemm.use_flavour) or another mma_type"
        )
    if num_shared_experts > 0 and build.shared_position is None:
        raise ValueError(
            f"{where}: the {build.name!r} kernel flavour has no fused shared expert "
            f"(num_shared_experts={num_shared_experts}); use the 'vllm-0.32' or 'vllm-0.33' "
            "flavour (deep_gemm.use_flavour) or pass the shared expert unfused"
        )
    device = torch.device(device) if device is not None else _default_device(group)
    if mma_type == "fp4xfp4":
        return FP4SymmBuffer(
            group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden,
            num_shared_experts, mma_type, activation, device=device,
        )
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
        build,
        device,
        use_fp8_combine=os.environ.get(ENV_FP8_COMBINE, "0").strip() == "1",
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


def _mega_moe(
    kernel: str, y: torch.Tensor, l1_weights: Any, l2_weights: Any, sym_buffer: SymmBuffer,
    shared_l1_weights: Any, shared_l2_weights: Any, *, recipe: tuple[int, int, int] | None,
    activation: str | None, activation_clamp: float | None,
    situ_scales: dict[str, float | None], stats: torch.Tensor | None,
) -> None:
    """Hand one call of ``kernel`` to the kernel body, its activation defaulted.

    ``None`` for an activation argument means its default: vLLM main's
    ``DeepGemmSm100MegaMoEBackend.run_mega_moe`` (``fused_moe/deep_gemm_mega_moe.py``,
    4083b32) passes ``activation``, ``activation_alpha`` and ``activation_beta`` by keyword,
    ``None`` when the model gave none (0.32's drops them instead). The SiTU scales are read in
    the spelling of the buffer's build (``_kernel.Activation.from_kernel_kwargs``).
    """
    _kernel.mega_moe(
        kernel,
        y,
        l1_weights,
        l2_weights,
        sym_buffer,
        shared_l1_weights,
        shared_l2_weights,
        recipe=recipe,
        activation="swiglu" if activation is None else activation,
        activation_clamp=activation_clamp,
        stats=stats,
        situ_scales=situ_scales,
    )


def fp8_fp4_mega_moe(
    y: torch.Tensor,
    l1_weights: tuple[torch.Tensor, torch.Tensor],
    l2_weights: tuple[torch.Tensor, torch.Tensor],
    sym_buffer: SymmBuffer,
    shared_l1_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    shared_l2_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    recipe: tuple[int, int, int] = (1, 1, 32),
    activation: str | None = "swiglu",
    activation_clamp: float | None = None,
    fast_math: bool = True,
    activation_alpha: float | None = None,
    activation_beta: float | None = None,
    activation_linear_beta: float | None = None,
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
        activation_alpha, activation_beta, activation_linear_beta: SiTU's gate and up tanh
            scales (``_kernel.Activation``: gate scale > 0, default 1; up scale >= 0, 0 or
            unset leaves ``up`` as is), in the spelling of the buffer's build: DeepGEMM 2.8.x
            (vLLM's bundled copies, vllm-project/DeepGEMM dev) takes ``activation_alpha``
            (gate) and ``activation_beta`` (up); vllm-project/DeepGEMM's 2.6.1 SiTU line
            (``deepgemm-vllm-situ``) takes ``activation_beta`` (gate) and
            ``activation_linear_beta`` (up). A keyword of the other spelling is refused.
            ``None`` for any activation argument means its default (vLLM main passes
            ``None``).
        cumulative_local_expert_recv_stats: optional int32 ``[E_local]``, incremented by the
            number of (token, slot) rows each local expert received.
    """
    _mega_moe(
        "fp8_fp4_mega_moe", y, l1_weights, l2_weights, sym_buffer, shared_l1_weights,
        shared_l2_weights, recipe=recipe, activation=activation,
        activation_clamp=activation_clamp, stats=cumulative_local_expert_recv_stats,
        situ_scales=_situ_scales(activation_alpha, activation_beta, activation_linear_beta),
    )


def bf16_mega_moe(
    y: torch.Tensor,
    l1_weights: torch.Tensor,
    l2_weights: torch.Tensor,
    sym_buffer: SymmBuffer,
    shared_l1_weights: torch.Tensor | None = None,
    shared_l2_weights: torch.Tensor | None = None,
    activation: str | None = "swiglu",
    activation_clamp: float | None = None,
    fast_math: bool = True,
    activation_alpha: float | None = None,
    activation_beta: float | None = None,
    activation_linear_beta: float | None = None,
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
        activation, activation_clamp, fast_math, activation_alpha, activation_beta,
            activation_linear_beta, cumulative_local_expert_recv_stats: as
            :func:`fp8_fp4_mega_moe`.
    """
    _mega_moe(
        "bf16_mega_moe", y, l1_weights, l2_weights, sym_buffer, shared_l1_weights,
        shared_l2_weights, recipe=None, activation=activation,
        activation_clamp=activation_clamp, stats=cumulative_local_expert_recv_stats,
        situ_scales=_situ_scales(activation_alpha, activation_beta, activation_linear_beta),
    )


def _situ_scales(
    activation_alpha: float | None, activation_beta: float | None,
    activation_linear_beta: float | None,
) -> dict[str, float | None]:
    return {"activation_alpha": activation_alpha, "activation_beta": activation_beta,
            "activation_linear_beta": activation_linear_beta}
