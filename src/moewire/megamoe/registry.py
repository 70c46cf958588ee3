"""Experts adapters: how moewire hooks a Mega-MoE experts class without copying its forward.

An adapter says which module's globals the class's forward reads at call time (the
staging function and the DeepGEMM namespace), where ``hidden_states`` sits in the staging
call, and how to get the module's buffer, kernel flavour, fused-shared setting and EP
group. Register a class once with :func:`register_experts_class`; subclasses inherit the
adapter of their nearest registered base unless registered themselves.

The registry registers and imports no experts class. moewire's own experts modules on
DeepGEMM's API (the stand-in's and the real SM90 kernel's) have their adapters in
``moewire.megamoe.deepgemm_experts``, which the registry loads by name once it is defined
(:data:`BUILTIN`); each host registers its framework's classes the same way
(``moewire.integrations.vllm`` ...).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "BUILTIN",
    "ExpertsAdapter",
    "adapter_for",
    "register_experts_class",
    "registered_classes",
    "stage_fn_names",
    "unregister_experts_class",
]


@dataclass(frozen=True)
class ExpertsAdapter:
    """Where a Mega-MoE experts class's forward looks things up.

    Attributes:
        name: ``"reference"``, ``"vllm-0.32-deepseek_v4"``, ...
        forward_module: dotted name of the module whose globals the forward reads at call
            time.
        stage_fn: global name of the staging function there (vLLM's
            ``prepare_megamoe_inputs``), or a tuple of names when the forward picks one
            per kernel (vLLM 0.33/0.34 also call ``prepare_megamoe_nvfp4_inputs`` for
            ``nvfp4_mega_moe``); ``hidden_states`` sits at ``stage_hidden_arg`` in each.
            An empty tuple: the forward stages inline through DeepGEMM's cast, hooked on
            the DeepGEMM module object (vLLM main's SM90 and gpt-oss experts).
        stage_hidden_arg: position (int) or keyword (str) of ``hidden_states`` in the
            staging call.
        kernel_ns: global name of the DeepGEMM namespace there (``"deep_gemm"``).
        get_symm_buffer: ``module -> SymmBuffer``.
        flavour: ``module -> str``, the kernel build's flavour name
            (``moewire.megamoe.flavours``).
        fused_shared: ``module -> bool``, a shared expert is fused into the kernel.
        ep_group: ``module -> torch.distributed group or None`` (None: a single rank, no
            reduction of calibrated amaxes).
        dp_groups: ``module -> tuple of groups``: the ranks that hold the same experts with
            other batches (transformers' expert mesh: ``dp_replicate``, ``efsdp``), over which
            calibrated amaxes are max-reduced after the EP group; default none.
        runtime: ``() -> str``, the framework and version the class comes from (``"vLLM
            0.34.0"``), for errors.
        applies: ``module -> bool`` or ``None``: for an adapter registered on a class that
            is not the experts class itself (vLLM main's MoE layer holding a modular
            experts object), whether this instance is one; ``None``: every instance.
        forward_dispatch: ``module -> int | str | None`` or ``None``: for a forward that
            stages some calls with a plain copy no hook sees (vLLM main's BF16 Mega-MoE),
            the position or name of its tokens' argument when this call does so (the
            forward's argument is then the staging hook), else ``None``; it raises where
            the argument is not proven to feed only the copy.
        refusal: why moewire refuses to quantize this class at all (recognised, but its
            kernel keeps no combine rows moewire can read), or ``None``.
    """

    name: str
    forward_module: str
    stage_fn: str | tuple[str, ...]
    stage_hidden_arg: int | str
    kernel_ns: str
    get_symm_buffer: Callable[[nn.Module], Any]
    flavour: Callable[[nn.Module], str]
    fused_shared: Callable[[nn.Module], bool]
    ep_group: Callable[[nn.Module], Any]
    runtime: Callable[[], str] = lambda: "no framework"
    dp_groups: Callable[[nn.Module], tuple[Any, ...]] = lambda m: ()
    applies: Callable[[nn.Module], bool] | None = None
    forward_dispatch: Callable[[nn.Module], int | str | None] | None = None
    refusal: str | None = None


# Adapters by class. Several adapters on one class each say which instances are theirs
# (``applies``): vLLM main's MoE layer holds gpt-oss's modular experts or ModelOpt's NVFP4
# Mega-MoE quant method.
_ADAPTERS: dict[type, tuple[ExpertsAdapter, ...]] = {}
#: The modules that register moewire's own experts classes when imported; the registry
#: loads them by name once it is defined (they import it, so it cannot import them).
BUILTIN = ("moewire.megamoe.deepgemm_experts",)


def register_experts_class(cls: type, adapter: ExpertsAdapter) -> None:
    """Register ``adapter`` for ``cls`` (and its subclasses without their own adapter).

    Registering a class again replaces its adapter: integrations re-register when a
    plugin is loaded twice, and tests register variants. Adapters that each have an
    ``applies`` predicate share the class (one per name); the first that applies to a
    module wins.

    Raises:
        TypeError: ``cls`` is not an ``nn.Module`` subclass or ``adapter`` not an
            :class:`ExpertsAdapter`.
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_experts_class: cls must be an nn.Module subclass, got {cls!r}")
    if not isinstance(adapter, ExpertsAdapter):
        raise TypeError(
            f"register_experts_class: adapter must be an ExpertsAdapter, got "
            f"{type(adapter).__name__}"
        )
    if getattr(cls, "_moewire_quant_class", False):
        raise TypeError(
            f"register_experts_class: {cls.__name__} is a class moewire generated; register "
            "the original experts class"
        )
    kept: tuple[ExpertsAdapter, ...] = ()
    if adapter.applies is not None:
        kept = tuple(a for a in _ADAPTERS.get(cls, ())
                     if a.applies is not None and a.name != adapter.name)
    _ADAPTERS[cls] = (*kept, adapter)


def unregister_experts_class(cls: type) -> None:
    """Remove ``cls``'s own adapters (a no-op when it has none): an integration that
    registers classes on demand undoes it with this."""
    _ADAPTERS.pop(cls, None)


def adapter_for(module: nn.Module) -> ExpertsAdapter | None:
    """The adapter of ``module``'s class or its nearest registered base, else ``None``."""
    for klass in type(module).__mro__:
        for adapter in _ADAPTERS.get(klass, ()):
            if adapter.applies is None or adapter.applies(module):
                return adapter
    return None


def stage_fn_names(adapter: ExpertsAdapter) -> tuple[str, ...]:
    """The adapter's staging global names, as a tuple."""
    names = adapter.stage_fn
    return (names,) if isinstance(names, str) else tuple(names)


def registered_classes() -> dict[type, ExpertsAdapter]:
    """A copy of the registry: class -> its adapter (the last registered, where several
    share the class)."""
    return {cls: adapters[-1] for cls, adapters in _ADAPTERS.items()}


# moewire's own experts classes have their adapters as soon as the registry exists, as every
# lookup (and every test's snapshot of the registry) expects.
for _name in BUILTIN:
    importlib.import_module(_name)
