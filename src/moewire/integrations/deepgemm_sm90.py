"""DeepGEMM's SM90 Mega-MoE kernels (pull request #323) as a moewire experts target.

DeepGEMM's PR #323 (``refs/pull/323/head`` = 8ddf7f9, the SM90 port of sgl-project's
kernels) runs on H100/H200: ``deep_gemm.fp8_mega_moe`` (FP8 activations x FP8 weights,
128x128 block scales, recipe ``(128, 128, 128)``) and, on SM90, ``deep_gemm.fp8_fp4_mega_moe``
(FP8 activations x FP4 weights, UE8M0 per 32, recipe ``(1, 1, 32)``), with the buffer from
``deep_gemm.get_symm_buffer_for_sm90_mega_moe`` (DeepGEMM PR #323 at 8ddf7f9, verified on an H200):

- the combine rows are BF16 ``[k][Tmax][H]``, router-weighted, in the buffer's last region,
  which starts where the ``l2_acts_sf`` view ends; no fused shared expert;
- the buffer's views are DLPack tensors that share no storage with ``.buffer``, so the
  region is located by ``data_ptr()`` differences (flavour ``deepgemm-sm90`` of
  ``moewire.megamoe.flavours``, rule ``after_l2_scales``);
- ``fp8_fp4_mega_moe`` on SM90 is not deterministic across calls (each call's rows still
  re-sum to that call's ``y`` bit for bit), which the layout check allows for: it compares a
  call's rows with the same call's ``y``;
- ``DG_COMM_KERNEL_DEBUG=1`` zeroes the whole buffer after every call: the combine rows are
  gone, so moewire refuses a combine quantizer while it is set (:func:`symm_buffer_of`).

Two ways in:

- :class:`SM90MegaMoEExperts`, a registered experts module that owns its buffer and
  weights (``SM90MegaMoEExperts.from_bf16`` quantizes BF16 weights for either kernel);
- :func:`register_sm90_experts` for a user's own module whose forward stages the inputs
  through a module-level function and calls ``<namespace>.fp8_mega_moe`` /
  ``fp8_fp4_mega_moe`` through a module-level ``deep_gemm`` namespace.

Then ``moewire.quantize(model, recipe, forward_loop)`` works as on any Mega-MoE module.
Build the package with ``scripts/real_kernel/build_kit.sh``; see docs/real-kernel.md.

Why this module sits beside ``_host`` and in no host package: it is no host (no framework
calls it; it is moewire's own experts module on a real kernel), and three users above or
beside the hosts need it: the transformers host (``prepare(kernel="deepgemm-sm90")``), the
study (``moewire study --kernel deepgemm-sm90``) and the evaluation (``moewire eval --kernel
deepgemm-sm90``), besides the real-kernel tests. In a host package, the other users would
import that host; here, every host may import it as shared glue.

Its experts adapter (:func:`register_sm90_experts`, :func:`symm_buffer_of`) sits with the
stand-in's in ``moewire.megamoe.deepgemm_experts``; both are re-exported here.

May import: the standard library, torch, ``moewire.megamoe.deepgemm_experts`` and
``moewire.reference`` (the experts forward, the catalogue of builds, ``from_dense``'s form
registry, the weights holder).
"""

from __future__ import annotations

import importlib
import os
import types
from typing import Any

import torch
from torch import nn

from moewire.megamoe.deepgemm_experts import (
    DEBUG_ENV,
    SM90_FLAVOUR,
    register_sm90_experts,
    symm_buffer_of,
)
from moewire.reference import catalogue
from moewire.reference._ep_experts import MegaMoEForward
from moewire.reference.dense import register_form
from moewire.reference.weights import MegaMoEWeights

__all__ = [
    "DEBUG_ENV",
    "FLAVOUR",
    "KERNELS",
    "SM90MegaMoEExperts",
    "available",
    "deep_gemm",
    "fork_names",
    "one_rank_group",
    "quantize_weights",
    "register_sm90_experts",
    "stage_sm90_inputs",
    "symm_buffer_of",
]

