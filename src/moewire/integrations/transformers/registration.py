"""``"moewire"`` in transformers' registries: :func:`register` adds the experts implementation
(``ExpertsInterface``), the EP implementation (:mod:`.ep`), an experts adapter per family of
:data:`~.architectures.ARCHITECTURES` and the sites of transformers' own Mega-MoE
(:mod:`.megamoe`); :func:`unregister` undoes it.

May import: the standard library, torch, ``moewire.megamoe.registry``,
``moewire.integrations.deepgemm_sm90`` and this package's modules below it.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from moewire.integrations import deepgemm_sm90 as sm90
from moewire.integrations.transformers import ep, forward, megamoe
from moewire.integrations.transformers.architectures import ARCHITECTURES, Architecture
from moewire.integrations.transformers.forward import moewire_experts_forward
from moewire.integrations.transformers.state import _state
from moewire.megamoe.registry import (
    ExpertsAdapter,
    register_experts_class,
    unregister_experts_class,
)

__all__ = ["IMPLEMENTATION", "experts_modules", "register", "unregister"]

IMPLEMENTATION = "moewire"


def _uses_moewire(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return getattr(config, "_experts_implementation", None) == IMPLEMENTATION


def _adapter(arch: Architecture) -> ExpertsAdapter:
    import transformers

    return ExpertsAdapter(
        name=f"transformers-{arch.model_type}",
        forward_module=forward.__name__,
        stage_fn=("stage_mega_moe_inputs", "stage_sm90_inputs", "stage_fp4_fp4_inputs"),
        stage_hidden_arg=0,
        kernel_ns="deep_gemm",
        get_symm_buffer=sm90.symm_buffer_of(lambda m: _state(m).buffer),
        flavour=lambda m: _state(m).flavour,
        fused_shared=lambda m: False,
        ep_group=lambda m: _state(m).group,
        dp_groups=lambda m: m.__dict__.get(megamoe.GROUPS, (None, ()))[1],
        runtime=lambda: f"transformers {transformers.__version__}",
        applies=_uses_moewire,
    )


def _experts_classes() -> Iterator[tuple[Architecture, type]]:
    import importlib

    for arch in ARCHITECTURES:
        if arch.refused:
            continue
        try:
            module = importlib.import_module(arch.module)
        except ImportError:
            continue
        cls = getattr(module, arch.experts_class, None)
        if isinstance(cls, type):
            yield arch, cls


def register() -> None:
    """Register ``"moewire"`` in transformers' ``ExpertsInterface`` and
    ``EPImplementationInterface`` (:mod:`.ep`), an experts adapter for every family in
    :data:`ARCHITECTURES`, and the sites of transformers' own Mega-MoE (:mod:`.megamoe`)
    (idempotent; :func:`unregister` undoes it)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, moewire_experts_forward)
    for arch, cls in _experts_classes():
        register_experts_class(cls, _adapter(arch))
    ep.register()
    megamoe.register()


def unregister() -> None:
    """Undo :func:`register` (and the stand-in opt-in of ``prepare(kernel="stand-in")`` for
    transformers' own Mega-MoE)."""
    from transformers.integrations.moe import ExpertsInterface

    megamoe.unregister()
    ep.unregister()
    ExpertsInterface._global_mapping.pop(IMPLEMENTATION, None)
    for _, cls in _experts_classes():
        unregister_experts_class(cls)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every experts module of ``model`` that runs ``"moewire"``."""
    return [(n, m) for n, m in model.named_modules()
            if _uses_moewire(m) and hasattr(m, "gate_up_proj")]
