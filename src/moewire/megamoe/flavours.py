"""Kernel build flavours: where each DeepGEMM build's kernels put the combine rows, and in
what order they add them up.

A flavour is a property of the DeepGEMM *build* that the model calls, not of the model
(SPEC sections 1, 1.2, 1.3). One flavour per build read so far:

==================  =====================================================================
``deepgemm-main``   upstream DeepGEMM (SM100): ``fp8_fp4_mega_moe``; combine region last;
                    no fused shared expert.
``vllm-0.32``       the DeepGEMM bundled in vLLM 0.32 (``vllm/third_party/deep_gemm``,
                    ``__version__ == '2.8.0'``): ``fp8_fp4_mega_moe`` and ``bf16_mega_moe``;
                    combine region last; a fused shared expert is added **last**.
``vllm-0.33``       the DeepGEMM bundled in vLLM 0.33 and 0.34 (``2.8.1``, adds
                    ``fp4_fp4_mega_moe``): a fused shared expert is added **first**
                    ("Shared slot goes first, then routed slots in top-k order",
                    ``include/deep_gemm/impls/sm100_fp8_fp4_mega_moe.cuh`` l.1464, also
                    ``sm100_bf16_mega_moe.cuh`` l.1286 and ``..._situ.cuh`` l.1473); for
                    ``bf16_mega_moe`` a ``combine_norm_buffer`` follows the combine region
                    (``include/deep_gemm/layout/mega_moe.cuh`` l.458-471), so its base is
                    the end of the L2 scale region, not the buffer's tail.
``deepgemm-sm90``   DeepGEMM pull request #323 (SM90 port): ``fp8_mega_moe`` and
                    ``fp8_fp4_mega_moe``; no fused shared expert; the buffer's views are
                    DLPack tensors sharing no storage with ``.buffer``.
==================  =====================================================================

Every build read so far **stores** a fused shared expert's row at slot ``k`` (after the
``k`` routed slots); what differs is where it is **added** in the sum
(:attr:`KernelLayout.shared_position`), where the region starts
(:attr:`KernelLayout.base_rule`) and whether the combine applies the router weights
(:attr:`KernelLayout.weighted`). A layout is per kernel function, since kernels of one
build differ (``bf16_mega_moe`` in ``vllm-0.33``).

:func:`detect` names the flavour of an imported ``deep_gemm`` module from facts of the
module itself (which functions it has, their parameters); the layout check of the first
batch (``moewire.megamoe.layout_check``) is what proves the choice. ``MOEWIRE_FLAVOUR=<name>``
overrides the detection.

Base rules locate regions by ``data_ptr()`` differences: a view may be a DLPack tensor that
shares no storage object with ``.buffer`` (the SM90 build), so storage identity proves
nothing.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from moewire import kernels

__all__ = [
    "BASE_RULES",
    "ENV_FLAVOUR",
    "ROWS_KINDS",
    "SHARED_POSITIONS",
    "UNSUPPORTED_KERNELS",
    "Flavour",
    "KernelLayout",
    "detect",
    "get",
    "kernel_functions",
    "names",
    "register",
    "register_base_rule",
    "rows_kind",
]

# Where a fused shared row is added (the one definition lives with the kernels, the lowest
# layer, which take it as an argument).
SHARED_POSITIONS = kernels.SHARED_POSITIONS
#: What a combine amax describes: router-weighted rows or unweighted expert outputs.
ROWS_KINDS = ("weighted", "unweighted")
ENV_FLAVOUR = "MOEWIRE_FLAVOUR"
# Names used before issue 12; each named a picture of a build, not a build.
RENAMED = {
    "upstream": "deepgemm-main",
    "vllm": "vllm-0.32 (vLLM 0.32's bundled DeepGEMM: shared expert added last) or "
    "vllm-0.33 (vLLM 0.33/0.34's: shared expert added first)",
    "sgl": "deepgemm-sm90 (DeepGEMM PR #323, no fused shared expert)",
}


# Mega-MoE kernels moewire refuses inside a quantized forward, with the reason.
UNSUPPORTED_KERNELS = {
    "fp4_fp4_mega_moe": (
        "the NVFP4 x NVFP4 kernel of vLLM 0.33/0.34's DeepGEMM can RMS-normalise each "
        "expert row at combine time from FP32 squared-norm partials kept in its "
        "combine_norm_buffer (post_expert_norm_gamma; impls/sm100_fp4_fp4_mega_moe.cuh), so "
        "the rows in the buffer are not what it sums (SPEC 1.5; only Muse Spark's own runner "
        "calls it)"
    ),
}


def rows_kind(layout: KernelLayout) -> str:
    """What a kernel's combine rows are, hence what a combine amax calibrated on them
    describes: ``"unweighted"`` (``nvfp4_mega_moe``: expert outputs before the router
    weight) or ``"weighted"`` (``fp8_fp4_mega_moe``, ``bf16_mega_moe``: router weight
    applied before L2). Amaxes of the two kinds are not interchangeable."""
    return "unweighted" if layout.weighted else "weighted"


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
            weighted (the weight was applied before L2) and are simply added.
    """

    base_rule: str
    shared_position: str | None
    weighted: bool = False

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

    def combine_base(self, symm_buffer: Any, combine_bytes: int, where: str) -> int:
        """Byte offset of the combine region (``combine_bytes`` long) in the flat buffer."""
        return BASE_RULES[self.base_rule](symm_buffer, combine_bytes, where)


