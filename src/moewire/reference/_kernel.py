"""The stand-in Mega-MoE kernel body: checks, dispatch, expert GEMMs, combine.

Vectorized over tokens: rows are grouped by expert and each expert does one matmul on its
rows (a loop over experts, never over tokens). Weights are dequantized to FP32 (exact:
E2M1 or E4M3 times a power of two) and cached; FP8 x FP4 and BF16 x BF16 products are
exact in FP32, so the result differs from the hardware's only in the order in which the
FP32 accumulator adds the K products (and in ``silu``, see ``docs/reference.md``).

Also the pieces ``nvfp4.mega_moe`` shares: the tensor checks, the grouped matmul and the
all-to-all. The dequantized weights and their cache are ``_weights_cache``'s.

May import: torch, ``moewire.reference._alloc``, ``_numerics``, ``_weights_cache``,
``moewire.reference.buffer`` (for :class:`SymmBuffer`) and ``moewire.reference.builds``
(a build's SiTU spelling); never the ``deep_gemm`` API, which imports this module.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moewire.reference._alloc import fail as _fail
from moewire.reference._numerics import (
    cast_to_fp8_ue8m0,
    fp8_combine_decode,
    fp8_combine_encode,
    pack_ue8m0,
    scale_groups,
    unpack_ue8m0,
)
from moewire.reference._weights_cache import Experts
from moewire.reference.buffer import SymmBuffer
from moewire.reference.builds import SITU_ALPHA_BETA

# --------------------------------------------------------------------------- checks


def _check_tensor(kernel, name, t, dtype, shape, device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(kernel, f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        _fail(kernel, f"{name} must have dtype {dtype}, got {t.dtype}", TypeError)
    if tuple(t.shape) != tuple(shape):
        _fail(kernel, f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        _fail(kernel, f"{name} is on {t.device} but the symm buffer is on {device}; move it")


def _check_weights(kernel, name, weights, fp8, n, k, lead, device) -> None:
    """``lead`` is the expert dim (``(E_local,)``) or ``()`` for a shared expert."""
    if fp8:
        if not isinstance(weights, tuple) or len(weights) != 2:
            _fail(kernel, f"{name} must be a (weight, scale) tuple", TypeError)
        w, sf = weights
        if isinstance(w, torch.Tensor) and w.dtype == torch.float8_e4m3fn:
            _check_tensor(kernel, f"{name}[0]", w, torch.float8_e4m3fn, (*lead, n, k), device)
        else:
            packed = (torch.int8, torch.uint8)
            _check_tensor(kernel, f"{name}[0]", w, packed, (*lead, n, k // 2), device)
        _check_tensor(kernel, f"{name}[1]", sf, torch.int32, (*lead, n, k // 128), device)
    else:
        _check_tensor(kernel, name, weights, torch.bfloat16, (*lead, n, k), device)


def _check_y(kernel: str, y: Any, buf: Any) -> int:
    """``y`` is BF16 ``[T, H]``, contiguous, on the buffer's device, ``T <= Tmax``; ``T``."""
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        _fail(kernel, "y must be a 2-D BF16 tensor [T, H]", TypeError)
    t = y.shape[0]
    if t > buf.num_max_tokens_per_rank:
        _fail(
            kernel,
            f"y has T={t} tokens but the symm buffer holds at most "
            f"num_max_tokens_per_rank={buf.num_max_tokens_per_rank}; allocate a larger buffer "
            f"or split the batch",
        )
    _check_tensor(kernel, "y", y, torch.bfloat16, (t, buf.hidden), buf.buffer.device)
    if not y.is_contiguous():
        _fail(kernel, "y must be contiguous")
    return t


def _check_shared_given(kernel: str, buf: Any, shared_l1: Any, shared_l2: Any) -> None:
    """Both fused shared-expert weights or neither, exactly when the buffer has the slot."""
    if (shared_l1 is None) != (shared_l2 is None):
        _fail(kernel, "pass both shared_l1_weights and shared_l2_weights, or neither")
    if buf.num_shared_experts and shared_l1 is None:
        _fail(
            kernel,
            f"sym_buffer was built with num_shared_experts={buf.num_shared_experts}; pass "
            f"shared_l1_weights and shared_l2_weights",
        )
    if not buf.num_shared_experts and shared_l1 is not None:
        _fail(
            kernel,
            "shared_l1_weights given but sym_buffer has no shared slot; build it with "
            "num_shared_experts > 0",
        )