FLAVOUR = SM90_FLAVOUR
# kernel function -> (weight recipe, weight transform); one home for the per-kernel facts.
KERNELS: dict[str, tuple[tuple[int, int, int], str]] = {
    "fp8_mega_moe": ((128, 128, 128), "transform_weights_for_mega_moe_sm90"),
    "fp8_fp4_mega_moe": ((1, 1, 32), "transform_weights_for_mega_moe_sm90_fp4"),
}
_BLOCK = 128  # FP8 weights: one FP32 scale per 128x128 block; staging: per 128 columns


# -- the DeepGEMM package ---------------------------------------------------------------------


class _DeepGEMM:
    """The ``deep_gemm`` package, imported at first use (this module imports without it)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_import_deep_gemm(), name)

    def __repr__(self) -> str:
        return "<deep_gemm (imported at first use)>"


def _import_deep_gemm() -> Any:
    try:
        module = importlib.import_module("deep_gemm")
    except Exception as exc:  # ImportError, or an ABI error from its _C.so
        raise RuntimeError(
            f"moewire.integrations.deepgemm_sm90: cannot import deep_gemm ({exc}); build "
            "DeepGEMM's SM90 Mega-MoE package (scripts/real_kernel/build_kit.sh) and put it "
            "on PYTHONPATH (docs/real-kernel.md)"
        ) from exc
    missing = [name for name in KERNELS if not hasattr(module, name)]
    if missing:
        where = getattr(module, "__file__", None)
        raise RuntimeError(
            f"moewire.integrations.deepgemm_sm90: deep_gemm at {where} has no "
            f"{', '.join(missing)}: it is not the SM90 Mega-MoE build (DeepGEMM PR #323); "
            "build it with scripts/real_kernel/build_kit.sh"
        )
    return module


#: What :class:`SM90MegaMoEExperts` calls; moewire replaces this global by its proxy.
deep_gemm = _DeepGEMM()


def available() -> tuple[bool, str]:
    """Whether the real SM90 kernels can run here, and if not, what is missing."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return False, f"the GPU is sm_{major}{minor}, the SM90 kernels need a Hopper (sm_90)"
    try:
        _import_deep_gemm()
    except RuntimeError as exc:
        return False, str(exc)
    return True, ""


def one_rank_group() -> Any:
    """A one-rank NCCL group on the current CUDA device, for a buffer that one GPU holds.

    The SM90 buffer is torch symmetric memory over a process group (DeepGEMM PR #323's
    ``SM90SymmBuffer``). Without a process group this starts one of world size 1 (TCP on a
    free local port) with NVLink multicast kept off (``NCCL_NVLS_ENABLE=0``,
    ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``, as measured on the
    H200); with one of world size 1, it makes a new group over it.

    Raises:
        RuntimeError: no CUDA device, or a process group of several ranks is running (pass
            the expert-parallel group instead).
    """
    import socket

    import torch.distributed as dist

    if not torch.cuda.is_available():
        raise RuntimeError("one_rank_group: no CUDA device; the SM90 buffer needs a Hopper GPU")
    if not dist.is_initialized():
        for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                     "NVSHMEM_DISABLE_NVLS"):
            os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1,
                                rank=0, device_id=device)
    elif dist.get_world_size() != 1:
        raise RuntimeError(
            f"one_rank_group: a process group of {dist.get_world_size()} ranks is running; "
            "pass the expert-parallel group (the buffer spans its ranks) instead"
        )
    return dist.new_group([0])