def _never(namespace: Any) -> bool:
    return False


@dataclass(frozen=True)
class Flavour:
    """One DeepGEMM build: its Mega-MoE kernel functions and their combine layouts.

    Attributes:
        name: registry name (``"vllm-0.33"``).
        kernels: kernel function name (``"fp8_fp4_mega_moe"``) -> :class:`KernelLayout`.
        recognise: ``deep_gemm module -> bool``, true when an imported module is this build
            (:func:`detect` asks the flavours in registration order).
        description: one line for errors and docs.
    """

    name: str
    kernels: Mapping[str, KernelLayout]
    recognise: Callable[[Any], bool] = field(default=_never, compare=False)
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Flavour: name must be a non-empty str, got {self.name!r}")
        if not self.kernels:
            raise ValueError(f"flavour {self.name!r}: give at least one kernel function layout")
        for kernel, layout in self.kernels.items():
            if not isinstance(layout, KernelLayout):
                raise TypeError(
                    f"flavour {self.name!r}: the layout of {kernel!r} must be a KernelLayout, "
                    f"got {type(layout).__name__}"
                )
        object.__setattr__(self, "kernels", MappingProxyType(dict(self.kernels)))

    def layout(self, kernel: str) -> KernelLayout:
        """The combine layout of ``kernel``; a kernel this build lacks is refused."""
        try:
            return self.kernels[kernel]
        except KeyError:
            raise ValueError(
                f"kernel flavour {self.name!r} has no Mega-MoE kernel {kernel!r} (it has "
                f"{', '.join(sorted(self.kernels))}); moewire does not know where that "
                "kernel leaves its combine rows: use the flavour of the build that has it, or "
                "register one with moewire.megamoe.flavours.register"
            ) from None

    def fuses_shared(self) -> bool:
        """Whether any kernel of this build can fuse a shared expert."""
        return any(layout.shared_position is not None for layout in self.kernels.values())


_REGISTRY: dict[str, Flavour] = {}


def register(flavour: Flavour) -> Flavour:
    """Register ``flavour`` under its name; a name is registered once."""
    if not isinstance(flavour, Flavour):
        raise TypeError(f"register: expected a Flavour, got {type(flavour).__name__}")
    if flavour.name in _REGISTRY or flavour.name in RENAMED:
        raise ValueError(f"kernel flavour {flavour.name!r} is already registered (or reserved)")
    _REGISTRY[flavour.name] = flavour
    return flavour


