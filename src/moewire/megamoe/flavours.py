"""Kernel build flavours: the registry of DeepGEMM builds, detection, and what derives from them.

A flavour is a property of the DeepGEMM *build* that the model calls, not of the model
(SPEC sections 1, 1.2, 1.3). The builds themselves are described once, declaratively, in
:mod:`moewire.megamoe.builds` (``BUILDS``: what recognises each, its kernels and their
layouts, its staging casts, the kernels refused, what was read and what is unproven);
this module registers one :class:`Flavour` per entry and derives the rest from the
registry: :func:`detect` and its error, :func:`kernel_functions`, :data:`UNSUPPORTED_KERNELS`,
:func:`staging_casts` and :func:`hooked_names` (what the wrapper hooks on a DeepGEMM
module).

==========================  =============================================================
``deepgemm-main``           upstream DeepGEMM (SM100): ``fp8_fp4_mega_moe`` and, from
                            54e2261, ``bf16_mega_moe``; combine region last; no fused
                            shared expert.
``vllm-0.32``               vLLM 0.32's bundled DeepGEMM (2.8.0): a fused shared expert is
                            added **last**; combine region last.
``vllm-0.33``               vLLM 0.33/0.34's (2.8.1, has ``fp4_fp4_mega_moe``): a fused
                            shared expert is added **first**; region after the L2 scales.
``deepgemm-sm90``           DeepGEMM PR #323 (SM90 port): ``fp8_mega_moe`` and
                            ``fp8_fp4_mega_moe``; DLPack views; no fused shared expert.
``deepgemm-sm90-fork``      the fork vLLM main's Hopper experts call (``fp8_mega_moe_sm90``):
                            PR #323's layout by assumption, proven by the layout check.
==========================  =============================================================

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
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from moewire.megamoe import builds as _builds
from moewire.megamoe.builds import (
    BASE_RULES,
    RENAMED,
    SHARED_POSITIONS,
    SM90_FORK_FUNCTIONS,
    Build,
    KernelLayout,
    Recognition,
    flat_buffer,
    register_base_rule,
)

__all__ = [
    "BASE_RULES",
    "ENV_FLAVOUR",
    "ROWS_KINDS",
    "SHARED_POSITIONS",
    "SM90_FORK_FUNCTIONS",
    "UNSUPPORTED_KERNELS",
    "Flavour",
    "KernelLayout",
    "detect",
    "flat_buffer",
    "get",
    "hooked_names",
    "kernel_functions",
    "names",
    "register",
    "register_base_rule",
    "rows_kind",
    "staging_casts",
]

#: What a combine amax describes: router-weighted rows or unweighted expert outputs.
ROWS_KINDS = ("weighted", "unweighted")
ENV_FLAVOUR = "MOEWIRE_FLAVOUR"

_REFUSED: dict[str, str] = {}
#: Mega-MoE kernels moewire refuses inside a quantized forward -> why (from the builds).
UNSUPPORTED_KERNELS: Mapping[str, str] = MappingProxyType(_REFUSED)


def rows_kind(layout: KernelLayout) -> str:
    """What a kernel's combine rows are, hence what a combine amax calibrated on them
    describes: ``"unweighted"`` (``nvfp4_mega_moe``: expert outputs before the router
    weight) or ``"weighted"`` (``fp8_fp4_mega_moe``, ``bf16_mega_moe``: router weight
    applied before L2). Amaxes of the two kinds are not interchangeable."""
    return "unweighted" if layout.weighted else "weighted"


def _never(namespace: Any) -> bool:
    return False


@dataclass(frozen=True)
class Flavour:
    """One DeepGEMM build: its Mega-MoE kernel functions and their combine layouts.

    Attributes:
        name: registry name (``"vllm-0.33"``).
        kernels: kernel function name (``"fp8_fp4_mega_moe"``) -> :class:`KernelLayout`.
        recognise: ``deep_gemm module -> bool``, true when an imported module is this build
            (:func:`detect` requires exactly one flavour to say so).
        description: one line for errors and docs.
        recognition: the structural facts behind ``recognise`` (for the error listing what
            was looked for), or ``None``.
        staging_casts: DeepGEMM casts a forward may stage with on this build.
        refused: kernel functions refused inside a quantized forward -> why.
    """

    name: str
    kernels: Mapping[str, KernelLayout]
    recognise: Callable[[Any], bool] = field(default=_never, compare=False)
    description: str = ""
    recognition: Recognition | None = None
    staging_casts: tuple[str, ...] = ()
    refused: Mapping[str, str] = field(default_factory=dict)

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
        object.__setattr__(self, "refused", MappingProxyType(dict(self.refused)))

    @classmethod
    def from_build(cls, build: Build) -> Flavour:
        """The flavour of a :class:`~moewire.megamoe.builds.Build` entry: recognised by its
        facts (a stand-in module that names its own build by ``moewire_flavour()`` is
        recognised by that name)."""

        def recognise(namespace: Any) -> bool:
            own = _own_flavour(namespace)
            return own == build.name if own is not None else build.recognition.matches(namespace)

        return cls(build.name, build.kernels, recognise, build.description, build.recognition,
                   build.staging_casts, build.refused)

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
    _REFUSED.update(flavour.refused)
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


def staging_casts() -> frozenset[str]:
    """Every DeepGEMM staging cast some registered flavour names (hooked on the module)."""
    return frozenset(cast for flav in _REGISTRY.values() for cast in flav.staging_casts)


def hooked_names() -> frozenset[str]:
    """Every name the wrapper hooks on a DeepGEMM module object: kernels, refused kernels
    and staging casts."""
    return kernel_functions() | frozenset(_REFUSED) | staging_casts()


def detect(namespace: Any, where: str = "moewire") -> Flavour:
    """The flavour of an imported DeepGEMM module (``MOEWIRE_FLAVOUR`` overrides).

    Facts read: those of each registered flavour's recognition (which functions the module
    has, which parameters they take). Exactly one flavour must recognise the module: the
    order of the registry decides nothing, and a module two builds' facts fit is refused
    (their combine layouts differ). The layout check confirms the choice on the first
    routed batch.

    Args:
        namespace: the ``deep_gemm`` module object the model calls (or a stand-in that
            says its flavour itself, ``moewire_flavour()``).
        where: the caller, for errors (a layer name).

    Raises:
        ValueError: ``MOEWIRE_FLAVOUR`` names no flavour.
        RuntimeError: no flavour recognises the module (the message lists the facts
            looked for), or more than one does (the message names them).
    """
    override = os.environ.get(ENV_FLAVOUR, "").strip()
    if override:
        try:
            return get(override)
        except ValueError as exc:
            raise ValueError(f"{where}: environment variable {ENV_FLAVOUR}: {exc}") from None
    matches = [flav for flav in _REGISTRY.values() if flav.recognise(namespace)]
    if len(matches) == 1:
        return matches[0]
    module = getattr(namespace, "__name__", type(namespace).__name__)
    path = getattr(namespace, "__file__", None)
    if matches:
        found = "; ".join(
            f"{flav.name} ({flav.recognition.describe() if flav.recognition else 'its own'})"
            for flav in matches
        )
        raise RuntimeError(
            f"{where}: the DeepGEMM module {module!r} ({path or 'no file'}) has the facts of "
            f"{len(matches)} builds: {found}; they place or add the combine rows differently "
            f"and moewire will not guess. Set {ENV_FLAVOUR} to the build you run (the layout "
            "check then proves it), or make the builds' facts exclusive in "
            "moewire.megamoe.builds.BUILDS"
        )
    looked = "; ".join(
        f"{flav.recognition.describe()} ({flav.name}: {flav.description})"
        for flav in _REGISTRY.values()
        if flav.recognition is not None
    )
    raise RuntimeError(
        f"{where}: the DeepGEMM module {module!r} ({path or 'no file'}, version "
        f"{getattr(namespace, '__version__', 'unknown')}) is no build moewire knows: looked "
        f"for, in order: {looked}. Set {ENV_FLAVOUR} to one of {', '.join(names())} if you "
        "know the build (the layout check then proves it), or add a build to "
        "moewire.megamoe.builds.BUILDS"
    )


def _own_flavour(namespace: Any) -> str | None:
    """A stand-in module says which build it imitates (``moewire_flavour()``)."""
    own = getattr(namespace, "moewire_flavour", None)
    return own() if callable(own) else None


for _build in _builds.BUILDS:
    register(Flavour.from_build(_build))
del _build