def fork_names(real: Any = None) -> types.ModuleType:
    """PR #323's all-FP8 kernel under the names of the fork vLLM main calls on Hopper.

    vLLM main's ``DeepseekV4MegaMoESM90Experts`` (``vllm/models/deepseek_v4/nvidia/
    sm90_mega_moe.py``) calls ``fp8_mega_moe_sm90(y, l1, l2, symm_buffer, *,
    cumulative_local_expert_recv_stats, activation_clamp, fast_math)``,
    ``get_symm_buffer_for_sm90_mega_moe(group, E, T, k, H, I)`` and
    ``transform_weights_for_mega_moe_sm90((w13, s13), (w2, s2))`` on a DeepGEMM fork that is
    not available here. PR #323 has the last two under the same names and the kernel as
    ``fp8_mega_moe`` (recipe ``(128, 128, 128)``: the fork's FP8 weights with 128x128 block
    scales, ``w13_weight_scale_inv``). This builds a plain module with exactly the three
    names and ``utils`` (the staging cast): the kernel bound now, so a later hook on ``real``
    never wraps it twice.

    Args:
        real: the PR #323 package (default: ``import deep_gemm``, checked).

    Returns:
        A module ``moewire_sm90_fork`` that ``moewire.megamoe.flavours.detect`` reads as
        ``deepgemm-sm90-fork``.
    """
    real = _import_deep_gemm() if real is None else real
    kernel = real.fp8_mega_moe

    def fp8_mega_moe_sm90(
        y: torch.Tensor,
        l1_weights: Any,
        l2_weights: Any,
        symm_buffer: Any,
        *,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        activation_clamp: float | None = None,
        fast_math: bool = True,
    ) -> None:
        """The fork's signature over PR #323's ``fp8_mega_moe`` (SwiGLU, 128x128 blocks)."""
        kernel(
            y, l1_weights, l2_weights, symm_buffer,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            recipe=KERNELS["fp8_mega_moe"][0], activation="swiglu",
            activation_clamp=activation_clamp, fast_math=fast_math,
        )

    shim = types.ModuleType("moewire_sm90_fork", fork_names.__doc__)
    shim.fp8_mega_moe_sm90 = fp8_mega_moe_sm90
    shim.get_symm_buffer_for_sm90_mega_moe = real.get_symm_buffer_for_sm90_mega_moe
    shim.transform_weights_for_mega_moe_sm90 = real.transform_weights_for_mega_moe_sm90
    shim.utils = real.utils
    return shim


# -- staging ----------------------------------------------------------


def stage_sm90_inputs(
    hidden_states: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    symm_buffer: Any,
) -> None:
    """Stage ``T`` tokens into the SM90 buffer as both kernels read them.

    ``x`` gets FP8 E4M3 with one FP32 scale per 128 columns (``sf = max(amax, 1e-4) / 448``,
    DeepGEMM's ``per_token_cast_to_fp8(use_ue8m0=False, gran_k=128)``), ``topk_idx`` int64
    and ``topk_weights`` FP32. No host synchronisation (CUDA-graph safe).

    Args:
        hidden_states: BF16 ``[T, H]``.
        topk_idx: int ``[T, k]``; ``-1`` marks an invalid slot (a padding token has no
            valid slot).
        topk_weights: FP32 ``[T, k]``.
        symm_buffer: the buffer from ``get_symm_buffer_for_sm90_mega_moe``.
    """
    num_tokens = hidden_states.shape[0]
    x, x_sf = deep_gemm.utils.per_token_cast_to_fp8(
        hidden_states, use_ue8m0=False, gran_k=_BLOCK, use_packed_ue8m0=False
    )
    symm_buffer.x[:num_tokens].copy_(x)
    symm_buffer.x_sf[:num_tokens].copy_(x_sf)
    symm_buffer.topk_idx[:num_tokens].copy_(topk_idx)
    symm_buffer.topk_weights[:num_tokens].copy_(topk_weights)


