"""Stand-in for the DeepGEMM fork that vLLM main's Hopper Mega-MoE calls (CPU and GPU).

vLLM main's ``DeepseekV4MegaMoESM90Experts`` (``vllm/models/deepseek_v4/nvidia/sm90_mega_moe.py``,
read at commit 6cd8b6b) needs a DeepGEMM build exposing three names that upstream DeepGEMM
lacks (its ``_check_runtime_supported`` names them and points at a fork):
:func:`get_symm_buffer_for_sm90_mega_moe`, :func:`transform_weights_for_mega_moe_sm90` and
:func:`fp8_mega_moe_sm90`, and stages with ``deep_gemm.utils.per_token_cast_to_fp8(x,
use_ue8m0=False, gran_k=128)``. This module has those names, with the contract that file
reads from them, on one rank:

- the buffer (:class:`SM90ForkSymmBuffer`): ``x`` FP8 E4M3 ``[Tmax, H]``, ``x_sf`` FP32
  ``[Tmax, H/128]``, ``topk_idx`` int64 and ``topk_weights`` FP32 ``[Tmax, k]``, the
  activation regions, then the BF16 ``[k][Tmax][H]`` combine region **last**, every view a
  DLPack tensor sharing no storage with ``.buffer`` (as DeepGEMM PR #323's SM90 buffer, of
  which the fork is a port; the fork's own layout is not public: moewire's layout check,
  not this stand-in, decides on a real fork);
- the kernel: FP8 x FP8 with 128x128 block weight scales; per valid slot ``row =
  bf16(bf16(w * clamp-SwiGLU(x W1^T)) W2^T)`` in FP32 accumulation, rows of invalid slots
  never written, ``y`` the FP32 sum of the valid rows in ascending slot order from +0.0,
  one BF16 rounding; no fused shared expert.

It is a plain module, as a DeepGEMM is: moewire hooks module objects (its ``utils`` holds
the cast, :mod:`moewire.reference.deep_gemm_utils`). One rank only: a group of several
ranks is refused.

May import: torch and the reference modules below the API (``_alloc``, ``_numerics``,
``buffer``, ``deep_gemm_utils``).
"""

from __future__ import annotations

from typing import Any

import torch

from moewire.reference import deep_gemm_utils as utils
from moewire.reference._alloc import align, default_device, group_size_rank, positive_int
from moewire.reference.buffer import Region, RegionBuffer

__all__ = [
    "SM90ForkSymmBuffer",
    "fp8_mega_moe_sm90",
    "get_symm_buffer_for_sm90_mega_moe",
    "moewire_flavour",
    "transform_weights_for_mega_moe_sm90",
    "utils",
]

FLAVOUR = "deepgemm-sm90-fork"
TOKEN_ALIGNMENT = 384
BLOCK = 128


def moewire_flavour() -> str:
    """The build this stand-in imitates (read by ``moewire.megamoe.flavours.detect``)."""
    return FLAVOUR


