"""Dense expert weights in the form a kernel build reads: :func:`from_dense`, the one
conversion the study (``moewire study --weights``) and the transformers integration
(``prepare``) share. A real kernel's module registers its own forms (:func:`register_form`).

Each weight form of ``moewire.reference.catalogue.WEIGHT_FORMS`` that the stand-in runs has
one function here, then DeepGEMM's layout transform
(``deep_gemm.transform_weights_for_mega_moe``):

- ``bf16``: BF16 as is.
- ``fp4-ue8m0`` (``fp8xfp4``): FP4 E2M1 with one UE8M0 scale per 32 along K, the reference
  kernel's own cast (:func:`~moewire.reference._numerics.quantize_fp4_ue8m0`), so the kernel
  reads exactly the format it defines.
- ``nvfp4-vllm`` (``nvfp4``, the NVFP4 Mega-MoE of vLLM 0.33/0.34): NVFP4 per expert, a
  global scale ``amax / 2688`` and an E4M3 scale per 16
  (:func:`moewire.reference.nvfp4.weights.quantize_nvfp4_weight`); the global scales become
  the kernel's ``l1_alpha`` / ``l2_alpha``.
- ``nvfp4-modelopt`` (``fp4xfp4``, DeepGEMM 2.8.0's NVFP4 x NVFP4 kernel): NVFP4 as
  ModelOpt's checkpoints hold it, gate, up and down each with its own per-expert global
  scale (:func:`moewire.reference.fp4_fp4.weights.quantize_expert`), the kernel's
  ``l1_alphas`` / ``l2_alphas``.

May import: torch, ``catalogue``, ``deep_gemm``, ``_numerics`` and the weights modules
(``weights``, ``nvfp4.weights``, ``fp4_fp4.weights``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moewire.reference import deep_gemm
from moewire.reference._numerics import quantize_fp4_ue8m0
from moewire.reference.catalogue import STAND_IN, build
from moewire.reference.fp4_fp4.weights import FP4MegaMoEWeights, quantize_expert
from moewire.reference.nvfp4.weights import NVFP4MegaMoEWeights, quantize_nvfp4_expert
from moewire.reference.weights import ExpertQuantizer, MegaMoEWeights, quantized_weights

__all__ = ["from_dense", "kernel_kwargs", "register_form"]

Weights = MegaMoEWeights | NVFP4MegaMoEWeights | FP4MegaMoEWeights


def _bf16(w1: torch.Tensor, w2: torch.Tensor, mma_type: str) -> MegaMoEWeights:
    raw1, raw2 = w1.bfloat16().contiguous(), w2.bfloat16().contiguous()
    l1, l2 = deep_gemm.transform_weights_for_mega_moe(raw1, raw2)
    return MegaMoEWeights(tuple(range(w1.shape[0])), mma_type, l1, l2, raw1, raw2)


def _fp4_ue8m0(w1: torch.Tensor, w2: torch.Tensor, mma_type: str) -> MegaMoEWeights:
    raw1, raw2 = quantize_fp4_ue8m0(w1.float()), quantize_fp4_ue8m0(w2.float())
    l1, l2 = deep_gemm.transform_weights_for_mega_moe(raw1, raw2)
    return MegaMoEWeights(tuple(range(w1.shape[0])), mma_type, l1, l2, raw1, raw2)


Form = Callable[[torch.Tensor, torch.Tensor, str], Any]


def _nvfp4(holder: Callable[..., Any], quantize_expert: ExpertQuantizer) -> Form:
    """The conversion of an NVFP4 form: each expert quantized by ``quantize_expert``, the
    holder on the weights' device."""
    def convert(w1: torch.Tensor, w2: torch.Tensor, mma_type: str) -> Any:
        dense = ((l1.float(), l2.float()) for l1, l2 in zip(w1, w2, strict=True))
        return quantized_weights(holder, quantize_expert, dense, tuple(range(w1.shape[0])),
                                 w1.device)

    return convert


#: (kernel, weight form of ``catalogue.WEIGHT_FORMS``) -> its conversion. A real kernel's
#: module adds its own (:func:`register_form`): its weights need its package's transform.
_FORMS: dict[tuple[str, str], Form] = {
    (STAND_IN, "bf16"): _bf16,
    (STAND_IN, "fp4-ue8m0"): _fp4_ue8m0,
    (STAND_IN, "nvfp4-vllm"): _nvfp4(NVFP4MegaMoEWeights, quantize_nvfp4_expert),
    (STAND_IN, "nvfp4-modelopt"): _nvfp4(FP4MegaMoEWeights, quantize_expert),
}


def register_form(kernel: str, form: str, convert: Form) -> None:
    """Make ``convert(w1, w2, mma_type)`` the conversion of ``kernel``'s weight form ``form``
    (``moewire.integrations.deepgemm_sm90`` registers the real SM90 kernel's)."""
    _FORMS[(kernel, form)] = convert


def from_dense(w1: torch.Tensor, w2: torch.Tensor, mma_type: str,
               kernel: str = STAND_IN) -> Weights:
    """Dense expert weights in the form ``kernel``'s ``mma_type`` build reads.

    Args:
        w1: ``[E, 2I, H]`` rows ``[gate | up]``; w2: ``[E, H, I]``; any float dtype.
        mma_type: an MMA type of ``kernel`` in ``moewire.reference.catalogue`` (the
            stand-in's ``"bf16xbf16"``, ``"fp8xfp4"``, ``"fp4xfp4"``, ``"nvfp4"``).
        kernel: ``"stand-in"`` (the default) or a real kernel whose module registered its
            form (``"deepgemm-sm90"``).

    Returns:
        The weights holder of the build, for experts ``0..E-1``:
        :class:`~moewire.reference.weights.MegaMoEWeights` (a real kernel's weights too),
        ``NVFP4MegaMoEWeights`` or ``FP4MegaMoEWeights`` (:func:`kernel_kwargs` gives their
        further kernel keywords).

    Raises:
        ValueError: ``kernel`` has no such build (the message lists its builds), or the
            weights do not fit the build (the kernel's message).
        RuntimeError: the build's form is a real kernel's whose module was not imported.
    """
    row = build(kernel, mma_type)
    convert = _FORMS.get((kernel, row.weights))
    if convert is None:
        raise RuntimeError(
            f"from_dense: the {row.weights!r} weights of kernel {kernel!r} are made by the "
            "kernel's own module, which is not imported; import it first (for deepgemm-sm90: "
            "moewire.integrations.deepgemm_sm90)"
        )
    return convert(w1, w2, mma_type)


def kernel_kwargs(weights: Weights) -> dict[str, Any]:
    """The keywords a kernel call takes besides the weights themselves: the NVFP4 x NVFP4
    kernel's per-expert ``l1_alphas`` / ``l2_alphas``, else none."""
    if isinstance(weights, FP4MegaMoEWeights):
        return {"l1_alphas": weights.l1_alphas, "l2_alphas": weights.l2_alphas}
    return {}
