"""The stand-in of the NVFP4 Mega-MoE kernel of the DeepGEMM bundled in vLLM 0.33 and 0.34
(``vllm/third_party/deep_gemm/mega/nvfp4.py``, ``deep_gemm.nvfp4_mega_moe``), with vLLM's
staging function and a vLLM-like experts module for it.

One kernel family, one folder; its modules, from the bottom up:

- ``_numerics``: the family's casts (NVFP4, the MXFP8 L2 input) and the FP32 FMA of its
  combine.
- ``buffer``: ``NVFP4SymmBuffer`` and the numbers its layout is built from.
- ``staging``: vLLM's ``prepare_megamoe_nvfp4_inputs``.
- ``mega_moe``: the kernel, ``deep_gemm.nvfp4_mega_moe``.
- ``weights``, ``experts`` (the layer above the kernels, ``moewire.reference`` says why):
  seeded NVFP4 weights and ``NVFP4MegaMoEExperts``.

The public names are reached as ``moewire.reference.deep_gemm.nvfp4_mega_moe`` (and the
buffer's names next to it) and from ``moewire.reference`` (``NVFP4MegaMoEExperts``,
``make_nvfp4_weights``, ``prepare_megamoe_nvfp4_inputs``), not from here.

May import: nothing. Every module of the family is imported by its own path, and
``deep_gemm`` imports ``buffer`` and ``mega_moe``, so a package that imported ``experts``
or ``weights`` (which import ``deep_gemm``) would close a cycle. The modules themselves may
import torch and ``moewire.reference`` only (each says which of its modules).
"""
