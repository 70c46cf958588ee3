"""The stand-in DeepGEMM Mega-MoE kernels and vLLM-like experts modules.

- ``moewire.reference.deep_gemm``: DeepGEMM's Mega-MoE Python API (buffer, kernels, casts),
  one flavour per kernel build (``deepgemm-main``, ``vllm-0.32``, ``vllm-0.33``,
  ``deepgemm-sm90``; ``reference.builds``).
- ``MegaMoEExperts``: an ``nn.Module`` with vLLM's Mega-MoE experts contract.
- ``make_weights`` / ``SharedExpert``: seeded weights for tests and the study.
- ``forward_context``: vLLM's forward-context stand-in (``is_padding``).
- ``quantize_fp4_ue8m0`` / ``dequantize_weight``: the kernel's weight format (FP4 E2M1,
  UE8M0 per 32 along K), for callers that bring dense weights.
- ``NVFP4MegaMoEExperts``, ``make_nvfp4_weights``, ``prepare_megamoe_nvfp4_inputs``: the
  same for the NVFP4 Mega-MoE of vLLM 0.33/0.34 (``deep_gemm.nvfp4_mega_moe``), whose
  stand-in is the subpackage ``reference.nvfp4``.

Independent of ``moewire.megamoe``, ``moewire.quantizer`` and ``moewire.formats``: the
package may import torch and its own modules only. Inside it, two layers
(``tests/test_import_cycles.py`` checks that no kernel module imports an experts module, and
``tests/reference/test_reference_imports.py`` that no import cycles), each drawn from the
bottom up:

**The kernels** (what DeepGEMM ships: its API, buffers, staging, numerics). A kernel family
with its own buffer, staging and kernel has its own subpackage (``nvfp4/``, ``fp4_fp4/``),
whose ``__init__`` imports nothing.

- ``_alloc``, ``_numerics``, ``catalogue`` (every kernel build and MMA type, one row each):
  nothing of moewire; ``builds`` (the flavours): ``catalogue``.
- ``_weights_cache`` (the dequantized expert weights), ``deep_gemm_utils``
  (``deep_gemm.utils``), ``sgl_staging`` (sgl-deep-gemm's staging functions): ``_alloc``,
  ``_numerics`` at most.
- ``buffer`` (the buffers' region layout, ``SymmBuffer``): ``_alloc``, ``builds``.
- ``_kernel`` (the body of ``fp8_fp4_mega_moe`` and ``bf16_mega_moe``): ``_numerics``,
  ``_weights_cache``, ``buffer``.
- ``nvfp4._numerics`` -> ``nvfp4.buffer`` -> ``nvfp4.staging`` -> ``nvfp4.mega_moe`` (vLLM
  0.33/0.34's ``nvfp4_mega_moe``), and the same four of ``fp4_fp4`` (DeepGEMM 2.8.0's
  ``fp4_fp4_mega_moe``): the modules above.
- ``sm90_fork`` (the names of the DeepGEMM fork vLLM main's Hopper experts call:
  ``get_symm_buffer_for_sm90_mega_moe``, ``transform_weights_for_mega_moe_sm90``,
  ``fp8_mega_moe_sm90``; one rank): ``_alloc``, ``buffer``, ``deep_gemm_utils``.
- ``deep_gemm`` (the thin API, re-exporting the public names): the modules above.
- ``hub_deep_gemm`` (upstream DeepGEMM's Mega-MoE signatures, the build transformers
  loads from the kernels hub, for ``moewire.integrations.transformers``): ``deep_gemm``
  and below.

**The experts modules and weight holders** (what a serving engine builds on the kernels):

- ``_ep_experts`` (what the experts modules share: the forward, the EP partition, the
  buffer cache): ``_alloc``.
- ``weights``, ``nvfp4.weights``, ``fp4_fp4.weights`` (seeded weights in each kernel's
  form): ``deep_gemm`` and the family's numerics.
- ``experts`` (``MegaMoEExperts``, vLLM's staging and forward context), ``nvfp4.experts``,
  ``fp4_fp4.experts``: the weights modules, the family's staging, ``deep_gemm``.
- ``dense`` (``from_dense``: dense expert weights in the form of a catalogue row): the
  weights modules.
- this ``__init__`` (the public names, imported at first use).
"""

from __future__ import annotations

import importlib

# name -> the module that defines it; imported at first use, so that the torch-free modules
# (``builds``, ``catalogue``) load without torch (the CLI reads its choices from them).
_LAZY = {
    "MegaMoEExperts": "moewire.reference.experts",
    "MegaMoEWeights": "moewire.reference.weights",
    "NVFP4MegaMoEExperts": "moewire.reference.nvfp4.experts",
    "NVFP4MegaMoEWeights": "moewire.reference.nvfp4.weights",
    "SharedExpert": "moewire.reference.weights",
    "dequantize_weight": "moewire.reference._numerics",
    "forward_context": "moewire.reference.experts",
    "get_forward_context": "moewire.reference.experts",
    "make_nvfp4_weights": "moewire.reference.nvfp4.weights",
    "make_weights": "moewire.reference.weights",
    "prepare_megamoe_nvfp4_inputs": "moewire.reference.nvfp4.staging",
    "quantize_fp4_ue8m0": "moewire.reference._numerics",
    "stage_mega_moe_inputs": "moewire.reference.experts",
}

__all__ = sorted([*_LAZY, "deep_gemm"])


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    # A submodule (``deep_gemm``, ``nvfp4``, ...) not imported yet, as an eager package gave it.
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'moewire.reference' has no attribute {name!r}")