@dataclass(frozen=True)
class Activation:
    """The gated activation of L1's epilogue, then the router weight (DeepGEMM
    ``impls/sm100_fp8_fp4_mega_moe.cuh``). FP32 throughout, on ``gate`` and ``up`` rounded
    to BF16 from the L1 accumulator.

    ``swiglu``: ``gate = min(gate, c)``, ``up = clamp(up, -c, c)`` with a clamp ``c``, then
    ``h = silu(gate) * up``.

    ``situ`` (Kimi-K3's SiTU; no clamp), with a gate scale ``b_g > 0`` (:attr:`alpha`) and
    an up scale ``b_u >= 0`` (:attr:`beta`)::

        h = b_g * tanh(gate / b_g) * sigmoid(gate) * up'
        up' = b_u * tanh(up / b_u)   if b_u > 0
        up' = up                     if b_u == 0 (unset)

    ``tanh(v)`` is evaluated as ``2 * sigmoid(2v) - 1`` (vLLM 0.33/0.34's bundled
    ``impls/sm100_fp8_fp4_mega_moe_situ.cuh`` l.1076-1101; vllm-project/DeepGEMM 51655f2's
    kernel calls ``tanhf``/``__tanhf``: the stand-in differs there in the last bits, as in
    ``silu``). Kimi-K3's config sets ``b_g = 4``, ``b_u = 25``.

    The two scales have four spellings, and the keyword ``activation_beta`` names ``b_g`` in
    one of them and ``b_u`` in another, so the kernel build decides (the stand-in reads the
    buffer's build, ``KernelBuild.situ_kwargs``):

    - Kimi-K3's config and vLLM's ``KimiMLP``/``SituAndMul``: ``activation_situ_beta``
      (``b_g``), ``activation_situ_linear_beta`` (``b_u``).
    - vllm-project/DeepGEMM's 2.6.1 SiTU line (``deep_gemm/mega/__init__.py``,
      ``csrc/apis/mega.hpp`` at 51655f2) and vLLM main's ``KimiK3MegaMoEExperts`` (ed51064):
      ``activation_beta`` (``b_g``, default 1), ``activation_linear_beta`` (``b_u``, default
      unset).
    - DeepGEMM 2.8.x: vLLM 0.32-0.34's bundled copies and vllm-project/DeepGEMM dev
      (``deep_gemm/_C.py``, ``csrc/apis/mega_moe.hpp`` at 051140f): ``activation_alpha``
      (``b_g``, default 1), ``activation_beta`` (``b_u``, 0 = unset). vLLM 0.32's
      ``KimiK3MegaMoEExperts`` passes ``activation_alpha=activation_beta or 1.0`` and
      ``activation_beta=activation_linear_beta or 0.0``.
    - FlashInfer ``moe_ep`` (vLLM ``kimi_k3/nvidia/fi_moe.py``): ``situ_beta`` (``b_g``),
      ``situ_linear_beta`` (``b_u``).

    vLLM PR #56876 moved vLLM's pin from the first DeepGEMM spelling to the second.
    """

    name: str = "swiglu"
    clamp: float | None = None
    alpha: float = 1.0
    beta: float = 0.0

    @classmethod
    def from_kernel_kwargs(
        cls,
        kernel: str,
        spelling: tuple[str, str],
        activation: str,
        clamp: float | None,
        scales: dict[str, float | None],
    ) -> Activation:
        """The activation of one kernel call, its SiTU scales read in the build's spelling.

        Args:
            kernel: the kernel function (errors).
            spelling: the build's ``(gate scale, up scale)`` keywords
                (``KernelBuild.situ_kwargs``).
            activation, clamp: the call's ``activation`` and ``activation_clamp``.
            scales: keyword -> value (``None``: not given) of every SiTU scale keyword the
                API takes.

        Raises:
            TypeError: a scale keyword this build's kernel does not take was given.
        """
        foreign = sorted(k for k, v in scales.items() if v is not None and k not in spelling)
        if foreign:
            _fail(
                kernel,
                f"this kernel build spells SiTU's gate and up tanh scales {spelling[0]} and "
                f"{spelling[1]}; it takes no {', '.join(foreign)} (another DeepGEMM build's "
                "spelling: activation_beta names a different scale there)",
                TypeError,
            )
        gate, up = (scales.get(k) for k in spelling)
        return cls(activation, clamp, 1.0 if gate is None else gate, 0.0 if up is None else up)

    def apply(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.name == "situ":
            def tanh(v: torch.Tensor) -> torch.Tensor:
                return 2.0 * torch.sigmoid(2.0 * v) - 1.0

            gated = tanh(gate * (1.0 / self.alpha)) * self.alpha * torch.sigmoid(gate)
            if self.beta > 0:
                up = tanh(up * (1.0 / self.beta)) * self.beta
            return gated * up
        if self.clamp is not None:
            gate = gate.clamp(max=self.clamp)
            up = up.clamp(min=-self.clamp, max=self.clamp)
        return F.silu(gate) * up


def _validate(kernel, y, l1, l2, buf, shared_l1, shared_l2, recipe, act):
    if not isinstance(buf, SymmBuffer):
        _fail(
            kernel,
            f"sym_buffer must be a SymmBuffer from get_symm_buffer_for_mega_moe, got "
            f"{type(buf).__name__}",
            TypeError,
        )
    if buf.buffer is None:
        _fail(kernel, "sym_buffer was destroyed; allocate a new one")
    fp8 = kernel == "fp8_fp4_mega_moe"
    wanted = "fp8xfp4" if fp8 else "bf16xbf16"
    if buf.mma_type != wanted:
        _fail(
            kernel,
            f"sym_buffer was built with mma_type={buf.mma_type!r}; this kernel needs "
            f"{wanted!r} (call {'bf16_mega_moe' if fp8 else 'fp8_fp4_mega_moe'} instead)",
        )
    if fp8 and tuple(recipe) != (1, 1, 32):
        _fail(kernel, f"recipe must be (1, 1, 32), got {recipe!r}")
    if act.name not in ("swiglu", "situ"):
        _fail(kernel, f"activation must be 'swiglu' or 'situ', got {act.name!r}")
    if act.name != buf.activation:
        _fail(
            kernel,
            f"activation={act.name!r} but sym_buffer was built for activation="
            f"{buf.activation!r}; build the buffer with the kernel's activation",
        )
    clamp = act.clamp
    if clamp is not None and not (isinstance(clamp, (int, float)) and clamp > 0):
        _fail(kernel, f"activation_clamp must be a positive float or None, got {clamp!r}")
    if act.name == "situ" and (clamp is not None or not act.alpha > 0 or not act.beta >= 0):
        _fail(
            kernel,
            f"situ takes no activation_clamp, activation_alpha > 0 and activation_beta >= 0; "
            f"got clamp={clamp!r}, alpha={act.alpha!r}, beta={act.beta!r}",
        )
    if act.name == "swiglu" and (act.alpha != 1.0 or act.beta != 0.0):
        _fail(
            kernel,
            "swiglu with activation_alpha/activation_beta (GPT-OSS style) is not in the "
            f"stand-in; got alpha={act.alpha!r}, beta={act.beta!r}",
        )
    device = buf.buffer.device
    h, i, e = buf.hidden, buf.intermediate_hidden, buf.num_experts_per_rank
    t = _check_y(kernel, y, buf)
    _check_weights(kernel, "l1_weights", l1, fp8, 2 * i, h, (e,), device)
    _check_weights(kernel, "l2_weights", l2, fp8, h, i, (e,), device)
    _check_shared_given(kernel, buf, shared_l1, shared_l2)
    if shared_l1 is not None:
        shared_i = buf.num_shared_experts * i
        _check_weights(kernel, "shared_l1_weights", shared_l1, fp8, 2 * shared_i, h, (), device)
        _check_weights(kernel, "shared_l2_weights", shared_l2, fp8, h, shared_i, (), device)
    return t


# --------------------------------------------------------------------------- math


def _grouped_matmul(
    x: torch.Tensor, experts: Any, ends: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x[rows of e] @ W[e].T`` for rows grouped by expert, accumulated in FP32; rows past
    the last group are left undefined.

    ``x`` holds dequantized activations that are exact in the cache's dtype (BF16 on CUDA:
    FP8, BF16, E2M1 times E4M3), so casting it loses nothing. ``experts``: an
    :class:`Experts` or anything with its ``dense``, ``dtype``, ``n`` and ``[e]``.
    ``ends``: int32 ``[E]`` on the device, cumulative row counts (group ``e`` is rows
    ``ends[e-1]:ends[e]``). ``out_dtype``: ``None`` returns the cache's dtype (FP32 on CPU;
    BF16 on CUDA, rounded to nearest even from the FP32 accumulator, for callers that round
    to BF16 anyway); ``torch.float32`` returns the accumulator unrounded (the NVFP4 kernel
    scales it by alpha first). The per-expert loop always returns FP32.

    With cached weights this is one ``torch._grouped_mm``, which needs no host sync
    (capturable in a CUDA graph); otherwise, or where the backend lacks it, a loop over
    experts with the counts read on the host, which a capture refuses with a clear error.
    """
    if experts.dense is not None and x.shape[0]:
        try:
            return torch._grouped_mm(
                x.to(experts.dtype), experts.dense.transpose(1, 2), offs=ends,
                out_dtype=out_dtype,
            )
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            # torch's CUDA _grouped_mm takes BF16 in and BF16 out only (its fallback wants
            # out_dtype == mat_a's dtype and reads the offsets on the host). Under a capture
            # the rows of each expert are selected on the device instead.
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return _masked_grouped_matmul(x, experts, ends)
    elif x.is_cuda and x.shape[0] and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "moewire.reference: the expert weights are not cached (larger than "
            "MOEWIRE_REFERENCE_WEIGHT_CACHE_BYTES), and the per-expert loop reads row counts "
            "on the host, which a CUDA graph capture forbids; run eagerly, or raise "
            "MOEWIRE_REFERENCE_WEIGHT_CACHE_BYTES so the weights stay cached"
        )
    out = torch.empty((x.shape[0], experts.n), dtype=torch.float32, device=x.device)
    bounds = [0, *ends.tolist()]
    for e in range(len(bounds) - 1):
        if bounds[e + 1] > bounds[e]:
            rows = slice(bounds[e], bounds[e + 1])
            torch.mm(x[rows], experts[e].t(), out=out[rows])
    return out


def _masked_grouped_matmul(x: torch.Tensor, experts: Any, ends: torch.Tensor) -> torch.Tensor:
    """FP32 ``x[rows of e] @ W[e].T`` with no host sync: each expert's product over all rows,
    kept where the row is that expert's (``E`` times the work of the grouped product; the
    stand-in takes it only inside a CUDA-graph capture). The products are those of the
    per-expert loop: FP32 inputs exact in the cache's dtype, FP32 accumulation."""
    rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
    group = torch.searchsorted(ends, rows, right=True)
    xf = x.float()
    out = torch.zeros((x.shape[0], experts.n), dtype=torch.float32, device=x.device)
    for e in range(experts.dense.shape[0]):
        out = torch.where((group == e).unsqueeze(1), xf @ experts.dense[e].float().t(), out)
    return out


