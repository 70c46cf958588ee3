"""The DeepGEMM builds moewire knows, one declarative entry per build.

An entry (:class:`Build`) says everything moewire needs of one build: the structural
facts that recognise its module (:class:`Recognition`: which functions it has, which
parameters they take, never a version string), its Mega-MoE kernel functions and where
each leaves its combine rows and in what order it adds them (:class:`KernelLayout`), the
staging casts a forward may call on it, the kernels moewire refuses, and what was read and
what stays unproven. ``moewire.megamoe.flavours`` registers one flavour per entry and
derives from them detection, its error message, the refused kernels and the names the
wrapper hooks; adding a build is adding one entry to :data:`BUILDS`
(docs/architecture.md, "Adding a kernel build or a vLLM site").

The combine region is always BF16 ``[num_slots][Tmax][H]``, slot-major; a *base rule*
(:data:`BASE_RULES`) locates it in ``symm_buffer.buffer`` by ``data_ptr()`` differences
(a view may be a DLPack tensor that shares no storage object with ``.buffer``).

May import: torch and ``moewire.kernels`` (for ``SHARED_POSITIONS``); nothing above.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from moewire import kernels

__all__ = [
    "BASE_RULES",
    "BUILDS",
    "RENAMED",
    "SHARED_POSITIONS",
    "SM90_FORK_FUNCTIONS",
    "Build",
    "KernelLayout",
    "Recognition",
    "flat_buffer",
    "register_base_rule",
]

# Where a fused shared row is added (the one definition lives with the kernels, the lowest
# layer, which take it as an argument).
SHARED_POSITIONS = kernels.SHARED_POSITIONS

# Names of earlier moewire versions; each named a picture of a build, not a build.
RENAMED = {
    "upstream": "deepgemm-main",
    "vllm": "vllm-0.32 (vLLM 0.32's bundled DeepGEMM: shared expert added last) or "
    "vllm-0.33 (vLLM 0.33/0.34's: shared expert added first)",
    "sgl": "deepgemm-sm90 (DeepGEMM PR #323, no fused shared expert)",
}


# -- where the combine region starts ------------------------------------------------------------


def flat_buffer(symm_buffer: Any, where: str) -> torch.Tensor:
    """``symm_buffer.buffer``, checked to be a flat int8 tensor."""
    buffer = getattr(symm_buffer, "buffer", None)
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or buffer.dtype != torch.int8:
        raise ValueError(
            f"{where}: the symmetric buffer must have a flat int8 tensor in `.buffer`, got "
            f"{type(buffer).__name__}"
            + (f" {buffer.dtype} {tuple(buffer.shape)}" if isinstance(buffer, torch.Tensor) else "")
            + "; pass the SymmBuffer from get_symm_buffer_for_mega_moe"
        )
    return buffer


def _base_last_region(symm_buffer: Any, combine_bytes: int, where: str) -> int:
    """The combine region ends where the buffer ends (DeepGEMM main, vLLM 0.32's build)."""
    return flat_buffer(symm_buffer, where).numel() - combine_bytes


def _base_after_l2_scales(symm_buffer: Any, combine_bytes: int, where: str) -> int:
    """The combine region starts where the L2 scale region ends (``l2_acts_sf``; for a
    kernel without scales, where ``l2_acts`` ends): ``layout/mega_moe.cuh``'s
    ``combine_token_buffer`` in every build read so far.

    Measured as ``view.data_ptr() + view bytes - buffer.data_ptr()``: the view may share no
    storage object with ``.buffer`` (DLPack views of the SM90 build), but it points into it.
    """
    flat = flat_buffer(symm_buffer, where)
    view = getattr(symm_buffer, "l2_acts_sf", None)
    if not isinstance(view, torch.Tensor) or view.numel() == 0:
        view = getattr(symm_buffer, "l2_acts", None)
    if not isinstance(view, torch.Tensor) or view.numel() == 0:
        raise ValueError(
            f"{where}: the combine base of this build is the end of the buffer's "
            "`l2_acts_sf` (or `l2_acts`) view, and the buffer has neither; use the flavour "
            "of the DeepGEMM build that made this buffer"
        )
    start = view.data_ptr() - flat.data_ptr()
    end = start + view.numel() * view.element_size()
    if start < 0 or end > flat.numel() or view.device != flat.device:
        raise ValueError(
            f"{where}: the buffer's L2 view (bytes {start}..{end}) does not lie inside "
            f"`.buffer` ({flat.numel()} bytes on {flat.device}); the views were not sliced "
            "from this buffer: pass the SymmBuffer whose views the kernel uses"
        )
    return end


BaseRule = Callable[[Any, int, str], int]

BASE_RULES: dict[str, BaseRule] = {
    "last_region": _base_last_region,
    "after_l2_scales": _base_after_l2_scales,
}


def register_base_rule(name: str, rule: BaseRule) -> None:
    """Register ``rule(symm_buffer, combine_bytes, where) -> byte offset`` under ``name``.

    The offset is in bytes from ``symm_buffer.buffer.data_ptr()``; ``where`` names the
    caller in errors.
    """
    if name in BASE_RULES:
        raise ValueError(f"combine base rule {name!r} is already registered")
    BASE_RULES[name] = rule


@dataclass(frozen=True)
class KernelLayout:
    """Where one kernel function of one build leaves its combine rows.

    Attributes:
        base_rule: name in :data:`BASE_RULES`: the byte offset of the BF16
            ``[num_slots][Tmax][H]`` combine region in ``symm_buffer.buffer``.
        shared_position: where a fused shared expert's row (stored at slot ``k``) is added
            in the sum: ``"first"``, ``"last"``, or ``None`` (this kernel fuses none).
        weighted: the combine multiplies each row by its router weight (the rows in the
            buffer are unweighted, ``nvfp4_mega_moe``); ``False``: the rows are already
            weighted (the weight was applied before the row was written) and are simply added.
        routed_scale: the kernel's keyword argument (``"routed_scaling_factor"``) whose factor
            ``s`` the combine applies to the routed sum: with ``s != 1`` or a fused shared
            row, the FP32 routed sum is rounded to BF16, multiplied by ``s`` (one more BF16
            rounding, skipped for ``s = 1``) and the shared row (``shared_position`` last) is
            added to it in FP32 before the final rounding (DeepGEMM 2.8.0
            ``fp4_fp4_mega_moe``); ``None``: the kernel has no such step.
    """

    base_rule: str
    shared_position: str | None
    weighted: bool = False
    routed_scale: str | None = None

    def __post_init__(self) -> None:
        if self.base_rule not in BASE_RULES:
            raise ValueError(
                f"KernelLayout: unknown combine base rule {self.base_rule!r}; known rules: "
                f"{sorted(BASE_RULES)} (add one with register_base_rule)"
            )
        if self.shared_position not in SHARED_POSITIONS:
            raise ValueError(
                f"KernelLayout: shared_position must be one of {SHARED_POSITIONS}, got "
                f"{self.shared_position!r}"
            )
        if not isinstance(self.weighted, bool):
            raise TypeError(f"KernelLayout: weighted must be a bool, got {self.weighted!r}")
        if self.routed_scale is not None and (
            self.shared_position == "first" or self.weighted
        ):
            raise ValueError(
                "KernelLayout: a routed_scale step rounds and scales the sum of already "
                "weighted routed rows before a shared row added last; it takes "
                f"shared_position None or 'last' and weighted=False, got "
                f"{self.shared_position!r} and {self.weighted!r}"
            )

    def combine_base(self, symm_buffer: Any, combine_bytes: int, where: str) -> int:
        """Byte offset of the combine region (``combine_bytes`` long) in the flat buffer."""
        return BASE_RULES[self.base_rule](symm_buffer, combine_bytes, where)


# -- what recognises a build ----------------------------------------------------------------


def _parameters(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


@dataclass(frozen=True)
class Recognition:
    """Facts of an imported DeepGEMM module that identify one build.

    Attributes:
        functions: callables the module has.
        absent: names the module lacks (a later build adds them).
        takes: ``(function, parameter)`` pairs: the function takes that parameter.
        lacks_parameter: ``(function, parameter)`` pairs: it does not.
    """

    functions: tuple[str, ...]
    absent: tuple[str, ...] = ()
    takes: tuple[tuple[str, str], ...] = ()
    lacks_parameter: tuple[tuple[str, str], ...] = ()

    def matches(self, namespace: Any) -> bool:
        """Whether ``namespace`` has every fact."""
        if not all(callable(getattr(namespace, n, None)) for n in self.functions):
            return False
        if any(callable(getattr(namespace, n, None)) for n in self.absent):
            return False
        params = {fn: _parameters(getattr(namespace, fn, None))
                  for fn, _ in (*self.takes, *self.lacks_parameter)}
        return all(p in params[fn] for fn, p in self.takes) and not any(
            p in params[fn] for fn, p in self.lacks_parameter
        )

    def describe(self) -> str:
        """The facts, in words (for the error that lists what was looked for)."""
        parts = [", ".join(self.functions)]
        parts += [f"{fn} taking {p}" for fn, p in self.takes]
        parts += [f"{fn} without {p}" for fn, p in self.lacks_parameter]
        parts += [f"no {n}" for n in self.absent]
        return "; ".join(parts)


@dataclass(frozen=True)
class Build:
    """One DeepGEMM build, as moewire describes it.

    Attributes:
        name: the flavour name (``"vllm-0.33"``).
        kernels: kernel function name -> :class:`KernelLayout`.
        recognition: the facts of its module (:class:`Recognition`).
        description: one line for errors and docs.
        read: the sources the layouts were read from.
        unproven: what could not be read (the layout check decides), or ``""``.
        staging_casts: DeepGEMM casts a forward that stages inline may call on it (hooked
            on the module object and its ``utils``).
        refused: kernel functions moewire refuses inside a quantized forward -> why.
    """

    name: str
    kernels: Mapping[str, KernelLayout]
    recognition: Recognition
    description: str
    read: str
    unproven: str = ""
    staging_casts: tuple[str, ...] = ("per_token_cast_to_fp8",)
    refused: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernels", MappingProxyType(dict(self.kernels)))
        object.__setattr__(self, "refused", MappingProxyType(dict(self.refused)))


_LAST = KernelLayout("last_region", None)
_AFTER_L2 = KernelLayout("after_l2_scales", None)

#: vLLM main's Hopper experts need these (vllm/utils/deep_gemm.py:
#: deep_gemm_supports_sm90_mega_moe; named by sm90_mega_moe.py's _check_runtime_supported).
SM90_FORK_FUNCTIONS = (
    "fp8_mega_moe_sm90",
    "get_symm_buffer_for_sm90_mega_moe",
    "transform_weights_for_mega_moe_sm90",
)

# vLLM 0.33/0.34's bundled fp4_fp4_mega_moe (2.8.1) is another kernel under the same name:
# refused on that build alone (a Build's `refused`), never by the name.
#: Why a combine that normalises each expert row before the route-weighted sum is refused on
#: every host (vLLM 0.33/0.34's fp4_fp4_mega_moe, SGLang's ``post_expert_norm`` paths): the
#: rows moewire would quantize are not the rows the kernel adds.
POST_EXPERT_NORM = (
    "the combine RMS-normalises each expert row before summing, so the rows in the buffer "
    "are not what it adds"
)

#: What aiter's ``MegaMoEV2`` (FlyDSL, ROCm), behind vLLM's ``--moe-backend flydsl_mega_moe``
#: and SGLang's ``SGLANG_AMD_USE_FLYDSL_MEGA_MOE=1``, does with the wire, read in ROCm/aiter
#: main at 03447f9 (``aiter/ops/flydsl/kernels/mega_moe/intra_node.py``,
#: ``mega_moe_config.py``; neither engine pins an aiter version): why both hosts refuse it.
AITER_MEGAMOE_V2 = (
    "aiter's MegaMoEV2.forward (ROCm/aiter 03447f9, ops/flydsl/kernels/mega_moe/intra_node.py) "
    "casts the tokens to FP8 with a scale per 32 columns itself, sends them over MoRI shared "
    "memory, and its stage 2 writes each (token, top-k slot) row into the combine op's peer "
    "buffer, in BF16 or in FP8 per 32 columns as the config for the token count chooses "
    "(p2p_quant in mega_moe_config.py; moewire's flydsl_fp8_blockwise_1x32 format is that "
    "cast), before combine_no_stage1 sums them: moewire has no stand-in of that buffer or its "
    "sum, and cannot tell a batch's rows BF16 from already-quantized ones"
)

_FP4_FP4_REFUSED = (
    f"{POST_EXPERT_NORM}: the NVFP4 x NVFP4 kernel of vLLM 0.33/0.34's DeepGEMM can "
    "RMS-normalise each expert row at combine time from FP32 squared-norm partials kept in its "
    "combine_norm_buffer (post_expert_norm_gamma; impls/sm100_fp4_fp4_mega_moe.cuh), so "
    "the rows in the buffer are not what it sums (vLLM 0.34.0; only Muse Spark's own runner "
    "calls it); DeepGEMM 2.8.0's kernel of that name (the deepgemm-2.8 build, vLLM main's "
    "pin) is supported"
)

# DeepGEMM 2.8.0's NVFP4 x NVFP4 kernel (PR #409). Its buffer (csrc/apis/mega_moe.hpp and
# layout/mega_moe.cuh at 0274ad7; layout/nvfp4_mega_moe.cuh at 794783a orders the regions the
# same way) ends with the combine region, right after the L2 scale region (l2_acts_sf, an
# MN-major view whose data_ptr is the region's start). Its combine
# (impls/sm100_fp4_fp4_mega_moe.cuh at 794783a): rows bf16(bf16(acc * l2_alpha * a2_scale) *
# topk_weight), valid slots summed in ascending order in FP32 (__ffs), the shared slot k the
# highest bit and so the last; before it (or, without one, before the final cast when the
# factor is not 1) the routed sum is rounded to BF16 and scaled by routed_scaling_factor.
_FP4_FP4_28 = KernelLayout("after_l2_scales", "last", routed_scale="routed_scaling_factor")

# sgl-deep-gemm (the DeepGEMM SGLang pins), read from the released wheels 0.2.3.post2 (what
# sglang 0.5.23 pins) and 0.2.5. One module holds the SM90 kernel (``fp8_mega_moe`` on
# ``SM90SymmBuffer``, staged by ``mega_moe_pre_dispatch_sm90``) and the SM100 one
# (``fp8_fp4_mega_moe`` on ``mega.SymmBuffer(mma_type=, num_shared_experts=)``, staged by
# ``mega_moe_pre_dispatch`` or SGLang's own cast). Both put the BF16 ``[slots][Tmax][H]``
# combine region right after the L2 scale buffer: ``impls/sm90_fp8_mega_moe.cuh``
# (``combine_token_buffer`` on ``l2_sf_buffer.get_end_ptr()``) and ``layout/mega_moe.cuh``
# (``MegaMoEBuffer``: after ``l2_sf_buffer``, or ``l2_token_buffer`` without scales). Both
# sum the valid slots in FP32 from +0.0 and round once to BF16; the SM90 kernel in
# ascending slot order (``__ffs`` of the slot mask) with no shared slot
# (``get_symm_buffer_for_mega_moe`` asserts ``num_shared_experts == 0`` on SM90).
_SGL_STAGING = ("mega_moe_pre_dispatch_sm90", "mega_moe_pre_dispatch")
_SGL_FACTS = ("SM90SymmBuffer", "mega_moe_pre_dispatch_sm90", "get_block_m_for_mega_moe",
              "transform_scales_for_mega_moe")
# The fork vLLM main's SM90 experts call names its kernel fp8_mega_moe_sm90; sgl-deep-gemm's
# is fp8_mega_moe.
_SGL_ABSENT = ("fp8_mega_moe_sm90",)
_SGL_TAKES = (("get_symm_buffer_for_mega_moe", "num_shared_experts"),
              ("get_symm_buffer_for_mega_moe", "mma_type"))
_SGL_UNPROVEN = (
    "the FP8 combine rows of DG_USE_FP8_COMBINE=1 (refused by the SGLang integration), "
    "post_expert_norm (refused), the SM100 kernels on hardware, and 0.2.5's SM90 early "
    "combine (the same rows and order by the source; the layout check decides)"
)

_SGL_BUILDS: tuple[Build, ...] = (
    Build(
        "sgl-deep-gemm-0.2.5",
        {"fp8_mega_moe": _AFTER_L2,
         # Shared slot first, then the routed slots in top-k order ("Shared slot goes
         # first", impls/sm100_fp8_fp4_mega_moe.cuh, combine's move_mask_and_load).
         "fp8_fp4_mega_moe": KernelLayout("after_l2_scales", "first")},
        Recognition((*_SGL_FACTS, "localize"), absent=_SGL_ABSENT, takes=_SGL_TAKES),
        "sgl-deep-gemm 0.2.5 (SGLang's DeepGEMM): SM90 fp8_mega_moe, SM100 fp8_fp4_mega_moe "
        "with a fused shared expert added first",
        read="sgl-deep-gemm 0.2.5 wheel: deep_gemm/__init__.py, deep_gemm/mega/__init__.py, "
        "include/deep_gemm/layout/{mega_moe,sm90_mega_moe}.cuh, "
        "impls/{sm90_fp8_mega_moe,sm100_fp8_fp4_mega_moe,sm90_mega_moe_pre_dispatch}.cuh",
        unproven=_SGL_UNPROVEN,
        staging_casts=_SGL_STAGING,
    ),
    Build(
        "sgl-deep-gemm-0.2.3",
        {"fp8_mega_moe": _AFTER_L2,
         # Ascending slot order over the mask, the shared slot k last (__ffs, no special
         # case; impls/sm100_fp8_fp4_mega_moe.cuh, combine).
         "fp8_fp4_mega_moe": KernelLayout("after_l2_scales", "last")},
        Recognition(_SGL_FACTS, absent=("localize", *_SGL_ABSENT), takes=_SGL_TAKES),
        "sgl-deep-gemm 0.2.3.post2 (the one sglang 0.5.23 pins): SM90 fp8_mega_moe, SM100 "
        "fp8_fp4_mega_moe with a fused shared expert added last",
        read="sgl-deep-gemm 0.2.3.post2 wheel: deep_gemm/__init__.py, "
        "deep_gemm/mega/__init__.py, include/deep_gemm/layout/mega_moe.cuh, "
        "impls/{sm90_fp8_mega_moe,sm100_fp8_fp4_mega_moe,sm90_mega_moe_pre_dispatch}.cuh",
        unproven=_SGL_UNPROVEN,
        staging_casts=_SGL_STAGING,
    ),
)

#: Every build moewire knows. Their facts are exclusive: a module matches one entry at most
#: (``flavours.detect`` refuses a module that two entries match).
BUILDS: tuple[Build, ...] = (
    *_SGL_BUILDS,
    Build(
        "deepgemm-sm90-fork",
        {"fp8_mega_moe_sm90": _AFTER_L2},
        Recognition(SM90_FORK_FUNCTIONS),
        "the DeepGEMM fork vLLM main's SM90 experts call: layout guessed from PR #323, "
        "proven by the layout check",
        read="vLLM main vllm/models/deepseek_v4/nvidia/sm90_mega_moe.py (6cd8b6b): the call "
        "signature, FP8 weights with 128x128 scales, no fused shared expert",
        unproven="the fork's source (github.com/lengrongfu/DeepGEMM, branch "
        "claude/pr36-mega-moe-port) is not stored here: its buffer layout and summation "
        "order are PR #323's (the kernels it ports) by assumption",
    ),
    Build(
        "deepgemm-2.8",
        # SymmBuffer of 0274ad7 slices x, x_sf, topk_idx, topk_weights, shared_l1/l2 acts,
        # l1/l2 acts (and scales) as vLLM 0.33/0.34's 2.8.1 does, with num_shared_experts:
        # that build's layout is the guess for the SM100 kernels, proven by the layout check.
        # The SM90 fp8_mega_moe (#383, an SM90SymmBuffer with PR #323's view names): PR
        # #323's layout is the guess, and the first batch's layout check decides between them.
        {
            "fp8_fp4_mega_moe": KernelLayout("after_l2_scales", "first"),
            "bf16_mega_moe": KernelLayout("after_l2_scales", "first"),
            "fp8_mega_moe": _AFTER_L2,
            "fp4_fp4_mega_moe": _FP4_FP4_28,
        },
        Recognition(("get_symm_buffer_for_sm90_mega_moe", "transform_weights_for_mega_moe_sm90",
                     "fp8_mega_moe", "fp4_fp4_mega_moe"),
                    # mega_moe_pre_dispatch_sm90 is sgl-deep-gemm's (its deep_gemm/__init__.py);
                    # upstream's SM90 path is staged by the caller.
                    absent=("fp8_mega_moe_sm90", "mega_moe_pre_dispatch_sm90"),
                    takes=(("fp4_fp4_mega_moe", "routed_scaling_factor"),
                           ("get_symm_buffer_for_mega_moe", "num_shared_experts"))),
        "upstream DeepGEMM 2.8.0 (SM100 and SM90 Mega-MoE in one module): NVFP4 x NVFP4 "
        "fp4_fp4_mega_moe read and modelled (moewire.reference.fp4_fp4); the other SM100 "
        "kernels read as vLLM 0.33's 2.8.1, the SM90 fp8_mega_moe (#383) as PR #323, all "
        "proven by the layout check",
        read="deepseek-ai/DeepGEMM deep_gemm/__init__.py and deep_gemm/mega/__init__.py at "
        "0274ad7 (__version__ 2.8.0): the exported names, SymmBuffer's views and "
        "num_shared_experts, SM90SymmBuffer, fp4_fp4_mega_moe's and fp8_mega_moe's "
        "signatures; csrc/apis/mega_moe.hpp and layout/mega_moe.cuh at 0274ad7 (the fp4xfp4 "
        "buffer: combine region last, after l2_sf_buffer); impls/sm100_fp4_fp4_mega_moe.cuh, "
        "csrc/apis/nvfp4_mega_moe.hpp and layout/nvfp4_mega_moe.cuh at 794783a (PR #409: "
        "fp4_fp4_mega_moe's numerics and combine)",
        unproven="the kernels' sources at 0274ad7 are not stored: fp4_fp4_mega_moe's is "
        "taken to be 794783a's (the API and the buffer layout of both agree), the other SM100 "
        "combines to be vLLM 0.33's 2.8.1 (after the L2 scales, fused shared row first), the "
        "SM90 fp8_mega_moe's (#383: separate L1 and L2 kernels; "
        "get_symm_buffer_size_for_sm90_mega_moe unread) to be PR #323's (after the L2 scales, "
        "no shared expert); vLLM main pins vllm-project/DeepGEMM dev 9a86ae2b (2.8.0 plus "
        "fork commits for SM120, SiTU and SwiGLU alpha/beta), whose source is not stored and "
        "is taken to be upstream's; no kernel of this build ran here (SM100); the first "
        "batch's layout check decides, a different layout is a refusal",
    ),
    Build(
        "deepgemm-sm90",
        {"fp8_mega_moe": _AFTER_L2, "fp8_fp4_mega_moe": _AFTER_L2},
        Recognition(("get_symm_buffer_for_sm90_mega_moe",), absent=("fp8_mega_moe_sm90",),
                    lacks_parameter=(("get_symm_buffer_for_mega_moe", "num_shared_experts"),)),
        "DeepGEMM PR #323 (SM90 port): no fused shared expert, DLPack views",
        read="DeepGEMM refs/pull/323/head (8ddf7f9); measured on an H200 "
        "(benchmarks/results/real-kernel)",
    ),
    Build(
        "vllm-0.33",
        {
            "fp8_fp4_mega_moe": KernelLayout("after_l2_scales", "first"),
            "bf16_mega_moe": KernelLayout("after_l2_scales", "first"),
            # mega/nvfp4.py: unweighted rows, FMA combine with the shared row last
            # (impls/sm100_nvfp4_mega_moe.cuh ~l.1746-1807); x_scales regions follow the
            # combine region (layout/nvfp4_mega_moe.cuh ~l.115-126).
            "nvfp4_mega_moe": KernelLayout("after_l2_scales", "last", weighted=True),
        },
        Recognition(("get_symm_buffer_for_mega_moe", "fp4_fp4_mega_moe"),
                    # SM100 only, as 0.32's (sgl-deep-gemm has the SM90 staging).
                    absent=("get_symm_buffer_for_sm90_mega_moe", "mega_moe_pre_dispatch_sm90"),
                    takes=(("get_symm_buffer_for_mega_moe", "num_shared_experts"),)),
        "DeepGEMM bundled in vLLM 0.33/0.34: fused shared expert added first",
        read="vllm/third_party/deep_gemm of the vLLM 0.33.0 and 0.34.0 wheels (2.8.1): "
        "impls/sm100_fp8_fp4_mega_moe.cuh l.1464, sm100_bf16_mega_moe.cuh l.1286, "
        "layout/mega_moe.cuh l.458-471",
        refused={"fp4_fp4_mega_moe": _FP4_FP4_REFUSED},
    ),
    # vllm-project/DeepGEMM (vLLM's own DeepGEMM fork, which vLLM main pins: 9a86ae2b since
    # PR #56876, not stored): its dev head as read (2.8.1, 63aa62a) and its 2.6.1 SiTU line,
    # which vLLM main's stored Kimi-K3 experts call.
    Build(
        "deepgemm-vllm-dev",
        {
            # impls/sm100_{fp8_fp4,bf16}_mega_moe.cuh, combine: "Shared slot goes first, then
            # routed slots in top-k order"; layout/mega_moe.cuh: combine_token_buffer right
            # after l2_sf_buffer (l2_token_buffer without scales), the buffer's last region.
            "fp8_fp4_mega_moe": KernelLayout("after_l2_scales", "first"),
            "bf16_mega_moe": KernelLayout("after_l2_scales", "first"),
        },
        Recognition(("get_symm_buffer_for_mega_moe", "nvfp4_mega_moe"),
                    # 2.8.1 without fp4_fp4_mega_moe (vLLM 0.33/0.34's bundled 2.8.1 has
                    # it) and without the SM90 Mega-MoE (upstream 2.8.0 and sgl-deep-gemm).
                    absent=("fp4_fp4_mega_moe", "get_symm_buffer_for_sm90_mega_moe",
                            "mega_moe_pre_dispatch_sm90"),
                    takes=(("get_symm_buffer_for_mega_moe", "num_shared_experts"),)),
        "vllm-project/DeepGEMM dev (2.8.1 at 63aa62a, the fork's head after vLLM main's pin "
        "9a86ae2b): fused shared "
        "expert added first",
        read="vllm-project/DeepGEMM at 63aa62a: deep_gemm/__init__.py (__version__ 2.8.1, its "
        "exports), layout/mega_moe.cuh (MegaMoEBuffer), impls/sm100_fp8_fp4_mega_moe.cuh and "
        "impls/sm100_bf16_mega_moe.cuh (combine); csrc/apis/mega_moe.hpp and deep_gemm/_C.py "
        "at 051140f (the SymmBuffer views, fp8_fp4_mega_moe's activation_alpha/activation_beta)",
        unproven="its nvfp4_mega_moe (impls/sm100_nvfp4_mega_moe.cuh not read at this commit: "
        "the kernel is left out of this entry, so a quantized forward calling it is refused); "
        "deep_gemm/mega/__init__.py at 63aa62a is not stored (the parameter facts come from "
        "51655f2's and 051140f's sources)",
    ),
    Build(
        "deepgemm-vllm-situ",
        # impls/sm100_fp8_fp4_mega_moe.cuh at 51655f2, combine: lanes 0..k-1 are the routed
        # slots, lane k the shared slot, added in ascending lane order (__ffs of the valid
        # mask): the shared row last.
        {"fp8_fp4_mega_moe": KernelLayout("after_l2_scales", "last")},
        Recognition(("get_symm_buffer_for_mega_moe", "fp8_fp4_mega_moe"),
                    absent=("fp4_fp4_mega_moe", "nvfp4_mega_moe",
                            "get_symm_buffer_for_sm90_mega_moe", "mega_moe_pre_dispatch_sm90"),
                    takes=(("get_symm_buffer_for_mega_moe", "num_shared_experts"),
                           ("fp8_fp4_mega_moe", "activation_linear_beta"))),
        "vllm-project/DeepGEMM's 2.6.1 SiTU line (the DeepGEMM vLLM main's stored Kimi-K3 "
        "experts call: activation_beta, activation_linear_beta): fused shared expert added last",
        read="vllm-project/DeepGEMM at 51655f2: deep_gemm/__init__.py (__version__ 2.6.1), "
        "deep_gemm/mega/__init__.py (fp8_fp4_mega_moe(..., activation_beta=None, "
        "activation_linear_beta=None)), csrc/apis/mega.hpp (beta defaults to 1, linear beta "
        "unset; the buffer's slices), impls/sm100_fp8_fp4_mega_moe.cuh (SiTU epilogue, combine)",
        unproven="layout/mega_moe.cuh at 51655f2 is not stored: the combine region is taken to "
        "follow the L2 scales as at 63aa62a (where it is also the buffer's last region); its "
        "bf16_mega_moe's combine was not read (left out of this entry)",
    ),
    Build(
        "vllm-0.32",
        {
            "fp8_fp4_mega_moe": KernelLayout("last_region", "last"),
            "bf16_mega_moe": KernelLayout("last_region", "last"),
        },
        Recognition(("get_symm_buffer_for_mega_moe",),
                    # SM100 only: no SM90 buffer function or staging (sgl-deep-gemm has
                    # both, and the same num_shared_experts parameter); no nvfp4_mega_moe
                    # (vllm-project/DeepGEMM dev has it) and not the 2.6.1 SiTU line's
                    # activation_linear_beta.
                    absent=("fp4_fp4_mega_moe", "get_symm_buffer_for_sm90_mega_moe",
                            "mega_moe_pre_dispatch_sm90", "nvfp4_mega_moe"),
                    takes=(("get_symm_buffer_for_mega_moe", "num_shared_experts"),),
                    lacks_parameter=(("fp8_fp4_mega_moe", "activation_linear_beta"),)),
        "DeepGEMM bundled in vLLM 0.32: fused shared expert added last",
        read="vllm/third_party/deep_gemm of vLLM 0.32.0 (2.8.0)",
    ),
    Build(
        "deepgemm-main",
        # 54e2261 adds bf16_mega_moe: combine_token_buffer after l2 (csrc/apis/mega.hpp), the
        # buffer's end; rows weighted in the L1 epilogue, summed in ascending slot order in
        # FP32 (impls/sm100_bf16_mega_moe.cuh, "Combine: reduce top-k results"); l1/l2 acts
        # are ring-sized (num_ring_tokens), which the last-region rule does not read.
        {"fp8_fp4_mega_moe": _LAST, "bf16_mega_moe": _LAST},
        Recognition(("get_symm_buffer_for_mega_moe", "fp8_fp4_mega_moe"),
                    absent=("get_symm_buffer_for_sm90_mega_moe",),
                    lacks_parameter=(("get_symm_buffer_for_mega_moe", "num_shared_experts"),)),
        "upstream DeepGEMM (SM100): no fused shared expert",
        read="deepseek-ai/DeepGEMM 7f2a703..54e2261: deep_gemm/mega/__init__.py, "
        "csrc/apis/mega.hpp, impls/sm100_{fp8_fp4,bf16}_mega_moe.cuh",
    ),
)
