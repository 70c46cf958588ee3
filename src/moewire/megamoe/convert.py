"""Conversion: an experts module becomes a quantized one in place, ModelOpt style.

:func:`convert` swaps the module's class for a generated subclass ``Quant<Cls>`` (first in
its MRO the mixin :class:`~moewire.megamoe.quant_experts.QuantExperts`; module names and the
original state-dict keys are kept), installs its adapter's hooks
(:func:`~moewire.megamoe.hooks.install_proxies`), and gives it two quantizer submodules,
``dispatch_quantizer`` and ``combine_quantizer``, disabled by default.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeGuard

import torch
from torch import nn

from moewire import patches
from moewire.megamoe.hooks import install_proxies
from moewire.megamoe.quant_experts import (
    QUANTIZER_NAMES,
    STATE_KEYS,
    QuantExperts,
    original_class,
    set_module_name,
)
from moewire.megamoe.registry import adapter_for, registered_classes
from moewire.quantizer import WireQuantizer

__all__ = ["convert", "is_converted", "refuse_unconvert", "unconvert"]

# One generated class per experts class (the classes live as long as the process).
_QUANT_CLASSES: dict[type, type] = {}
# Every converted module alive: once the last one is unconverted, every patch is undone.
_CONVERTED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# Set on a module whose quantizers another framework attached (ModelOpt's class swap came
# first): moewire cannot undo that framework's conversion.
_FOREIGN = "_moewire_foreign_quantizers_"


def _reduce_quant(self: QuantExperts, protocol: Any) -> Any:
    # The generated class is not a module attribute, so pickle (torch.save(model)) cannot
    # find it by name: rebuild it from the original class on load instead.
    state = {k: v for k, v in self.__dict__.items() if k != "_moewire_adapter_"}
    return _rebuild_quant, (original_class(type(self)),), state


def _quant_class(cls: type) -> type:
    quant = _QUANT_CLASSES.get(cls)
    if quant is None:
        quant = type(
            f"Quant{cls.__name__}",
            (QuantExperts, cls),
            {
                "__module__": __name__,
                "__doc__": f"{cls.__name__} with wire quantizers.",
                "__reduce_ex__": _reduce_quant,
                "_moewire_original_class": cls,
            },
        )
        _QUANT_CLASSES[cls] = quant
    return quant


def _rebuild_quant(cls: type) -> nn.Module:
    """Unpickling: an empty ``Quant<cls>`` (pickle then restores its ``__dict__``), with
    the kernel hooks of ``cls``'s adapter installed in this process."""
    known = registered_classes()
    adapter = next((known[k] for k in cls.__mro__ if k in known), None)
    if adapter is None:
        raise TypeError(
            f"cannot load a quantized {cls.__qualname__}: the class has no experts adapter in "
            "this process; register it (moewire.megamoe.register_experts_class, or load "
            "moewire's vLLM plugin) before torch.load"
        )
    install_proxies(adapter)
    module: QuantExperts  # object.__new__ of a generated class: pickle restores the rest
    module = object.__new__(_quant_class(cls))
    _CONVERTED.add(module)
    return module


def _module_device(module: nn.Module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")


def is_converted(module: nn.Module) -> TypeGuard[QuantExperts]:
    """Whether ``module`` is a moewire-quantized experts module."""
    return isinstance(module, QuantExperts)


def convert(
    module: nn.Module,
    name: str | None = None,
    *,
    make_quantizer: Callable[[str, str, torch.device], nn.Module] | None = None,
    attach: Callable[[nn.Module, str, nn.Module], None] = setattr,
) -> nn.Module:
    """Convert an experts module in place (class swap); idempotent.

    Args:
        module: an instance of a class registered with ``register_experts_class``.
        name: the module's name in the model (``"layers.3.experts"``), used in errors.
        make_quantizer: ``make_quantizer(attr, label, device)`` builds the disabled quantizer
            of ``attr`` (``"dispatch_quantizer"``, ``"combine_quantizer"``); default a
            disabled :class:`~moewire.quantizer.WireQuantizer`. The ModelOpt path passes
            its ``WireTensorQuantizer`` here, so no quantizer is built and thrown away.
        attach: ``attach(module, attr, quantizer)`` puts it on the module (default
            ``setattr``; ModelOpt registers a temporary attribute).

    Returns:
        ``module``, now an instance of ``Quant<Cls>`` with disabled ``dispatch_quantizer``
        and ``combine_quantizer`` on the module's device.

    Raises:
        TypeError: the class has no experts adapter.
    """
    if is_converted(module):
        if name is not None:
            set_module_name(module, name)
        return module
    adapter = adapter_for(module)
    if adapter is None:
        raise TypeError(
            f"{name or type(module).__name__}: {type(module).__qualname__} is not a registered "
            "Mega-MoE experts class; register it with "
            "moewire.megamoe.register_experts_class(cls, ExpertsAdapter(...))"
        )
    install_proxies(adapter)
    device = _module_device(module)
    original = type(module).__name__
    module.__class__ = _quant_class(type(module))
    _CONVERTED.add(module)
    set_module_name(module, name or original)
    if attach is not setattr:
        module.__dict__[_FOREIGN] = True
    for attr in QUANTIZER_NAMES:
        label = f"{name or original}.{attr}"
        quantizer: nn.Module
        if make_quantizer is None:
            quantizer = WireQuantizer(enable=False, name=label).to(device)
        else:
            quantizer = make_quantizer(attr, label, device)
        attach(module, attr, quantizer)
    return module


def refuse_unconvert(module: nn.Module, name: str | None = None) -> None:
    """Raise unless :func:`unconvert` can undo ``module``'s conversion.

    Raises:
        TypeError: ``module`` is not converted, or another framework (ModelOpt's
            ``mtq.quantize``) converted it first and attached the quantizers.
    """
    label = name or type(module).__name__
    if not is_converted(module):
        raise TypeError(f"{label}: {type(module).__qualname__} is not converted by moewire")
    if module.__dict__.get(_FOREIGN):
        raise TypeError(
            f"{label}: ModelOpt converted this module before moewire (mtq.quantize), and "
            "moewire cannot undo ModelOpt's class swap; rebuild the model from its "
            "unquantized weights instead"
        )


def unconvert(module: nn.Module, name: str | None = None) -> nn.Module:
    """Undo :func:`convert` in place: the original class back, the two quantizers and
    moewire's bookkeeping gone. Once no converted module remains in the process, every
    patch moewire made (:mod:`moewire.patches`: the hooked globals, namespaces, module
    classes, vLLM's loader) is undone too.

    Args:
        module: a module converted by :func:`convert`.
        name: the module's name in the model, for errors.

    Returns:
        ``module``, an instance of its original class again.

    Raises:
        TypeError: ``module`` is not converted, or another framework (ModelOpt's
            ``mtq.quantize``) converted it first and attached the quantizers.
    """
    refuse_unconvert(module, name)
    for attr in QUANTIZER_NAMES:
        delattr(module, attr)
    for key in (*STATE_KEYS, _FOREIGN):
        module.__dict__.pop(key, None)
    module.__class__ = original_class(type(module))
    _CONVERTED.discard(module)
    if not _CONVERTED:
        patches.undo_all()
    return module