def _expert_mlp(
    x: torch.Tensor,
    ends: torch.Tensor,
    l1: Experts,
    l2: Experts,
    weight: torch.Tensor,
    act: Activation,
    fp8: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The kernel's numerics for rows grouped by expert (DeepGEMM
    ``impls/sm100_fp8_fp4_mega_moe.cuh``).

    Args:
        x: FP32 ``[N, H]`` dequantized inputs, rows of expert 0 first, then expert 1, ...
        ends: int32 ``[E]`` cumulative rows per expert (rows past ``ends[-1]`` are unused).
        weight: FP32 ``[N]`` router weight of each row.

    Returns:
        ``(rows, h_q, h_sf)``: BF16 ``[N, H]`` combine rows, the L2 input as staged in the
        buffer (FP8 ``[N, I]`` and packed int32 scales, or BF16 and ``None``).
    """
    gate, up = _grouped_matmul(x, l1, ends).bfloat16().float().chunk(2, dim=1)
    h = act.apply(gate, up)
    h = h * weight.unsqueeze(1)
    if fp8:
        h_q, h_sf = cast_to_fp8_ue8m0(h, 32, amax_floor=None)
        h_in = scale_groups(h_q.float(), h_sf)
        h_sf = pack_ue8m0(h_sf)
    else:
        h_q, h_sf = h.bfloat16(), None
        h_in = h_q.float()
    return _grouped_matmul(h_in, l2, ends).bfloat16(), h_q, h_sf


# --------------------------------------------------------------------------- comm


def _all_to_all(payload: torch.Tensor, send_counts: list[int], buf) -> tuple[torch.Tensor, list]:
    """Exchange rows of a uint8 ``[n, P]`` payload; returns the received rows and counts."""
    width = payload.shape[1]
    send = torch.tensor(send_counts, dtype=torch.int64, device=payload.device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=buf.group)
    recv_counts = recv.tolist()
    out = torch.empty((sum(recv_counts), width), dtype=torch.uint8, device=payload.device)
    dist.all_to_all_single(
        out.view(-1),
        payload.contiguous().view(-1),
        [c * width for c in recv_counts],
        [c * width for c in send_counts],
        group=buf.group,
    )
    return out, recv_counts


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, bytes per row]`` view of a 2-D tensor's rows."""
    width = math.prod(t.shape[1:]) * t.element_size()
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], width)