def get(name: str | Flavour) -> Flavour:
    """The registered flavour called ``name`` (a :class:`Flavour` is returned as is).

    Raises:
        ValueError: an unknown name, or one of the names used before issue 12 (the
            message gives the new name).
    """
    if isinstance(name, Flavour):
        return name
    if isinstance(name, str) and name in RENAMED:
        raise ValueError(
            f"kernel flavour {name!r} was renamed: each flavour now names one DeepGEMM build; "
            f"use {RENAMED[name]}"
        )
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown kernel flavour {name!r}; known flavours: {', '.join(names())}"
        ) from None


def names() -> list[str]:
    """Names of every registered flavour, sorted."""
    return sorted(_REGISTRY)


def kernel_functions() -> frozenset[str]:
    """Every kernel function name some registered flavour describes (the ones moewire wraps)."""
    return frozenset(kernel for flav in _REGISTRY.values() for kernel in flav.kernels)


def detect(namespace: Any, where: str = "moewire") -> Flavour:
    """The flavour of an imported DeepGEMM module (``MOEWIRE_FLAVOUR`` overrides).

    Facts read: which Mega-MoE functions the module has, and whether
    ``get_symm_buffer_for_mega_moe`` takes ``num_shared_experts`` (vLLM's bundled copies)
    or not (upstream). The layout check confirms the choice on the first routed batch.

    Args:
        namespace: the ``deep_gemm`` module object the model calls (or the stand-in
            ``moewire.reference.deep_gemm``, which says its flavour itself).
        where: the caller, for errors (a layer name).

    Raises:
        ValueError: ``MOEWIRE_FLAVOUR`` names no flavour.
        RuntimeError: no flavour recognises the module; the message lists the facts
            looked for.
    """
    override = os.environ.get(ENV_FLAVOUR, "").strip()
    if override:
        try:
            return get(override)
        except ValueError as exc:
            raise ValueError(f"{where}: environment variable {ENV_FLAVOUR}: {exc}") from None
    for flav in _REGISTRY.values():
        if flav.recognise(namespace):
            return flav
    module = getattr(namespace, "__name__", type(namespace).__name__)
    path = getattr(namespace, "__file__", None)
    raise RuntimeError(
        f"{where}: the DeepGEMM module {module!r} ({path or 'no file'}, version "
        f"{getattr(namespace, '__version__', 'unknown')}) is no build moewire knows: looked "
        f"for {', '.join(SM90_FORK_FUNCTIONS)} (deepgemm-sm90-fork, the DeepGEMM fork vLLM "
        "main's Hopper experts need), get_symm_buffer_for_sm90_mega_moe (deepgemm-sm90), "
        "fp4_fp4_mega_moe and a "
        "num_shared_experts parameter of get_symm_buffer_for_mega_moe (vllm-0.33), that "
        "parameter without fp4_fp4_mega_moe (vllm-0.32), get_symm_buffer_for_mega_moe "
        f"without it (deepgemm-main). Set {ENV_FLAVOUR} to one of {', '.join(names())} if "
        "you know the build (the layout check then proves it), or register a flavour"
    )


