"""The catalogue of Mega-MoE kernel builds: one row per (kernel, MMA type), read by every
part of moewire that offers a choice of them.

A *kernel* is what runs the experts: ``"stand-in"`` (``moewire.reference.deep_gemm``, on any
device), ``"deepgemm-sm90"`` (DeepGEMM PR #323's real SM90 kernels,
``moewire.integrations.deepgemm_sm90``) or ``"deepgemm"`` (DeepGEMM's own SM100 build, which
moewire hooks inside a host but never runs itself). An *MMA type* is the kernel's operand
types (``"fp8xfp4"``: FP8 tokens times FP4 weights). Each :class:`Build` row says:

- the kernel function that runs it (``fp8_fp4_mega_moe``);
- the weight form made from dense weights (:data:`WEIGHT_FORMS`; the stand-in's forms are
  made by ``moewire.reference.dense.from_dense``, the one conversion the study and the
  transformers integration share);
- the multiples ``H`` and ``I`` must be;
- who offers it: the study (``moewire study --mma``), the transformers integration
  (``prepare(mma_type=...)``, ``moewire eval --mma``) and SGLang's sites (the ``mma_type``
  values SGLang derives);
- whether a real kernel runs it (:func:`real`), which runs only where its GPU and package
  are (the kernel's module says how to check: ``deepgemm_sm90.available()``).

A new build is one row here, its numerics and its tests.

May import: the standard library only (nothing of moewire, nor torch: the CLI reads the
choices before torch loads).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BUILDS",
    "DEEPGEMM",
    "MMA_OF_KERNEL",
    "SM90",
    "STAND_IN",
    "WEIGHT_FORMS",
    "Build",
    "build",
    "builds",
    "mma_types",
    "real",
]

STAND_IN = "stand-in"
SM90 = "deepgemm-sm90"
DEEPGEMM = "deepgemm"
#: The kernels that need a GPU and a package of their own, and what they need.
_REAL = {
    SM90: "a Hopper GPU and DeepGEMM's SM90 package (scripts/real_kernel/build_kit.sh, "
    "docs/real-kernel.md)",
    DEEPGEMM: "an SM100 GPU and the host's DeepGEMM",
}

#: Weight form -> what a dense ``[E, 2I, H]`` / ``[E, H, I]`` pair becomes.
WEIGHT_FORMS = {
    "bf16": "BF16 as is",
    "fp4-ue8m0": "FP4 E2M1 with one UE8M0 scale per 32 along K "
    "(sf = 2^ceil(log2(max(amax, 1e-4) / 6)))",
    "nvfp4-modelopt": "NVFP4 as ModelOpt's checkpoints hold it: an E4M3 scale per 16 and a "
    "per-expert global scale each for gate, up and down (the kernel's l1_alphas/l2_alphas)",
    "nvfp4-vllm": "NVFP4 per expert: an E4M3 scale per 16 and one global scale amax / 2688 "
    "for gate and up together (the kernel's l1_alpha/l2_alpha)",
    "fp8-128x128": "FP8 E4M3 with one FP32 scale per 128x128 block",
    "checkpoint": "the checkpoint's own quantized weights (moewire converts none)",
}


@dataclass(frozen=True)
class Build:
    """One MMA type of one kernel.

    Attributes:
        kernel: :data:`STAND_IN`, :data:`SM90` or :data:`DEEPGEMM`.
        mma_type: the operand types, as the kernel's API names them (``"fp8xfp4"``).
        function: the kernel function that runs it (``"fp8_fp4_mega_moe"``).
        weights: the weight form (a key of :data:`WEIGHT_FORMS`).
        hidden_multiple, intermediate_multiple: what ``H`` and ``I`` must be multiples of
            (``None``: moewire does not check, the host's kernel does).
        users: who offers it: ``"study"``, ``"transformers"``, ``"sglang"``.
        read_from: where the facts come from.
    """

    kernel: str
    mma_type: str
    function: str
    weights: str
    hidden_multiple: int | None
    intermediate_multiple: int | None
    users: tuple[str, ...]
    read_from: str = ""


BUILDS: tuple[Build, ...] = (
    # The stand-in's buffer checks H and I (deep_gemm.get_symm_buffer_for_mega_moe): BF16
    # tiles K by 128, FP4 weights by 512 (128-byte rows), NVFP4 x NVFP4 by 512 (DeepGEMM
    # 2.8.0 csrc/apis/mega_moe.hpp, sf_alignment).
    Build(STAND_IN, "bf16xbf16", "bf16_mega_moe", "bf16", 128, 128, ("study", "transformers"),
          "DeepGEMM 54e2261 deep_gemm/mega/__init__.py"),
    Build(STAND_IN, "fp8xfp4", "fp8_fp4_mega_moe", "fp4-ue8m0", 512, 512,
          ("study", "transformers"), "DeepGEMM 093597f deep_gemm/mega/__init__.py"),
    Build(STAND_IN, "fp4xfp4", "fp4_fp4_mega_moe", "nvfp4-modelopt", 512, 512,
          ("study", "transformers"), "DeepGEMM 2.8.0 (0274ad7) csrc/apis/mega_moe.hpp"),
    # The NVFP4 Mega-MoE of vLLM 0.33/0.34 (vllm/third_party/deep_gemm/mega/nvfp4.py) has a
    # buffer of its own (get_symm_buffer_for_nvfp4_mega_moe), which tiles by 128.
    Build(STAND_IN, "nvfp4", "nvfp4_mega_moe", "nvfp4-vllm", 128, 128, ("study",),
          "vLLM 0.33 vllm/third_party/deep_gemm/mega/nvfp4.py"),
    # DeepGEMM PR #323 (8ddf7f9) impls/sm90_fp8_mega_moe.cuh keeps H/32 and I/16 scale bytes
    # per token in 16-byte (TMA) rows (layout/mega_moe.cuh, Data): H a multiple of 512, I of
    # 256 (seen on an H200: H 256 fails that assert).
    Build(SM90, "fp8xfp8", "fp8_mega_moe", "fp8-128x128", 512, 256, ("transformers",),
          "DeepGEMM PR #323 (8ddf7f9) deep_gemm/mega/__init__.py"),
    # PR #323's FP8 x FP4 kernel on SM90 (moewire study --kernel deepgemm-sm90); moewire's
    # weight cast checks multiples of its 128-wide blocks (deepgemm_sm90.quantize_weights).
    Build(SM90, "fp8xfp4", "fp8_fp4_mega_moe", "fp4-ue8m0", 128, 128, ("study",),
          "DeepGEMM PR #323 (8ddf7f9) deep_gemm/mega/__init__.py"),
    # The mma_type values SGLang 0.5.23 derives (sglang/srt/layers/moe/mega_moe.py,
    # _mega_moe_mma_type) for the fp8_fp4_mega_moe of its DeepGEMM.
    Build(DEEPGEMM, "fp8xfp4", "fp8_fp4_mega_moe", "checkpoint", None, None, ("sglang",),
          "SGLang 0.5.23 sglang/srt/layers/moe/mega_moe.py"),
    Build(DEEPGEMM, "nvfp4xnvfp4", "fp8_fp4_mega_moe", "checkpoint", None, None, ("sglang",),
          "SGLang 0.5.23 sglang/srt/layers/moe/mega_moe.py"),
    Build(DEEPGEMM, "mxf4xmxf4", "fp8_fp4_mega_moe", "checkpoint", None, None, ("sglang",),
          "SGLang 0.5.23 sglang/srt/layers/moe/mega_moe.py"),
)


def builds(kernel: str | None = None, user: str | None = None) -> tuple[Build, ...]:
    """The rows of ``kernel`` (any kernel: ``None``) offered by ``user`` (anyone: ``None``),
    in catalogue order."""
    return tuple(b for b in BUILDS if kernel in (None, b.kernel) and user in (None, *b.users))


def mma_types(kernel: str | None = None, user: str | None = None) -> tuple[str, ...]:
    """The MMA types of :func:`builds`, each once, in catalogue order."""
    return tuple(dict.fromkeys(b.mma_type for b in builds(kernel, user)))


def build(kernel: str, mma_type: str) -> Build:
    """The row of ``kernel``'s ``mma_type``.

    Raises:
        ValueError: no such row (the message lists the kernel's MMA types).
    """
    for b in BUILDS:
        if b.kernel == kernel and b.mma_type == mma_type:
            return b
    raise ValueError(
        f"moewire.reference.catalogue: kernel {kernel!r} has no MMA type {mma_type!r}; it has "
        f"{', '.join(mma_types(kernel)) or 'none'} (add a Build row for a new build)"
    )


def real(kernel: str) -> str | None:
    """What a real kernel needs to run (its GPU and package), or ``None`` for the stand-in,
    which runs anywhere."""
    return _REAL.get(kernel)


#: The stand-in's kernel function -> its MMA type.
MMA_OF_KERNEL = {b.function: b.mma_type for b in builds(STAND_IN)}
