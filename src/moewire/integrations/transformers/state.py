"""The Mega-MoE state of one ``"moewire"`` experts module: its kernel weights, its buffer and
the EP group the buffer spans (:func:`_build_state`).

Kernels (``prepare(model, kernel=...)``) and their builds (``mma_type``), the rows of
``moewire.reference.catalogue`` transformers offers:

- ``"stand-in"`` (the default), ``moewire.reference.deep_gemm`` on any device:
  ``"bf16xbf16"`` (the default: BF16 weights stay as they are and only the wire changes;
  FP32 weights are rounded to BF16), ``"fp8xfp4"`` (weights quantized to FP4 E2M1 with
  UE8M0 scales per 32, tokens staged in FP8) or ``"fp4xfp4"`` (DeepGEMM 2.8.0's NVFP4 x NVFP4
  ``fp4_fp4_mega_moe``, the kernel vLLM main serves DeepSeek V3.2 / GLM-5.2 NVFP4 with:
  BF16/FP16/FP32 weights quantized to NVFP4 as ModelOpt's checkpoints hold them, gate, up
  and down each with a per-expert global scale passed as ``l1_alphas``/``l2_alphas``; the
  tokens staged as vLLM main's ``prepare_megamoe_nvfp4_inputs`` does, NVFP4 per 16 without
  a global scale; H and I multiples of 512; flavour ``deepgemm-2.8``). The weights come from
  ``moewire.reference.dense.from_dense``, the study's conversion too.
- ``"deepgemm-sm90"`` (opt-in, a Hopper GPU and DeepGEMM PR #323's package): DeepGEMM's
  real ``fp8_mega_moe`` (``mma_type="fp8xfp8"``). The BF16 expert weights are quantized to
  FP8 E4M3 with one FP32 scale per 128x128 block
  (``moewire.integrations.deepgemm_sm90.quantize_weights``), the buffer is
  ``get_symm_buffer_for_sm90_mega_moe`` on a one-rank NCCL group (or the ``group`` given),
  the tokens are staged by ``stage_sm90_inputs`` (FP8, one FP32 scale per 128 columns). Its
  flavour is ``deepgemm-sm90``: moewire's quantizers re-sum the combine rows where that
  build leaves them.

Weight layouts come from the flags ``use_experts_implementation`` sets on each instance
(``is_concatenated``, ``is_transposed``, ``has_bias``, ``has_gate``,
``has_post_expert_norm``; read in transformers 5.23.0 ``integrations/moe.py``); the kernel
reads L1 ``[E, 2I, H]`` with rows ``[gate | up]`` and L2 ``[E, H, I]``.

May import: the standard library, torch, ``moewire.megamoe.flavours``, ``moewire.reference``,
``moewire.integrations.deepgemm_sm90`` and this package's ``architectures``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moewire.integrations import deepgemm_sm90 as sm90
from moewire.integrations.transformers.architectures import (
    _arch_of_module,
    _check_layout,
    _where,
)
from moewire.megamoe.flavours import detect
from moewire.reference import catalogue, fp4_fp4
from moewire.reference import deep_gemm as stand_in
from moewire.reference.dense import from_dense, kernel_kwargs

__all__ = ["DEFAULT_MAX_TOKENS", "KERNELS", "MMA_TYPES"]

#: kernel -> its builds, each build -> the kernel function the forward calls (the rows of
#: ``moewire.reference.catalogue`` transformers offers; a kernel's first build is its default).
KERNELS: dict[str, dict[str, str]] = {
    kernel: {b.mma_type: b.function for b in catalogue.builds(kernel, "transformers")}
    for kernel in (catalogue.STAND_IN, catalogue.SM90)
}
MMA_TYPES = catalogue.mma_types(user="transformers")
#: Tokens per kernel call unless ``prepare`` is told otherwise (the buffer's capacity).
DEFAULT_MAX_TOKENS = 2048


@dataclass
class _MegaState:
    """The Mega-MoE form of one experts module: kernel weights, its buffer and the EP group
    the buffer spans (``None``: one rank)."""

    kernel: str
    mma_type: str
    l1: Any
    l2: Any
    clamp: float | None
    buffer: Any
    group: Any = None
    # Further kernel keywords (fp4xfp4: the per-expert l1_alphas and l2_alphas)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def function(self) -> str:
        return KERNELS[self.kernel][self.mma_type]

    @property
    def flavour(self) -> str:
        if self.kernel == "deepgemm-sm90":
            return sm90.FLAVOUR
        if self.mma_type == "fp4xfp4":
            # The stand-in's fp4_fp4_mega_moe imitates DeepGEMM 2.8.0's, whatever flavour
            # its other kernels imitate now.
            return fp4_fp4.FLAVOUR
        return detect(stand_in, "moewire.reference.deep_gemm").name


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter transformers' EP sharded (a ``DTensor``), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _kernel_layout(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """L1 ``[E, 2I, H]`` rows ``[gate | up]`` and L2 ``[E, H, I]`` from the module's flags
    (``E``: this rank's experts under transformers' EP).

    ``is_transposed``: ``gate_up_proj`` is ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]``;
    ``is_concatenated=False``: gate and up rows interleave (``gate0, up0, gate1, ...``).
    """
    l1, l2 = _local(module.gate_up_proj).detach(), _local(module.down_proj).detach()
    if module.is_transposed:
        l1, l2 = l1.transpose(1, 2), l2.transpose(1, 2)
    if not module.is_concatenated:
        l1 = torch.cat([l1[:, 0::2], l1[:, 1::2]], dim=1)
    return l1, l2


def _stand_in_buffer(module: nn.Module, mma_type: str, l1: torch.Tensor, top_k: int,
                     max_num_tokens: int, group: Any) -> Any:
    """The stand-in's buffer, on ``group``, for the experts of all its ranks."""
    num_experts, two_i, hidden = l1.shape
    ranks = 1 if group is None else group.size()
    try:
        # The stand-in's fp4_fp4_mega_moe imitates DeepGEMM 2.8.0's, whatever flavour its
        # other kernels imitate now.
        with (stand_in.use_flavour(fp4_fp4.FLAVOUR) if mma_type == "fp4xfp4"
              else contextlib.nullcontext()):
            buffer = stand_in.get_symm_buffer_for_mega_moe(
                group, num_experts * ranks, max_num_tokens, top_k, hidden, two_i // 2,
                mma_type=mma_type, device=l1.device,
            )
    except ValueError as exc:
        raise ValueError(
            f"{_where(module)}: the {mma_type} build cannot take these experts ({exc}); use "
            "another mma_type"
        ) from exc
    return buffer