def _parameters(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _has(namespace: Any, *names_: str) -> bool:
    return all(callable(getattr(namespace, n, None)) for n in names_)


def _own_flavour(namespace: Any) -> str | None:
    """A stand-in module says which build it imitates (``moewire_flavour()``)."""
    own = getattr(namespace, "moewire_flavour", None)
    return own() if callable(own) else None


def _is_sm90_fork(namespace: Any) -> bool:
    own = _own_flavour(namespace)
    if own is not None:
        return own == "deepgemm-sm90-fork"
    return _has(namespace, *SM90_FORK_FUNCTIONS)


def _is_sm90(namespace: Any) -> bool:
    own = _own_flavour(namespace)
    if own is not None:
        return own == "deepgemm-sm90"
    return _has(namespace, "get_symm_buffer_for_sm90_mega_moe")


def _bundled(namespace: Any) -> bool:
    return _has(namespace, "get_symm_buffer_for_mega_moe") and (
        "num_shared_experts" in _parameters(namespace.get_symm_buffer_for_mega_moe)
    )


def _is_vllm_033(namespace: Any) -> bool:
    own = _own_flavour(namespace)
    if own is not None:
        return own == "vllm-0.33"
    return _bundled(namespace) and _has(namespace, "fp4_fp4_mega_moe")


def _is_vllm_032(namespace: Any) -> bool:
    own = _own_flavour(namespace)
    if own is not None:
        return own == "vllm-0.32"
    return _bundled(namespace) and not _has(namespace, "fp4_fp4_mega_moe")


def _is_main(namespace: Any) -> bool:
    own = _own_flavour(namespace)
    if own is not None:
        return own == "deepgemm-main"
    return _has(namespace, "get_symm_buffer_for_mega_moe", "fp8_fp4_mega_moe") and not (
        _bundled(namespace) or _is_sm90(namespace)
    )


_LAST = KernelLayout("last_region", None)
_AFTER_L2 = KernelLayout("after_l2_scales", None)

# vLLM main's Hopper experts (vllm/models/deepseek_v4/nvidia/sm90_mega_moe.py) need a DeepGEMM
# fork exposing these (vllm/utils/deep_gemm.py: deep_gemm_supports_sm90_mega_moe). The fork's
# buffer layout is not public: PR #323's (combine region after the L2 scales) is the guess,
# and the layout check of the first batch is what accepts or refuses it.
SM90_FORK_FUNCTIONS = (
    "fp8_mega_moe_sm90",
    "get_symm_buffer_for_sm90_mega_moe",
    "transform_weights_for_mega_moe_sm90",
)
register(
    Flavour(
        "deepgemm-sm90-fork",
        {"fp8_mega_moe_sm90": _AFTER_L2},
        _is_sm90_fork,
        "the DeepGEMM fork vLLM main's SM90 experts call: layout guessed from PR #323, "
        "proven by the layout check",
    )
)

register(
    Flavour(
        "deepgemm-sm90",
        {"fp8_mega_moe": _AFTER_L2, "fp8_fp4_mega_moe": _AFTER_L2},
        _is_sm90,
        "DeepGEMM PR #323 (SM90 port): no fused shared expert, DLPack views",
    )
)
register(
    Flavour(
        "vllm-0.33",
        {
            "fp8_fp4_mega_moe": KernelLayout("after_l2_scales", "first"),
            "bf16_mega_moe": KernelLayout("after_l2_scales", "first"),
            # mega/nvfp4.py: unweighted rows, FMA combine with the shared row last
            # (impls/sm100_nvfp4_mega_moe.cuh ~l.1746-1807); x_scales regions follow the
            # combine region (layout/nvfp4_mega_moe.cuh ~l.115-126).
            "nvfp4_mega_moe": KernelLayout("after_l2_scales", "last", weighted=True),
        },
        _is_vllm_033,
        "DeepGEMM bundled in vLLM 0.33/0.34: fused shared expert added first",
    )
)
register(
    Flavour(
        "vllm-0.32",
        {
            "fp8_fp4_mega_moe": KernelLayout("last_region", "last"),
            "bf16_mega_moe": KernelLayout("last_region", "last"),
        },
        _is_vllm_032,
        "DeepGEMM bundled in vLLM 0.32: fused shared expert added last",
    )
)
register(
    Flavour(
        "deepgemm-main",
        {"fp8_fp4_mega_moe": _LAST},
        _is_main,
        "upstream DeepGEMM (SM100): no fused shared expert",
    )
)
