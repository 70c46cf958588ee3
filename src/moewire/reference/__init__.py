"""The stand-in DeepGEMM Mega-MoE kernel and a vLLM-like experts module.

- ``moewire.reference.deep_gemm``: DeepGEMM's Mega-MoE Python API (buffer, kernels, casts),
  with named layout flavours (``upstream``, ``vllm``, ``sgl``).
- ``MegaMoEExperts``: an ``nn.Module`` with vLLM's Mega-MoE experts contract.
- ``make_weights`` / ``SharedExpert``: seeded weights for tests and the study.
- ``forward_context``: vLLM's forward-context stand-in (``is_padding``).

Independent of ``moewire.megamoe``, ``moewire.quantizer`` and ``moewire.formats``.
"""

from moewire.reference import deep_gemm
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
    "forward_context",
    "get_forward_context",
    "make_weights",
    "stage_mega_moe_inputs",
]