# --------------------------------------------------------------------------- kernel


def mega_moe(
    kernel: str,
    y: torch.Tensor,
    l1_weights: Any,
    l2_weights: Any,
    buf,
    shared_l1: Any,
    shared_l2: Any,
    *,
    recipe,
    activation: str,
    activation_clamp: float | None,
    stats: torch.Tensor | None,
    situ_scales: dict[str, float | None] | None = None,
) -> None:
    """Run one Mega-MoE call (see ``deep_gemm.fp8_fp4_mega_moe`` for the math).

    ``situ_scales``: every SiTU scale keyword of the API -> its value (``None``: not
    given), read in the buffer's build's spelling (:meth:`Activation.from_kernel_kwargs`).
    """
    build = getattr(buf, "build", None)
    spelling = build.situ_kwargs if build is not None else SITU_ALPHA_BETA
    act = Activation.from_kernel_kwargs(
        kernel, spelling, activation, activation_clamp, situ_scales or {}
    )
    t = _validate(kernel, y, l1_weights, l2_weights, buf, shared_l1, shared_l2, recipe, act)
    fp8 = kernel == "fp8_fp4_mega_moe"
    device = buf.buffer.device
    e_local, h, i, k = buf.num_experts_per_rank, buf.hidden, buf.intermediate_hidden, buf.num_topk
    if stats is not None:
        _check_tensor(
            kernel, "cumulative_local_expert_recv_stats", stats, torch.int32, (e_local,), device
        )

    topk_idx = buf.topk_idx[:t]
    bad = (topk_idx < -1) | (topk_idx >= buf.num_experts)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        torch._assert_async(~bad.any())  # no host sync inside a CUDA graph
    elif bool(bad.any()):
        _fail(
            kernel,
            f"sym_buffer.topk_idx[:{t}] holds expert ids outside [-1, {buf.num_experts}); "
            "stage valid ids (padding slots get -1)",
        )

    fp8_combine = getattr(buf, "use_fp8_combine", False)
    # The FP8 combine: the rows are formed in BF16 (the epilogue's `packed`), then written
    # as FP8 bytes and scales; scratch holds the BF16 rows until then.
    region = (
        torch.zeros((buf.num_slots, buf.num_max_tokens_per_rank, h), dtype=torch.bfloat16,
                    device=device)
        if fp8_combine else buf.combine_rows()
    )
    l1 = Experts(l1_weights, True, e_local, 2 * i, h)
    l2 = Experts(l2_weights, False, e_local, h, i)
    routed = _routed_one_rank if buf.num_ranks == 1 else _routed_expert_parallel
    counts = routed(buf, t, fp8, l1, l2, act, region)
    if stats is not None:
        stats += counts.to(torch.int32)
    valid = buf.topk_idx[:t] >= 0
    norms = buf.combine_norms()
    if norms is not None and fp8_combine:
        _fail(kernel, "DG_USE_FP8_COMBINE=1 with a post-combine norm buffer is not modelled "
                      "(sgl-deep-gemm folds no FP8 scale into its norm partials); unset it")
    if norms is not None:
        _write_combine_norms(norms, region, valid, t)

    # Every build stores a fused shared expert's row at slot k (layout/mega_moe.cuh); all T
    # tokens get one (impls/sm100_fp8_fp4_mega_moe.cuh: lane kNumTopk is always valid).
    if shared_l1 is not None:
        if t:
            x_all = _dequantized_tokens(buf.x[:t], buf.x_sf[:t] if fp8 else None)
            shared_i = buf.num_shared_experts * i
            s1 = Experts(shared_l1, True, 1, 2 * shared_i, h)
            s2 = Experts(shared_l2, False, 1, h, shared_i)
            ones = torch.ones(t, dtype=torch.float32, device=device)
            ends = torch.full((1,), t, dtype=torch.int32, device=device)
            shared_rows, _, _ = _expert_mlp(
                x_all, ends, s1, s2, ones, act, fp8
            )
            region[k, :t].copy_(shared_rows)

    if fp8_combine:
        rows_of = _write_fp8_combine(buf, region, valid, t, shared_l1 is not None)
    else:
        def rows_of(s: int) -> torch.Tensor:
            return region[s, :t].float()

    acc = torch.zeros((t, h), dtype=torch.float32, device=device)
    order_of_adds = list(range(k))
    if shared_l1 is not None:
        order_of_adds.insert(0 if buf.build.shared_position == "first" else k, k)
    for s in order_of_adds:
        if s == k:
            acc += rows_of(k)
        else:
            # Select, never multiply: an invalid slot's row is stale and may hold NaN.
            acc = torch.where(valid[:, s : s + 1], acc + rows_of(s), acc)
    y.copy_(acc.bfloat16())

    if _debug_zeroing():
        buf.buffer.zero_()


