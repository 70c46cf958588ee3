"""The stand-in of DeepGEMM 2.8.0's NVFP4 x NVFP4 Mega-MoE kernel (``fp4_fp4_mega_moe``),
with vLLM main's staging function for it and a vLLM-main-like experts module.

Read from (never copied): deepseek-ai/DeepGEMM 2.8.0, ``deep_gemm/mega/__init__.py``,
``csrc/apis/mega_moe.hpp`` and ``deep_gemm/include/deep_gemm/layout/mega_moe.cuh`` at 0274ad7
(the release: the API, the buffer's regions and views), the kernel
``deep_gemm/include/deep_gemm/impls/sm100_fp4_fp4_mega_moe.cuh`` with
``csrc/apis/nvfp4_mega_moe.hpp`` and ``layout/nvfp4_mega_moe.cuh`` at 794783a (PR #409: the
numerics and the combine; 0274ad7's own kernel file is not stored); vLLM main
``vllm/models/deepseek_v32/nvidia/mega_moe.py`` (30a3a7a, ``DeepseekV32MegaMoEExperts``) and
``vllm/models/deepseek_v32/nvidia/ops/prepare_megamoe_nvfp4.py`` (05be1d5, the staging). vLLM
main pins vllm-project/DeepGEMM ``dev`` at 9a86ae2b (2.8.0 plus fork commits for SM120, SiTU
and SwiGLU alpha/beta), whose source is not stored: its NVFP4 x NVFP4 kernel is taken to be
upstream's, and moewire's layout check decides on the first batch.

One kernel family, one folder; its modules, from the bottom up:

- ``_numerics``: the family's NVFP4 casts (the staging's, the in-kernel L2 requantization).
- ``buffer``: the ``fp4xfp4`` ``SymmBuffer`` and its regions.
- ``staging``: vLLM main's ``prepare_megamoe_nvfp4_inputs``.
- ``mega_moe``: the kernel, ``deep_gemm.fp4_fp4_mega_moe``.
- ``weights``, ``experts`` (the layer above the kernels, ``moewire.reference`` says why):
  seeded ModelOpt-style NVFP4 weights and ``FP4MegaMoEExperts``.

The kernel and the buffer are reached through ``moewire.reference.deep_gemm`` (its
``get_symm_buffer_for_mega_moe(..., mma_type="fp4xfp4")`` and ``fp4_fp4_mega_moe``) with the
flavour ``deepgemm-2.8`` selected (``deep_gemm.use_flavour``).

May import: nothing. Every module of the family is imported by its own path (``deep_gemm``
imports ``buffer`` and ``mega_moe``, and ``experts`` imports ``deep_gemm``). The modules may
import torch and ``moewire.reference`` only, the NVFP4 family's ``nvfp4._numerics`` and
``nvfp4.weights`` included where the math is the same (each says which of its modules).
"""

#: The kernel build this family imitates (``moewire.reference.builds``).
FLAVOUR = "deepgemm-2.8"