# -- weights ----------------------------------------------------------------------------------


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 with one FP32 scale per 128x128 block: ``sf = max(amax, 1e-4) / 448``."""
    e, n, k = w.shape
    blocks = w.view(e, n // _BLOCK, _BLOCK, k // _BLOCK, _BLOCK).float()
    sf = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-4) / 448.0
    q = (blocks / sf[:, :, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(e, n, k).contiguous(), sf.contiguous()


def _fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 packed two per byte, one UE8M0 (as FP32) scale per 32 along the last dim."""
    e, n, k = w.shape
    q, sf = deep_gemm.utils.per_token_cast_to_fp4(w.reshape(e * n, k), use_ue8m0=True, gran_k=32)
    return q.view(e, n, k // 2), sf.view(e, n, k // 32)


def _check_shapes(l1: torch.Tensor, l2: torch.Tensor) -> tuple[int, int, int]:
    if l1.dim() != 3 or l2.dim() != 3 or l1.dtype != torch.bfloat16 or l2.dtype != torch.bfloat16:
        raise ValueError(
            "quantize_weights: l1 must be BF16 [E, 2I, H] and l2 BF16 [E, H, I], got "
            f"{l1.dtype} {list(l1.shape)} and {l2.dtype} {list(l2.shape)}"
        )
    e, two_i, h = l1.shape
    if tuple(l2.shape) != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(
            f"quantize_weights: l2 must be [E, H, I] = [{e}, {h}, {two_i // 2}] for l1 "
            f"{list(l1.shape)}, got {list(l2.shape)}"
        )
    if h % _BLOCK or (two_i // 2) % _BLOCK:
        raise ValueError(
            f"quantize_weights: H={h} and I={two_i // 2} must be multiples of {_BLOCK} (the "
            "kernels' K block and scale block); pad the model's dimensions"
        )
    return e, h, two_i // 2


def _check_kernel(kernel: str, where: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"{where}: kernel must be one of {sorted(KERNELS)}, got {kernel!r}")


def quantize_weights(
    l1: torch.Tensor, l2: torch.Tensor, kernel: str, *, chunk: int = 32
) -> tuple[Any, Any]:
    """Quantize and lay out BF16 expert weights for one SM90 kernel.

    ``fp8_mega_moe``: FP8 E4M3 with FP32 scales per 128x128 block; ``fp8_fp4_mega_moe``:
    E2M1 with UE8M0 scales per 32. Then DeepGEMM's own transform (gate/up interleave,
    scale packing). Experts are processed ``chunk`` at a time to bound the FP32 temporaries.

    Args:
        l1: BF16 ``[E, 2I, H]`` (gate rows then up rows), on the GPU.
        l2: BF16 ``[E, H, I]``.
        kernel: ``"fp8_mega_moe"`` or ``"fp8_fp4_mega_moe"``.

    Returns:
        ``(l1_weights, l2_weights)`` as the kernel takes them.
    """
    _check_kernel(kernel, "quantize_weights")
    num_experts = _check_shapes(l1, l2)[0]
    cast = _fp8_blocks if kernel == "fp8_mega_moe" else _fp4_rows
    parts1, parts2 = [], []
    for start in range(0, num_experts, chunk):
        parts1.append(cast(l1[start : start + chunk]))
        parts2.append(cast(l2[start : start + chunk]))
    w1 = tuple(torch.cat([p[i] for p in parts1]) for i in (0, 1))
    w2 = tuple(torch.cat([p[i] for p in parts2]) for i in (0, 1))
    return getattr(deep_gemm, KERNELS[kernel][1])(w1, w2)


def _from_dense(w1: torch.Tensor, w2: torch.Tensor, mma_type: str) -> MegaMoEWeights:
    """``from_dense`` for this kernel: BF16, then :func:`quantize_weights` for the catalogue
    row's kernel function (its raw weights are not kept)."""
    function = catalogue.build(catalogue.SM90, mma_type).function
    l1, l2 = quantize_weights(w1.bfloat16(), w2.bfloat16(), function)
    return MegaMoEWeights(tuple(range(w1.shape[0])), mma_type, l1, l2, None, None)


for _row in catalogue.builds(catalogue.SM90):
    register_form(catalogue.SM90, _row.weights, _from_dense)


# -- the experts module -----------------------------------------------------------------------


class SM90MegaMoEExperts(MegaMoEForward):
    """Routed experts on DeepGEMM's SM90 Mega-MoE kernel (one launch: dispatch, L1, SwiGLU,
    L2, combine), shaped like vLLM's Mega-MoE experts (the forward is the stand-in's,
    ``MegaMoEForward``: the kernel, then an unfused shared expert).

    Args:
        l1_weights, l2_weights: prepared weights (:func:`quantize_weights`).
        symm_buffer: from ``deep_gemm.get_symm_buffer_for_sm90_mega_moe``; its
            ``num_max_tokens_per_rank`` bounds ``T``.
        kernel: ``"fp8_mega_moe"`` or ``"fp8_fp4_mega_moe"``.
        activation_clamp: SwiGLU clamp (``None``: none).
        fast_math: the kernel's fast SiLU.
    """

    def __init__(
        self,
        l1_weights: Any,
        l2_weights: Any,
        symm_buffer: Any,
        kernel: str = "fp8_mega_moe",
        *,
        activation_clamp: float | None = 10.0,
        fast_math: bool = True,
    ) -> None:
        super().__init__()
        _check_kernel(kernel, "SM90MegaMoEExperts")
        self.l1_weights, self.l2_weights = l1_weights, l2_weights
        self.symm_buffer = symm_buffer
        self.kernel = kernel
        self.kernel_kwargs = dict(
            recipe=KERNELS[kernel][0],
            activation="swiglu",
            activation_clamp=activation_clamp,
            fast_math=fast_math,
        )
        # Anchors the module's device for moewire (its quantizers follow it).
        self.register_buffer("anchor", torch.zeros((), device=symm_buffer.buffer.device))

    @classmethod
    def from_bf16(
        cls,
        l1: torch.Tensor,
        l2: torch.Tensor,
        *,
        kernel: str,
        group: Any,
        max_num_tokens: int,
        top_k: int,
        **kwargs: Any,
    ) -> SM90MegaMoEExperts:
        """Quantize BF16 weights, allocate the buffer, build the module.

        Args:
            l1: BF16 ``[E, 2I, H]``; l2: BF16 ``[E, H, I]`` (this rank's experts times the
                group size is the global expert count).
            kernel: ``"fp8_mega_moe"`` or ``"fp8_fp4_mega_moe"``.
            group: the expert-parallel process group (NCCL; one rank works).
            max_num_tokens: tokens per call on this rank (rounded up to 384 by DeepGEMM).
            top_k: slots per token.
            **kwargs: ``activation_clamp``, ``fast_math``.
        """
        _check_kernel(kernel, "SM90MegaMoEExperts.from_bf16")
        num_local, hidden, inter = _check_shapes(l1, l2)
        weights = quantize_weights(l1, l2, kernel)
        buffer = deep_gemm.get_symm_buffer_for_sm90_mega_moe(
            group, num_local * group.size(), max_num_tokens, top_k, hidden, inter
        )
        return cls(*weights, buffer, kernel, **kwargs)

    @property
    def max_num_tokens(self) -> int:
        return self.symm_buffer.num_max_tokens_per_rank

    def _check_inputs(self, hidden_states: torch.Tensor,
                      shared_experts: nn.Module | None) -> int:
        num_tokens = hidden_states.shape[0]
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"{type(self).__name__}: {num_tokens} tokens exceed the buffer's capacity "
                f"{self.max_num_tokens}; build the module with a larger max_num_tokens"
            )
        return num_tokens

    def _routed(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        stage_sm90_inputs(hidden_states, topk_ids, topk_weights, self.symm_buffer)
        y = torch.empty_like(hidden_states, dtype=torch.bfloat16)
        getattr(deep_gemm, self.kernel)(
            y, self.l1_weights, self.l2_weights, self.symm_buffer, **self.kernel_kwargs
        )
        return y


register_sm90_experts(
    SM90MegaMoEExperts,
    forward_module=__name__,
    get_symm_buffer=lambda m: m.symm_buffer,
)