def _write_fp8_combine(buf, region: torch.Tensor, valid: torch.Tensor, t: int, shared: bool):
    """Store the BF16 rows of ``region`` as DeepGEMM's FP8 combine does and return the
    reduce's reader: slot ``s`` -> FP32 ``[t, H]``, each FP8 byte times its tile's scale
    (``fma(v, sf, acc)`` with an exact product is ``acc + v * sf``).

    Only the rows the kernel writes change: the valid routed (token, slot) pairs and, with
    a fused shared expert, row ``k`` of every token; the others keep their stale bytes.
    """
    q_all, sf_all = buf.combine_fp8()
    k = buf.num_topk
    q, sf = fp8_combine_encode(region[:, :t])
    written = torch.ones((buf.num_slots, t, 1), dtype=torch.bool, device=region.device)
    written[:k] = valid.T.unsqueeze(-1)
    if not shared and buf.num_slots > k:
        written[k:] = False
    old_q = q_all[:, :t].view(torch.uint8)
    q_all[:, :t].view(torch.uint8).copy_(torch.where(written, q.view(torch.uint8), old_q))
    sf_all[:, :t].copy_(torch.where(written, sf, sf_all[:, :t]))

    def rows_of(s: int) -> torch.Tensor:
        return fp8_combine_decode(q_all[s, :t], sf_all[s, :t])

    return rows_of


