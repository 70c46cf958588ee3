"""The experts adapters of the Mega-MoE experts modules moewire ships on DeepGEMM's API:
the stand-in's and the real SM90 kernel's, in one place.

- The stand-in's three (``moewire.reference``): ``MegaMoEExperts`` (``"reference"``),
  ``NVFP4MegaMoEExperts`` (``"reference-nvfp4"``) and ``FP4MegaMoEExperts``
  (``"reference-fp4-fp4"``), registered when this module is imported (the registry loads it
  by name once it is defined, :data:`moewire.megamoe.registry.BUILTIN`). Their forward reads the
  staging function and ``deep_gemm`` from its own module; their build is the flavour the
  stand-in imitates now (read from the module as from any DeepGEMM), except the NVFP4 x NVFP4
  kernel's, which is DeepGEMM 2.8.0's alone.
- DeepGEMM's real SM90 kernels (DeepGEMM PR #323, ``moewire.integrations.deepgemm_sm90``):
  :func:`register_sm90_experts` for its ``SM90MegaMoEExperts`` and a user's own class, and
  :func:`symm_buffer_of`, the buffer accessor that refuses ``DG_COMM_KERNEL_DEBUG`` (also
  used by the transformers host for the same kernel build).

The adapters of a host's experts classes sit in the host's package.

May import: the standard library, torch, ``moewire.megamoe.registry``,
``moewire.megamoe.flavours`` and the stand-in's experts modules (``moewire.reference``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

from torch import nn

from moewire.megamoe.flavours import detect
from moewire.megamoe.registry import ExpertsAdapter, register_experts_class
from moewire.reference import deep_gemm, fp4_fp4
from moewire.reference._ep_experts import EPExperts
from moewire.reference.experts import MegaMoEExperts
from moewire.reference.fp4_fp4.experts import FP4MegaMoEExperts
from moewire.reference.nvfp4.experts import NVFP4MegaMoEExperts

__all__ = [
    "DEBUG_ENV",
    "SM90_FLAVOUR",
    "register_sm90_experts",
    "stand_in_adapter",
    "symm_buffer_of",
]

#: The flavour of DeepGEMM PR #323's SM90 build (``moewire.megamoe.flavours``).
SM90_FLAVOUR = "deepgemm-sm90"
#: DeepGEMM's debug switch that zeroes the buffer after every call.
DEBUG_ENV = "DG_COMM_KERNEL_DEBUG"


# -- the stand-in -----------------------------------------------------------------------------


def _stand_in(module: nn.Module) -> EPExperts:
    # This adapter is registered for the stand-in's experts classes only (EPExperts's).
    return cast(EPExperts, module)


def stand_in_adapter(name: str, forward_module: str, stage_fn: str,
                     **extra: Any) -> ExpertsAdapter:
    """The adapter of a stand-in experts class: its buffer, fused-shared setting and EP group
    are the module's own; its build is the flavour the stand-in imitates now unless
    ``extra`` says otherwise."""
    extra.setdefault(
        "flavour", lambda m: detect(deep_gemm, getattr(m, "_moewire_name_", "reference")).name
    )
    return ExpertsAdapter(
        name=name,
        forward_module=forward_module,
        stage_fn=stage_fn,
        stage_hidden_arg=0,
        kernel_ns="deep_gemm",
        get_symm_buffer=lambda m: _stand_in(m).get_symm_buffer(),
        fused_shared=lambda m: _stand_in(m).fused_shared,
        ep_group=lambda m: _stand_in(m).ep_group,
        **extra,
    )


register_experts_class(MegaMoEExperts, stand_in_adapter(
    "reference", MegaMoEExperts.__module__, "stage_mega_moe_inputs",
    runtime=lambda: "moewire's stand-in experts",
))
register_experts_class(NVFP4MegaMoEExperts, stand_in_adapter(
    "reference-nvfp4", NVFP4MegaMoEExperts.__module__, "prepare_megamoe_nvfp4_inputs",
))
register_experts_class(FP4MegaMoEExperts, stand_in_adapter(
    "reference-fp4-fp4", FP4MegaMoEExperts.__module__, "prepare_megamoe_nvfp4_inputs",
    # Its kernel is DeepGEMM 2.8.0's alone (moewire.reference.fp4_fp4).
    flavour=lambda m: fp4_fp4.FLAVOUR,
))


# -- DeepGEMM's SM90 kernels ------------------------------------------------------------------


def symm_buffer_of(get: Callable[[nn.Module], Any]) -> Callable[[nn.Module], Any]:
    """Wrap a ``module -> SymmBuffer`` accessor so that it refuses ``DG_COMM_KERNEL_DEBUG``.

    With ``DG_COMM_KERNEL_DEBUG`` set (not ``0``), DeepGEMM zeroes the whole buffer after
    every call: the combine rows are gone, and a re-sum would silently write zeros into
    ``y`` once the layout check has passed. moewire asks for the buffer before the kernel
    runs when the combine quantizer is on, so the refusal comes before the kernel (the
    call changes nothing). A dispatch-only module is unaffected (it never reads rows).
    """

    def symm_buffer(module: nn.Module) -> Any:
        value = os.environ.get(DEBUG_ENV, "").strip()
        combine = getattr(module, "combine_quantizer", None)
        if value not in ("", "0") and getattr(combine, "mode", "disabled") != "disabled":
            name = module.__dict__.get("_moewire_name_") or type(module).__name__
            raise RuntimeError(
                f"{name}: {DEBUG_ENV}={value} is set; DeepGEMM then zeroes the whole Mega-MoE "
                "buffer after every call, so the combine rows moewire re-sums are gone; unset "
                f"{DEBUG_ENV} or disable the combine quantizer"
            )
        return get(module)

    return symm_buffer


def _ep_group(symm_buffer: Any) -> Any:
    group = getattr(symm_buffer, "group", None)
    return group if group is not None and group.size() > 1 else None


def register_sm90_experts(
    cls: type,
    *,
    forward_module: str,
    get_symm_buffer: Callable[[nn.Module], Any],
    stage_fn: str = "stage_sm90_inputs",
    stage_hidden_arg: int | str = 0,
    kernel_ns: str = "deep_gemm",
    ep_group: Callable[[nn.Module], Any] | None = None,
) -> None:
    """Register a user's experts class that calls DeepGEMM's SM90 Mega-MoE kernels.

    Its forward must read two globals of ``forward_module`` at call time: the staging
    function ``stage_fn`` (``hidden_states`` at ``stage_hidden_arg``) and the namespace
    ``kernel_ns`` through which it calls ``fp8_mega_moe`` or ``fp8_fp4_mega_moe`` with
    ``y`` first. The flavour is ``deepgemm-sm90`` (no fused shared expert).

    Args:
        cls: the ``nn.Module`` subclass.
        forward_module: dotted name of the module holding the two globals.
        get_symm_buffer: ``module -> SymmBuffer``.
        stage_fn: global name of the staging function.
        stage_hidden_arg: position or keyword of ``hidden_states`` in the staging call.
        kernel_ns: global name of the DeepGEMM namespace.
        ep_group: ``module -> group or None``; default: the buffer's group when it has more
            than one rank.

    Raises:
        TypeError: ``cls`` is not an ``nn.Module`` subclass.
    """
    register_experts_class(
        cls,
        ExpertsAdapter(
            name=f"deepgemm-sm90:{cls.__qualname__}",
            forward_module=forward_module,
            stage_fn=stage_fn,
            stage_hidden_arg=stage_hidden_arg,
            kernel_ns=kernel_ns,
            get_symm_buffer=symm_buffer_of(get_symm_buffer),
            flavour=lambda m: SM90_FLAVOUR,
            fused_shared=lambda m: False,
            ep_group=ep_group or (lambda m: _ep_group(get_symm_buffer(m))),
        ),
    )