def _check_sm90_alignment(module: nn.Module, hidden: int, intermediate: int) -> None:
    """Refuse shapes whose per-token scale rows the SM90 kernel cannot place (the H and I
    multiples of its catalogue row, which says why)."""
    row = catalogue.build(catalogue.SM90, "fp8xfp8")
    h_multiple, i_multiple = row.hidden_multiple, row.intermediate_multiple
    if hidden % h_multiple or intermediate % i_multiple:
        raise ValueError(
            f"{_where(module)}: DeepGEMM's SM90 fp8_mega_moe keeps H/32 and I/16 scale bytes per "
            f"token in 16-byte (TMA) rows, so H must be a multiple of {h_multiple} and I of "
            f"{i_multiple}; got H={hidden}, I={intermediate}; use kernel='stand-in' for this "
            "model"
        )


def _sm90_form(module: nn.Module, l1: torch.Tensor, l2: torch.Tensor, top_k: int,
               max_num_tokens: int, group: Any) -> tuple[Any, Any, Any, Any]:
    """DeepGEMM's SM90 buffer (on ``group``, default a one-rank group) and FP8 128x128
    block-scaled weights: ``(buffer, l1, l2, group)``."""
    ok, why = sm90.available()
    if not ok:
        raise RuntimeError(
            f"{_where(module)}: kernel='deepgemm-sm90' runs DeepGEMM's real SM90 fp8_mega_moe, "
            f"which cannot run here ({why}); run on a Hopper GPU with the package on "
            "PYTHONPATH (docs/real-kernel.md), or use kernel='stand-in'"
        )
    if l1.device.type != "cuda" and torch.cuda.is_available():
        raise ValueError(
            f"{_where(module)}: the experts' weights are on {l1.device}; move the model to the "
            "Hopper GPU before prepare(kernel='deepgemm-sm90')"
        )
    try:
        weights = from_dense(l1, l2, "fp8xfp8", kernel=catalogue.SM90)
    except ValueError as exc:
        raise ValueError(
            f"{_where(module)}: the deepgemm-sm90 build cannot take these experts ({exc}); "
            "use kernel='stand-in'"
        ) from exc
    group = sm90.one_rank_group() if group is None else group
    num_experts, two_i, hidden = l1.shape
    _check_sm90_alignment(module, hidden, two_i // 2)
    ranks = 1 if group is None else group.size()
    buffer = sm90.deep_gemm.get_symm_buffer_for_sm90_mega_moe(
        group, num_experts * ranks, max_num_tokens, top_k, hidden, two_i // 2
    )
    return buffer, weights.l1, weights.l2, group


def _build_state(module: nn.Module, mma_type: str | None, max_num_tokens: int,
                 kernel: str = "stand-in", group: Any = None) -> _MegaState:
    arch = _arch_of_module(module)
    _check_layout(module, arch)
    if kernel not in KERNELS:
        raise ValueError(
            f"{_where(module)}: kernel must be one of {sorted(KERNELS)}, got {kernel!r}"
        )
    mma_type = next(iter(KERNELS[kernel])) if mma_type is None else mma_type
    if mma_type not in KERNELS[kernel]:
        raise ValueError(
            f"{_where(module)}: kernel {kernel!r} has the builds {tuple(KERNELS[kernel])}, "
            f"got mma_type={mma_type!r}; pick one of them"
        )
    if _local(module.gate_up_proj).dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ValueError(
            f"{_where(module)}: weights are {module.gate_up_proj.dtype}; moewire quantizes "
            "BF16/FP16/FP32 expert weights for the kernel (dequantize the checkpoint first)"
        )
    l1, l2 = _kernel_layout(module)
    top_k = int(module.config.num_experts_per_tok)
    extra: dict[str, Any] = {}
    if kernel == "deepgemm-sm90":
        buffer, l1_k, l2_k, group = _sm90_form(module, l1, l2, top_k, max_num_tokens, group)
    else:
        buffer = _stand_in_buffer(module, mma_type, l1, top_k, max_num_tokens, group)
        weights = from_dense(l1, l2, mma_type)
        l1_k, l2_k, extra = weights.l1, weights.l2, kernel_kwargs(weights)
    clamp = getattr(module, arch.clamp_attr) if arch.clamp_attr else None
    return _MegaState(kernel, mma_type, l1_k, l2_k, None if clamp is None else float(clamp),
                      buffer, group, extra)


def _state(module: nn.Module) -> _MegaState:
    state = module.__dict__.get("_moewire_mega")
    if state is None:
        if getattr(module, "_is_expert_parallel", False):
            raise RuntimeError(
                f"{_where(module)}: transformers split these experts over an expert-parallel "
                "group, and their Mega-MoE buffer must span it; call "
                "moewire.integrations.transformers.prepare(model) after from_pretrained"
            )
        state = _build_state(module, "bf16xbf16", DEFAULT_MAX_TOKENS)
        module.__dict__["_moewire_mega"] = state
    return state
