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
package may import torch and its own modules only. A kernel family with its own buffer,
staging and kernel has its own subpackage (``nvfp4/``), whose ``__init__`` imports nothing.
Inside the package the imports run one way (no cycle, subpackages included;
``tests/reference/test_reference_imports.py`` checks it), from the bottom up:

- ``_alloc``, ``_numerics``, ``builds``: nothing of moewire.
- ``_weights_cache`` (the dequantized expert weights), ``deep_gemm_utils``
  (``deep_gemm.utils``), ``sgl_staging`` (sgl-deep-gemm's staging functions),
  ``_ep_experts`` (what the experts modules share): ``_alloc``, ``_numerics`` at most.
- ``buffer`` (the buffers' region layout, ``SymmBuffer``): ``_alloc``, ``builds``.
- ``_kernel`` (the body of ``fp8_fp4_mega_moe`` and ``bf16_mega_moe``): ``_numerics``,
  ``_weights_cache``, ``buffer``.
- ``nvfp4._numerics`` -> ``nvfp4.buffer`` -> ``nvfp4.staging`` -> ``nvfp4.mega_moe`` (vLLM
  0.33/0.34's ``nvfp4_mega_moe``): the modules above.
- ``sm90_fork`` (the names of the DeepGEMM fork vLLM main's Hopper experts call:
  ``get_symm_buffer_for_sm90_mega_moe``, ``transform_weights_for_mega_moe_sm90``,
  ``fp8_mega_moe_sm90``; one rank): ``_alloc``, ``buffer``, ``deep_gemm_utils``.
- ``deep_gemm`` (the thin API, re-exporting the public names): ``_alloc``, ``builds``,
  ``buffer``, ``deep_gemm_utils``, ``_kernel``, ``nvfp4.buffer``, ``nvfp4.mega_moe``.
- ``hub_deep_gemm`` (upstream DeepGEMM's Mega-MoE signatures, the build transformers
  loads from the kernels hub, for ``moewire.integrations.transformers``): ``deep_gemm``
  and below.
- ``weights``, ``experts``, ``nvfp4.weights``, ``nvfp4.experts``: ``deep_gemm`` and below.
"""

from moewire.reference import deep_gemm
from moewire.reference._numerics import dequantize_weight, quantize_fp4_ue8m0
from moewire.reference.experts import (
    MegaMoEExperts,
    forward_context,
    get_forward_context,
    stage_mega_moe_inputs,
)
from moewire.reference.nvfp4.experts import NVFP4MegaMoEExperts
from moewire.reference.nvfp4.staging import prepare_megamoe_nvfp4_inputs
from moewire.reference.nvfp4.weights import NVFP4MegaMoEWeights, make_nvfp4_weights
from moewire.reference.weights import MegaMoEWeights, SharedExpert, make_weights

__all__ = [
    "MegaMoEExperts",
    "MegaMoEWeights",
    "NVFP4MegaMoEExperts",
    "NVFP4MegaMoEWeights",
    "SharedExpert",
    "deep_gemm",
    "dequantize_weight",
    "forward_context",
    "get_forward_context",
    "make_nvfp4_weights",
    "make_weights",
    "prepare_megamoe_nvfp4_inputs",
    "quantize_fp4_ue8m0",
    "stage_mega_moe_inputs",
]