def _dequantized_tokens(q: torch.Tensor, sf: torch.Tensor | None) -> torch.Tensor:
    """FP32 ``[N, H]`` of staged FP8 rows and packed scales (BF16 rows when ``sf`` is None)."""
    return q.float() if sf is None else scale_groups(q.float(), unpack_ue8m0(sf))


def _write_combine_norms(
    norms: torch.Tensor, region: torch.Tensor, valid: torch.Tensor, t: int
) -> None:
    """FP32 squared-norm partials (one per 128 columns) of each valid routed row, into the
    ``combine_norm_buffer`` after the combine region (vLLM 0.33/0.34's bf16 kernel)."""
    k, _, groups = norms.shape
    partial = region[:k, :t].float().square().reshape(k, t, groups, 128).sum(-1)
    norms[:, :t] = torch.where(valid.T.unsqueeze(-1), partial, norms[:, :t])


def _routed_one_rank(buf, t, fp8, l1, l2, act, region) -> torch.Tensor:
    """All routed rows of a one-rank buffer, with static shapes and no host sync.

    Every (token, slot) pair is processed in expert order; invalid slots get a sentinel
    expert that sorts last, past every group, and their combine rows are written back
    unchanged (selected, not recomputed). Returns int32 rows per local expert.
    """
    e_local, k = buf.num_experts_per_rank, buf.num_topk
    tmax, h = buf.num_max_tokens_per_rank, buf.hidden
    device = buf.buffer.device
    idx = buf.topk_idx[:t]
    flat = torch.where(idx >= 0, idx, e_local).flatten()
    order = torch.argsort(flat, stable=True)
    token, slot, expert = order // k, order % k, flat[order]
    ends = torch.searchsorted(
        expert, torch.arange(e_local, device=device), right=True
    ).to(torch.int32)
    n = t * k
    act_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    x_q = buf.x[:t].view(torch.uint8)[token].view(act_dtype)
    buf.l1_acts[:n].copy_(x_q)
    x_sf = None
    if fp8:
        x_sf = buf.x_sf[:t][token]
        buf.l1_acts_sf[:n].copy_(x_sf)
    weight = buf.topk_weights[:t].flatten()[order]
    x_in = _dequantized_tokens(x_q, x_sf)
    rows, h_q, h_sf = _expert_mlp(x_in, ends, l1, l2, weight, act, fp8)
    buf.l2_acts[:n].copy_(h_q)
    if fp8:
        buf.l2_acts_sf[:n].copy_(h_sf)
    flat_region = region.view(-1, h)
    dest = slot * tmax + token
    keep = (expert < e_local).unsqueeze(1)
    flat_region.index_copy_(0, dest, torch.where(keep, rows, flat_region[dest]))
    return torch.diff(ends, prepend=torch.zeros(1, dtype=torch.int32, device=device))