class SM90ForkSymmBuffer(RegionBuffer):
    """One rank's buffer of :func:`get_symm_buffer_for_sm90_mega_moe`.

    Attributes:
        num_experts, num_max_tokens_per_rank (``Tmax``, a multiple of 384), num_topk,
        hidden, intermediate_hidden, group.
        buffer: int8 ``[nbytes]``; views ``x`` (FP8 ``[Tmax, H]``), ``x_sf`` (FP32
            ``[Tmax, H/128]``), ``topk_idx`` (int64 ``[Tmax, k]``), ``topk_weights``
            (FP32 ``[Tmax, k]``), ``l1_acts``/``l1_acts_sf``, ``l2_acts``/``l2_acts_sf``
            (FP8 and FP32 per 128); the combine region (no view) is last.
    """

    def __init__(
        self, group: Any, num_experts: int, tmax: int, num_topk: int, hidden: int,
        intermediate_hidden: int, device: torch.device,
    ) -> None:
        self._set_sizes(
            group, "get_symm_buffer_for_sm90_mega_moe", num_experts, tmax, num_topk, hidden,
            intermediate_hidden,
        )
        self.num_slots = num_topk
        self._allocate(self._lay_out(), device)
        self._slice_views()

    @property
    def _dlpack_views(self) -> bool:
        return True

    def _regions(self) -> list[Region]:
        tmax, k, h, i = (self.num_max_tokens_per_rank, self.num_topk, self.hidden,
                         self.intermediate_hidden)
        recv = tmax * k
        fp8 = torch.float8_e4m3fn
        return [
            ("x", fp8, (tmax, h)),
            ("x_sf", torch.float32, (tmax, h // BLOCK)),
            ("topk_idx", torch.int64, (tmax, k)),
            ("topk_weights", torch.float32, (tmax, k)),
            ("l1_acts", fp8, (recv, h)),
            ("l1_acts_sf", torch.float32, (recv, h // BLOCK)),
            ("l2_acts", fp8, (recv, i)),
            ("l2_acts_sf", torch.float32, (recv, i // BLOCK)),
            ("combine", torch.bfloat16, (k, tmax, h)),
        ]


def get_symm_buffer_for_sm90_mega_moe(
    group: Any, num_experts: int, num_max_tokens_per_rank: int, num_topk: int, hidden: int,
    intermediate_hidden: int, *, device: torch.device | str | None = None,
) -> SM90ForkSymmBuffer:
    """Allocate the buffer (capacity rounded up to 384 tokens, zero-filled).

    Args:
        group: ``None`` or a process group of one rank.
        num_experts, num_max_tokens_per_rank, num_topk: positive ints.
        hidden, intermediate_hidden: multiples of 128.
        device: moewire extension; default as the other stand-in buffers.

    Raises:
        ValueError: a bad size, or a group of several ranks (not in this stand-in).
    """
    where = "get_symm_buffer_for_sm90_mega_moe"
    num_ranks, _ = group_size_rank(group, where)
    if num_ranks != 1:
        raise ValueError(
            f"{where}: the stand-in of the SM90 fork runs one rank, got a group of "
            f"{num_ranks}; use moewire.reference.deep_gemm (flavour deepgemm-sm90) for EP"
        )
    for name, value in (("num_experts", num_experts), ("num_topk", num_topk),
                        ("num_max_tokens_per_rank", num_max_tokens_per_rank)):
        positive_int(value, name, where)
    for name, value in (("hidden", hidden), ("intermediate_hidden", intermediate_hidden)):
        positive_int(value, name, where)
        if value % BLOCK:
            raise ValueError(f"{where}: {name}={value} must be a multiple of {BLOCK}")
    device = torch.device(device) if device is not None else default_device(group)
    return SM90ForkSymmBuffer(
        group, num_experts, align(num_max_tokens_per_rank, TOKEN_ALIGNMENT), num_topk, hidden,
        intermediate_hidden, device,
    )


def transform_weights_for_mega_moe_sm90(
    l1_weights: tuple[torch.Tensor, torch.Tensor], l2_weights: tuple[torch.Tensor, torch.Tensor]
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The stand-in keeps the checkpoint layout (its kernel reads it as is); new tensors.

    Args:
        l1_weights: (FP8 ``[E, 2I, H]`` gate rows then up rows, FP32 ``[E, 2I/128, H/128]``).
        l2_weights: (FP8 ``[E, H, I]``, FP32 ``[E, H/128, I/128]``).
    """
    for name, (w, sf) in (("l1_weights", l1_weights), ("l2_weights", l2_weights)):
        e, n, k = w.shape
        if w.dtype != torch.float8_e4m3fn or sf.dtype != torch.float32 or tuple(sf.shape) != (
            e, -(-n // BLOCK), -(-k // BLOCK)
        ):
            raise ValueError(
                f"transform_weights_for_mega_moe_sm90: {name} must be (FP8 E4M3 [E, N, K], "
                f"FP32 [E, N/128, K/128]), got {w.dtype} {list(w.shape)} and {sf.dtype} "
                f"{list(sf.shape)}"
            )
    return tuple(tuple(t.clone() for t in pair) for pair in (l1_weights, l2_weights))


def _dequant_blocks(w: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """FP32 ``[N, K]`` of FP8 ``[N, K]`` with one scale per 128x128 block."""
    full = sf.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return w.float() * full[: w.shape[0], : w.shape[1]]


def _cast_rows(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 per row and 128 columns, ``sf = max(amax, 1e-4) / 448`` (no power of two)."""
    return utils.per_token_cast_to_fp8(h, use_ue8m0=False, gran_k=BLOCK)


def fp8_mega_moe_sm90(
    y: torch.Tensor,
    l1_weights: tuple[torch.Tensor, torch.Tensor],
    l2_weights: tuple[torch.Tensor, torch.Tensor],
    symm_buffer: SM90ForkSymmBuffer,
    *,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    activation_clamp: float | None = None,
    fast_math: bool = True,
) -> None:
    """The fused FP8 x FP8 Mega-MoE on one rank; writes ``y`` (BF16 ``[T, H]``).

    Reads the ``T = y.shape[0]`` staged tokens (``x``/``x_sf``, ``topk_idx``,
    ``topk_weights``); ids outside ``[-1, E)`` raise. ``fast_math`` is accepted; the
    stand-in uses exact ``silu``. ``cumulative_local_expert_recv_stats`` (int32 ``[E]``)
    gains the rows each expert received.
    """
    buf = symm_buffer
    if not isinstance(buf, SM90ForkSymmBuffer) or buf.buffer is None:
        raise TypeError(
            "fp8_mega_moe_sm90: symm_buffer must be a live buffer from "
            f"get_symm_buffer_for_sm90_mega_moe, got {type(buf).__name__}"
        )
    t, h = y.shape
    if h != buf.hidden or t > buf.num_max_tokens_per_rank or y.dtype != torch.bfloat16:
        raise ValueError(
            f"fp8_mega_moe_sm90: y must be BF16 [T <= {buf.num_max_tokens_per_rank}, "
            f"{buf.hidden}], got {y.dtype} {list(y.shape)}"
        )
    ids = buf.topk_idx[:t]
    if bool(((ids < -1) | (ids >= buf.num_experts)).any()):
        raise ValueError(
            f"fp8_mega_moe_sm90: topk_idx[:{t}] holds ids outside [-1, {buf.num_experts})"
        )
    k, i = buf.num_topk, buf.intermediate_hidden
    x = (buf.x[:t].float().view(t, h // BLOCK, BLOCK) * buf.x_sf[:t, :, None]).view(t, h)
    rows = buf.buffer[buf.buffer.numel() - k * buf.num_max_tokens_per_rank * h * 2 :]
    rows = rows.view(torch.bfloat16).view(k, buf.num_max_tokens_per_rank, h)
    (w1, s1), (w2, s2) = l1_weights, l2_weights
    for e in ids[ids >= 0].unique().tolist():
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        gate_up = (x[token] @ _dequant_blocks(w1[e], s1[e]).T).bfloat16().float()
        gate, up = gate_up[:, :i], gate_up[:, i:]
        if activation_clamp is not None:
            gate, up = gate.clamp(max=activation_clamp), up.clamp(-activation_clamp,
                                                                   activation_clamp)
        act = torch.nn.functional.silu(gate) * up * buf.topk_weights[token, slot, None]
        q, sf = _cast_rows(act.bfloat16())
        act = (q.float().view(-1, i // BLOCK, BLOCK) * sf[:, :, None]).view(-1, i)
        rows[slot, token] = (act @ _dequant_blocks(w2[e], s2[e]).T).bfloat16()
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats[e] += token.numel()
    acc = torch.zeros(t, h, dtype=torch.float32, device=y.device)
    for s in range(k):
        acc = torch.where((ids[:, s] >= 0)[:, None], acc + rows[s, :t].float(), acc)
    y.copy_(acc.bfloat16())
