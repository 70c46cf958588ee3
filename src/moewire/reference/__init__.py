"""The stand-in DeepGEMM Mega-MoE kernel and a vLLM-like experts module.

- ``moewire.reference.deep_gemm``: DeepGEMM's Mega-MoE Python API (buffer, kernels, casts),
  one flavour per kernel build (``deepgemm-main``, ``vllm-0.32``, ``vllm-0.33``,
  ``deepgemm-sm90``; ``reference.builds``).
- ``MegaMoEExperts``: an ``nn.Module`` with vLLM's Mega-MoE experts contract.
- ``make_weights`` / ``SharedExpert``: seeded weights for tests and the study.
- ``forward_context``: vLLM's forward-context stand-in (``is_padding``).
- ``quantize_fp4_ue8m0`` / ``dequantize_weight``: the kernel's weight format (FP4 E2M1,
  UE8M0 per 32 along K), for callers that bring dense weights.

Independent of ``moewire.megamoe``, ``moewire.quantizer`` and ``moewire.formats``: the
package may import torch and its own modules only. Inside it the imports run one way (no
cycle; ``tests/reference/test_reference_imports.py`` checks it), from the bottom up:

- ``_alloc``, ``_numerics``, ``builds``: nothing of moewire; ``_nvfp4_numerics``:
  ``_numerics``.
- ``buffer`` (the buffers' region layout, ``SymmBuffer``): ``_alloc``, ``builds``.
- ``_kernel`` (the kernel body): ``_numerics``, ``buffer``.
- ``nvfp4_mega_moe``: the modules above.
- ``sm90_fork`` (the names of the DeepGEMM fork vLLM main's Hopper experts call:
  ``get_symm_buffer_for_sm90_mega_moe``, ``transform_weights_for_mega_moe_sm90``,
  ``fp8_mega_moe_sm90``; one rank): ``_alloc``, ``buffer``, ``deep_gemm_utils``.
- ``deep_gemm`` (the thin API, re-exporting the public names): the modules above.
- ``hub_deep_gemm`` (upstream DeepGEMM's Mega-MoE signatures, the build transformers
  loads from the kernels hub, for ``moewire.integrations.transformers``): ``deep_gemm``
  and below.
- ``weights``, ``nvfp4_weights``, ``experts``, ``nvfp4_experts``: ``deep_gemm`` and below.
"""

from moewire.reference import deep_gemm
from moewire.reference._numerics import dequantize_weight, quantize_fp4_ue8m0
from moewire.reference.experts import (
    MegaMoEExperts,
    forward_context,
    get_forward_context,
    stage_mega_moe_inputs,
)
from moewire.reference.weights import MegaMoEWeights, SharedExpert, make_weights

__all__ = [
    "MegaMoEExperts",
    "MegaMoEWeights",
    "SharedExpert",
    "deep_gemm",
    "dequantize_weight",
    "forward_context",
    "get_forward_context",
    "make_weights",
    "quantize_fp4_ue8m0",
    "stage_mega_moe_inputs",
]

# The NVFP4 Mega-MoE stand-in (vLLM 0.33/0.34): `deep_gemm.nvfp4_mega_moe`, its staging and
# weights.
from moewire.reference.nvfp4_staging import prepare_megamoe_nvfp4_inputs  # noqa: E402
from moewire.reference.nvfp4_weights import (  # noqa: E402
    NVFP4MegaMoEWeights,
    make_nvfp4_weights,
)

__all__ += ["NVFP4MegaMoEWeights", "make_nvfp4_weights", "prepare_megamoe_nvfp4_inputs"]
from moewire.reference.nvfp4_experts import NVFP4MegaMoEExperts  # noqa: E402

__all__ += ["NVFP4MegaMoEExperts"]