def valid_slots_by_rank(
    topk_idx: torch.Tensor, e_local: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The valid (token, slot) pairs of ``topk_idx`` (int64 ``[T, k]``, ``-1`` invalid),
    sorted stably by the rank that owns their expert (experts split evenly, ``e_local`` a
    rank): int64 ``token``, ``slot``, ``expert`` and destination ``rank``, each ``[n]``."""
    token, slot = torch.nonzero(topk_idx >= 0, as_tuple=True)
    expert = topk_idx[token, slot]
    dest = torch.div(expert, e_local, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    return token[order], slot[order], expert[order], dest[order]


def _routed_expert_parallel(buf, t, fp8, l1, l2, act, region) -> torch.Tensor:
    """Routed rows over several ranks: all-to-all out, expert MLPs, all-to-all back.

    Only valid (token, slot) pairs travel: one payload row each (FP8 row, packed scales,
    router weight, local expert id), sorted by destination rank. The rows come back in the
    order they were sent and land in this rank's combine region. Returns int32 rows
    received per local expert.
    """
    e_local, tmax, h = buf.num_experts_per_rank, buf.num_max_tokens_per_rank, buf.hidden
    token, slot, expert, dest = valid_slots_by_rank(buf.topk_idx[:t], e_local)
    # Gather on byte views: advanced indexing of FP8 tensors is not on every device.
    fields = [_bytes(buf.x[:t].view(torch.uint8)[token])]
    if fp8:
        fields.append(_bytes(buf.x_sf[:t][token]))
    fields.append(_bytes(buf.topk_weights[:t][token, slot].unsqueeze(1)))
    fields.append(_bytes((expert - dest * e_local).to(torch.int32).unsqueeze(1)))
    widths = [f.shape[1] for f in fields]
    send_counts = torch.bincount(dest, minlength=buf.num_ranks).tolist()
    received, recv_counts = _all_to_all(torch.cat(fields, dim=1), send_counts, buf)

    parts = list(torch.split(received, widths, dim=1))
    local = parts[-1].contiguous().view(torch.int32).squeeze(1).long()
    weight = parts[-2].contiguous().view(torch.float32).squeeze(1)
    by_expert = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=e_local)
    n = received.shape[0]
    act_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    x_q = parts[0][by_expert].contiguous().view(act_dtype)
    buf.l1_acts[:n].copy_(x_q)
    x_sf = None
    if fp8:
        x_sf = parts[1][by_expert].contiguous().view(torch.int32)
        buf.l1_acts_sf[:n].copy_(x_sf)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    rows, h_q, h_sf = _expert_mlp(
        _dequantized_tokens(x_q, x_sf), ends, l1, l2, weight[by_expert], act, fp8
    )
    buf.l2_acts[:n].copy_(h_q)
    if fp8:
        buf.l2_acts_sf[:n].copy_(h_sf)

    back = torch.empty_like(rows)
    back[by_expert] = rows
    back_bytes, _ = _all_to_all(_bytes(back), recv_counts, buf)
    dest_rows = slot * tmax + token
    region.view(-1, h).index_copy_(0, dest_rows, back_bytes.view(torch.bfloat16))
    return counts


def _debug_zeroing() -> bool:
    return os.environ.get("DG_COMM_KERNEL_DEBUG", "0").strip() not in ("", "0")
