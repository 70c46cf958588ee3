"""ModelOpt interop: moewire's dispatch/combine quantizers inside ``mtq.quantize``.

ModelOpt users configure quantizers by wildcard on their names, calibrate with
``mtq.quantize(model, cfg, forward_loop)``, read ``mtq.print_quant_summary(model)`` and save
``mto.modelopt_state(model)`` with the ``state_dict``. This module makes the Mega-MoE experts
modules part of that workflow (ModelOpt PR #2767, on top of #2660):

- :func:`register` puts every experts class known to ``moewire.megamoe.registry`` (the
  stand-in, and vLLM's classes when vLLM is importable) into ModelOpt's
  ``QuantModuleRegistry``. ``mtq.quantize`` then converts each experts module (class swap),
  hands it to moewire's wrapper, and gives it two :class:`WireTensorQuantizer` children,
  ``dispatch_quantizer`` and ``combine_quantizer`` (disabled until a cfg entry names them):
  real ``TensorQuantizer`` objects, so the wildcards ``*dispatch_quantizer`` /
  ``*combine_quantizer`` match them, ``algorithm: max`` calibrates them (max over valid
  rows, then over the EP group), the summary lists them and ``modelopt_state`` saves them.
- The math: ``fp8`` per tensor (``num_bits=(4, 3)``) and ``nvfp4`` (``num_bits=(2, 1)``,
  ``block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}``), which moewire
  implements bit-exactly with ModelOpt 0.47 (:data:`BIT_EXACT`), fake-quantize with
  moewire's format and fused kernels, with the ``TensorQuantizer``'s amax. Every other
  attribute set (INT8, MX, per-channel...) uses ModelOpt's ``TensorQuantizer`` math;
  ``backend_extra_args={"math": "modelopt" | "moewire"}`` overrides the choice, and the
  registered quant backend :data:`BACKEND` gives any ``TensorQuantizer`` moewire's math.
- The quantizer and the backend live in :mod:`moewire.integrations.modelopt.quantizer`
  (re-exported here); this module holds the registration and the scales interchange.
- Scales interchange: :func:`to_modelopt_state` / :func:`from_modelopt_state` move amax
  values between moewire's quantizers and a ModelOpt-converted model (``mto.save`` /
  ``mto.restore`` and ``moewire.save_scales`` / ``load_scales`` work on both).

Nothing here is imported by ``import moewire``; importing this module without
``nvidia-modelopt`` installed raises an ``ImportError`` that says what to install.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch

# isort: off
# modelopt_quantizer first: without nvidia-modelopt it raises the ImportError that says
# what to install, before the plain imports of ModelOpt below.
from moewire.integrations.modelopt.quantizer import (
    BACKEND,
    BIT_EXACT,
    WireTensorQuantizer,
    format_name,
)
from modelopt.torch.quantization.config import QuantizerAttributeConfig
from modelopt.torch.quantization.nn import QuantModule, QuantModuleRegistry
from modelopt.torch.quantization.plugins import custom as _mo_plugins
from modelopt.torch.utils.distributed import ParallelState

# isort: on
from moewire.formats.base import amax_is_valid
from moewire.integrations._host import register_host_classes
from moewire.megamoe.quant_experts import QUANTIZER_NAMES
from moewire.quantizer import WireQuantizer
from moewire.quantizer.contract import WireQuantizerLike

__all__ = [
    "BACKEND",
    "BIT_EXACT",
    "WireTensorQuantizer",
    "format_name",
    "from_modelopt_state",
    "register",
    "registered_classes",
    "to_modelopt_state",
]

# -- the experts classes in ModelOpt's QuantModuleRegistry -----------------------------


class _QuantMegaMoEExperts(QuantModule):
    """ModelOpt's quantized counterpart of every registered Mega-MoE experts class.

    ModelOpt's registry builds ``Quant<Cls>(_QuantMegaMoEExperts, QuantModule, Cls)`` and
    swaps the module's class to it; :meth:`_setup` then hands the module to moewire's
    wrapper (``moewire.megamoe.convert.convert``: call-time proxies, layout check, combine
    re-sum; a second class swap, to the wrapper's ``Quant<...>`` subclass), which attaches
    ModelOpt quantizers (``make_quantizer``/``attach``) instead of its own.
    """

    def _setup(self) -> None:
        from moewire.megamoe.convert import convert
        from moewire.megamoe.registry import adapter_for

        # TensorQuantizers in place of the wrapper's own: ModelOpt's cfg wildcards,
        # calibration, summary and state only see those. Registered as ModelOpt's
        # temporary attributes, built once.
        convert(
            self,
            make_quantizer=lambda attr, label, device: WireTensorQuantizer(
                QuantizerAttributeConfig(enable=False)
            ).to(_device_of(self)),
            attach=lambda module, attr, quantizer: module._register_temp_attribute(
                attr, quantizer
            ),
        )
        group = adapter_for(self).ep_group(self)
        # No DP group of its own: an EP group of a Mega-MoE layer spans the DP x TP ranks
        # that hold its experts, and the world group would mix pipeline stages.
        self.parallel_state = ParallelState(
            data_parallel_group=-1, expert_model_parallel_group=-1 if group is None else group
        )


def _device_of(module: torch.nn.Module) -> torch.device:
    for tensor in module.state_dict().values():
        if isinstance(tensor, torch.Tensor):
            return tensor.device
    return torch.device("cpu")


_REGISTERED: dict[type, str] = {}


def _key(cls: type) -> str:
    return f"moewire:{cls.__module__}.{cls.__qualname__}"


def _register_classes(classes: list[type]) -> None:
    from moewire.megamoe.registry import registered_classes as moewire_classes

    adapters = moewire_classes()
    for cls in classes:
        if cls in _REGISTERED or getattr(cls, "_moewire_quant_class", False):
            continue
        if getattr(adapters.get(cls), "applies", None) is not None:
            # Registered with moewire for some of its instances only (vLLM main's MoE layer
            # holding gpt-oss's modular experts); ModelOpt converts every instance of a
            # class, so such a class is left to moewire.quantize.
            continue
        key = _key(cls)
        # ModelOpt asserts on a second registration of a class; one it registers itself
        # (PR #2767 registers vLLM's Mega-MoE classes) is refused here with what to do.
        existing = QuantModuleRegistry._key_registry.get(cls)  # this exact class
        if existing is not None and existing != key:
            raise RuntimeError(
                f"moewire.integrations.modelopt.register: ModelOpt already registers "
                f"{cls.__module__}.{cls.__qualname__} (key {existing!r}), so it quantizes "
                "this class its own way "
                "and moewire cannot add its quantizers to it. Use ModelOpt's own Mega-MoE "
                "support for it, or call QuantModuleRegistry.unregister(cls) before "
                "moewire.integrations.modelopt.register()"
            )
        if key not in QuantModuleRegistry:
            QuantModuleRegistry.register({cls: key})(_QuantMegaMoEExperts)
        _REGISTERED[cls] = key


def _register_model_classes(model: torch.nn.Module) -> None:
    """ModelOpt model plugin (runs before conversion): classes registered with moewire
    after :func:`register` was called are picked up from the model itself."""
    from moewire.megamoe.registry import adapter_for

    _register_classes(
        [type(m) for m in model.modules()
         if adapter_for(m) is not None and not isinstance(m, QuantModule)]
    )


def _name_converted_modules(model: torch.nn.Module) -> None:
    """ModelOpt post-conversion plugin: the wrapper's errors name the module's path."""
    from moewire.megamoe.convert import convert

    for name, module in model.named_modules():
        if isinstance(module, _QuantMegaMoEExperts):
            convert(module, name or type(module).__name__)


def register(vllm: bool | None = None) -> list[type]:
    """Register the Mega-MoE experts classes in ModelOpt's ``QuantModuleRegistry``.

    Every class of ``moewire.megamoe.registry.registered_classes()`` is registered (key
    ``"moewire:<module>.<qualname>"``); with ``vllm`` (default: when vLLM imports),
    vLLM's Mega-MoE classes are registered with moewire first. Also installs two ModelOpt
    plug-ins: one that registers, at ``mtq.quantize`` time, experts classes registered with
    moewire later, and one that gives the converted modules their paths for error messages.
    Idempotent.

    Args:
        vllm: register vLLM's classes (``True``), skip them (``False``) or only when
            ``import vllm`` works (``None``).

    Returns:
        The classes registered with ModelOpt by moewire (this call and earlier ones).

    Raises:
        RuntimeError: ``vllm=True`` and the installed vLLM has no Mega-MoE class with the
            structure moewire hooks (``moewire.integrations.vllm.experts_sites`` says what it
            looked for; with ``vllm=None`` this is a warning), or ModelOpt already registers
            one of the classes itself (the message says what to do).
    """
    import importlib.util

    from moewire.megamoe.registry import registered_classes as moewire_classes

    optional = vllm is None
    if optional:
        vllm = importlib.util.find_spec("vllm") is not None
    if vllm:
        try:
            register_host_classes("vllm")
        except RuntimeError as exc:
            if not optional:
                raise
            # vLLM is installed but has no Mega-MoE class moewire recognises: register
            # the rest; say why vLLM's classes are not among them.
            warnings.warn(f"moewire.integrations.modelopt.register: {exc}", stacklevel=2)
    _register_classes(list(moewire_classes()))
    _mo_plugins.CUSTOM_MODEL_PLUGINS.add(_register_model_classes)
    _mo_plugins.CUSTOM_POST_CONVERSION_PLUGINS.add(_name_converted_modules)
    return registered_classes()


def registered_classes() -> list[type]:
    """The experts classes moewire registered with ModelOpt, in registration order."""
    return list(_REGISTERED)


# -- scales interchange ----------------------------------------------------------------

_QUANTIZER_ATTRS = QUANTIZER_NAMES
_AMAX_SUFFIX = "._amax"


def _comm_quantizers(model: torch.nn.Module) -> Iterator[tuple[str, WireQuantizerLike]]:
    """``(path, quantizer)`` for every dispatch/combine quantizer of a Mega-MoE experts
    module (moewire- or ModelOpt-converted); ``path`` is the quantizer's module path.

    Raises:
        TypeError: a quantizer slot holds neither contract class.
    """
    from moewire.megamoe.registry import adapter_for

    for name, module in model.named_modules():
        if adapter_for(module) is None:
            continue
        for attr in _QUANTIZER_ATTRS:
            quantizer = getattr(module, attr, None)
            if quantizer is None:
                continue
            path = f"{name}.{attr}" if name else attr
            if not isinstance(quantizer, (WireQuantizer, WireTensorQuantizer)):
                raise TypeError(
                    f"{path}: is a {type(quantizer).__name__}, neither moewire's WireQuantizer "
                    "nor a WireTensorQuantizer; convert the experts with moewire.quantize or "
                    "mtq.quantize"
                )
            yield path, quantizer


def to_modelopt_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The fixed amax of every dispatch/combine quantizer, keyed as ModelOpt's ``state_dict``.

    Args:
        model: a model whose Mega-MoE experts were converted by ``moewire.quantize`` or by
            ``mtq.quantize`` (after :func:`register`).

    Returns:
        ``{"<experts path>.dispatch_quantizer._amax": FP32 [] (CPU), ...}`` for each
        quantizer with a calibrated, constant or loaded amax (others are left out). The
        keys are those of a ModelOpt-converted model's ``state_dict``, so the dict loads
        with :func:`from_modelopt_state` into either kind of model.
    """
    state: dict[str, torch.Tensor] = {}
    for path, quantizer in _comm_quantizers(model):
        amax = quantizer.static_amax
        if amax is not None:
            state[path + _AMAX_SUFFIX] = amax.detach().float().reshape(()).cpu().clone()
    return state


def from_modelopt_state(
    model: torch.nn.Module, state_dict: dict[str, Any], *, strict: bool = True
) -> list[str]:
    """Load dispatch/combine amax values saved by ModelOpt into ``model``'s quantizers.

    Args:
        model: a model whose Mega-MoE experts were converted by ``moewire.quantize`` or by
            ``mtq.quantize``.
        state_dict: a ModelOpt-converted model's ``state_dict()``, an ``mto.save``
            checkpoint (``{"model_state_dict": ...}``) or :func:`to_modelopt_state`'s dict.
            Only keys ``*.dispatch_quantizer._amax`` / ``*.combine_quantizer._amax`` are
            read; every other key is ignored.
        strict: refuse a saved amax without a quantizer in ``model``, and an enabled
            quantizer of ``model`` without a saved amax.

    Returns:
        The quantizer paths whose amax was set, sorted.

    Raises:
        KeyError: (strict) the two sets of names differ; the message lists them.
        ValueError: a saved amax is not a single finite value >= 0.
    """
    state_dict = state_dict.get("model_state_dict", state_dict)
    saved = {
        key.removesuffix(_AMAX_SUFFIX): value
        for key, value in state_dict.items()
        if key.endswith(_AMAX_SUFFIX) and key.removesuffix(_AMAX_SUFFIX).endswith(_QUANTIZER_ATTRS)
    }
    quantizers = dict(_comm_quantizers(model))
    if strict:
        unknown = sorted(saved.keys() - quantizers.keys())
        missing = sorted(
            path for path, q in quantizers.items()
            if path not in saved and q.mode != "disabled"
        )
        if unknown or missing:
            raise KeyError(
                "from_modelopt_state: the saved scales and the model's quantizers differ; "
                f"saved without a quantizer: {unknown}; enabled quantizers without a saved "
                f"amax: {missing}. Convert the model with the same recipe/cfg and module "
                "names, or pass strict=False"
            )
    loaded = []
    for path in sorted(saved.keys() & quantizers.keys()):
        amax = torch.as_tensor(saved[path])
        if amax.numel() != 1 or not amax_is_valid(float(amax)):
            raise ValueError(
                f"{path}: the saved amax must be one finite value >= 0, got "
                f"{amax.flatten()[:4].tolist()} (shape {tuple(amax.shape)})"
            )
        quantizers[path].load_amax(amax)
        loaded.append(path)
    return loaded
