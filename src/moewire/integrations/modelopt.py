"""ModelOpt interop: moewire's dispatch/combine quantizers inside ``mtq.quantize``.

ModelOpt users configure quantizers by wildcard on their names, calibrate with
``mtq.quantize(model, cfg, forward_loop)``, read ``mtq.print_quant_summary(model)`` and save
``mto.modelopt_state(model)`` with the ``state_dict``. This module makes the Mega-MoE experts
modules part of that workflow (SPEC section 3):

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
- Scales interchange: :func:`to_modelopt_state` / :func:`from_modelopt_state` move amax
  values between moewire's quantizers and a ModelOpt-converted model (``mto.save`` /
  ``mto.restore`` and ``moewire.save_scales`` / ``load_scales`` work on both).

Nothing here is imported by ``import moewire``; importing this module without
``nvidia-modelopt`` installed raises an ``ImportError`` that says what to install.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

try:
    from modelopt.torch.quantization.calib import MaxCalibrator
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import QuantModule, QuantModuleRegistry, TensorQuantizer
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import (
        is_registered_quant_backend,
        register_quant_backend,
    )
    from modelopt.torch.quantization.plugins import custom as _mo_plugins
    from modelopt.torch.utils.distributed import ParallelState
except ImportError as err:  # pragma: no cover - exercised only without modelopt
    raise ImportError(
        "moewire.integrations.modelopt needs nvidia-modelopt: "
        "pip install nvidia-modelopt==0.47.0 requests huggingface_hub "
        "(0.47.0 imports the last two without declaring them)"
    ) from err

from moewire import formats
from moewire.config import USE_CONSTANT_AMAX, CfgError, parse_cfg
from moewire.formats.base import amax_is_valid
from moewire.megamoe.quant_experts import QUANTIZER_NAMES
from moewire.quantizer import WireQuantizer, WireQuantizerLike, calibration, max_all_reduce

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

#: Name of the ModelOpt quant backend moewire registers: ``{"backend": "moewire"}`` in a
#: quantizer cfg forces moewire's math on any ``TensorQuantizer`` of the model.
BACKEND = "moewire"

#: The formats whose moewire reference equals ModelOpt 0.47's fake quant bit for bit
#: (tests/modelopt/test_format_parity.py): moewire's math is the default for these only.
BIT_EXACT = ("fp8", "nvfp4")

_MATH_KEY = "math"
_MATHS = ("moewire", "modelopt")


def format_name(quantizer: TensorQuantizer) -> str | None:
    """The moewire format a ``TensorQuantizer``'s attributes spell, or ``None``.

    The spelling is moewire's own (``moewire.config.parse_cfg``: ``num_bits``,
    ``block_sizes``, ``axis``), so the same cfg entry names the same format in ``mtq.quantize``
    and in ``moewire.quantize``. Integer, unsigned, per-channel and top-level dynamic
    quantizers return ``None``.
    """
    if quantizer._dynamic or quantizer._unsigned:
        return None
    cfg = {
        "num_bits": quantizer._num_bits,
        "block_sizes": quantizer._block_sizes,
        "axis": quantizer._axis,
    }
    try:
        return parse_cfg(cfg).fmt
    except CfgError:
        return None


def _math_of(quantizer: TensorQuantizer, where: str) -> str:
    """``"moewire"`` or ``"modelopt"``: who fake-quantizes for this quantizer."""
    asked = (quantizer.backend_extra_args or {}).get(_MATH_KEY)
    if quantizer.backend == BACKEND:
        asked = "moewire"
    if asked is not None and asked not in _MATHS:
        raise ValueError(
            f"{where}: backend_extra_args['{_MATH_KEY}'] is {asked!r}; use 'moewire' "
            "(moewire's bit-exact formats and kernels) or 'modelopt' (TensorQuantizer's math)"
        )
    mapped = format_name(quantizer)
    if asked is None:
        return "moewire" if mapped in BIT_EXACT else "modelopt"
    if asked == "moewire" and mapped is None:
        raise ValueError(
            f"{where}: moewire's math was asked for, but the quantizer attributes "
            f"(num_bits={quantizer._num_bits}, block_sizes={quantizer._block_sizes}, "
            f"axis={quantizer._axis}) name no moewire format (the table is in "
            "moewire.config.parse_cfg); drop the request to use ModelOpt's math"
        )
    return asked


def _static_amax(quantizer: TensorQuantizer) -> torch.Tensor | None:
    """The fixed amax of a quantizer as FP32 ``[]`` on its device, or ``None``."""
    amax = getattr(quantizer, "_amax", None)
    if amax is None or quantizer._dynamic or amax.numel() != 1:
        return None
    return amax.detach().reshape(()).float()


def _moewire_qdq(inputs: torch.Tensor, quantizer: TensorQuantizer) -> torch.Tensor:
    """Fake quant with moewire's format and the quantizer's amax (the registered backend)."""
    _math_of(quantizer, f"ModelOpt backend {BACKEND!r}")  # refuses what moewire lacks
    amax = _static_amax(quantizer)
    if amax is None:
        # ModelOpt semantics for an uncalibrated per-tensor quantizer: the amax of this call.
        amax = inputs.detach().abs().amax().float()
    return formats.get(format_name(quantizer)).qdq(inputs, amax.to(inputs.device))


class WireTensorQuantizer(TensorQuantizer):
    """A ``TensorQuantizer`` that moewire's Mega-MoE wrapper can drive.

    It is a plain ModelOpt quantizer for everything ModelOpt does (cfg, calibration,
    summary, state); on top it implements the quantizer contract
    (``moewire.quantizer.WireQuantizerLike``) that ``moewire.quantizer.WireQuantizer``
    implements too, so the wrapper, ``moewire.calibrate`` and ``moewire.save_scales`` drive
    either. ``use_constant_amax`` (ModelOpt's KV-cache switch) pins the amax to 448.0, as
    ``constant_amax: 448.0`` does.

    Forward (``x``: BF16/FP16/FP32, any shape; returns ``x.dtype``, same shape): ModelOpt's
    ``TensorQuantizer.forward`` (disable, calibrate then pass through, quantize), where the
    fake quant itself is ``moewire.formats.get(fmt).qdq(x, amax)`` when :attr:`math` is
    ``"moewire"``, else ModelOpt's.
    """

    def set_from_attribute_config(self, attribute_cfg: Any) -> None:
        super().set_from_attribute_config(attribute_cfg)
        if self._use_constant_amax:
            # ModelOpt's math reads 448 for this switch without a buffer; moewire's reads the
            # amax buffer (it follows .to() and CUDA graphs), so pin it there, as
            # constant_amax does.
            self.amax = USE_CONSTANT_AMAX

    @property
    def math(self) -> str:
        """``"moewire"`` or ``"modelopt"`` (see the module docstring)."""
        return _math_of(self, type(self).__name__)

    @property
    def fmt(self) -> formats.WireFormat | None:
        """moewire's format when moewire's math runs this quantizer, else ``None``."""
        if self.math != "moewire":
            return None
        return formats.get(format_name(self))

    @property
    def mode(self) -> str:
        """``"disabled"``, ``"calibrate"`` (collect, pass through) or ``"quantize"``."""
        if self._disabled:
            return "disabled"
        if self._if_calib and not self._dynamic:
            return "calibrate"
        if self._if_quant:
            return "quantize"
        # ModelOpt turns quantization off for constant-amax quantizers while calibrating.
        return "disabled"

    @property
    def static_amax(self) -> torch.Tensor | None:
        """The fixed amax (calibrated, constant or loaded), FP32 ``[]``, or ``None``."""
        return _static_amax(self)

    @property
    def has_amax(self) -> bool:
        """Whether an amax is fixed (``static_amax is not None``)."""
        return self.static_amax is not None

    @property
    def constant_amax(self) -> float | None:
        """ModelOpt's ``constant_amax``, 448.0 for ``use_constant_amax``, else ``None``."""
        if self._use_constant_amax:
            return USE_CONSTANT_AMAX
        return None if self._constant_amax is None else float(self._constant_amax)

    @property
    def amax_source(self) -> str | None:
        """``"constant"`` for a pinned amax, else ``None``: ModelOpt does not record
        whether an amax was calibrated or loaded."""
        return "constant" if self.constant_amax is not None else None

    def is_static_scale(self) -> bool:
        """True when every scale of a row depends on the row alone (SPEC section 3).

        moewire's math: ``fmt.row_local and (not fmt.needs_amax or has_amax)``. ModelOpt's
        math: MX formats (per-32 block scales only), or any non-dynamic quantizer with a fixed
        amax; a per-call (dynamic) per-tensor amax is not.
        """
        fmt = self.fmt
        if fmt is not None:
            return fmt.row_local and (not fmt.needs_amax or self.has_amax)
        if self.is_mx_format:
            return True
        return not self._dynamic and self.has_amax

    def scale_amax(self, x: torch.Tensor) -> torch.Tensor | None:
        """The amax the scale of ``x`` uses: ``None`` for a format without a global amax,
        the fixed one, else ``max|x|`` of this call (ModelOpt's uncalibrated behaviour)."""
        fmt = self.fmt
        if fmt is not None and not fmt.needs_amax:
            return None
        amax = self.static_amax
        if amax is None:
            return x.detach().abs().amax().float()
        return amax.to(x.device)

    def load_amax(self, amax: torch.Tensor | float) -> None:
        """Fix the amax (FP32 ``[]``), as ``moewire.load_scales`` does for its quantizers."""
        value = torch.as_tensor(amax, dtype=torch.float32).detach().reshape(())
        if getattr(self, "_amax", None) is not None:
            # A BF16 buffer left by calibration on BF16 data would round an FP32 value.
            self._amax = self._amax.float()
        self.amax = value

    def _fake_quantize(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.backend is None and self.math == "moewire":
            return self.fmt.qdq(inputs, self.scale_amax(inputs))
        return super()._fake_quantize(inputs)

    # -- calibration: the steps of moewire.quantizer.calibration ------------------------

    def collect(self, inputs: torch.Tensor) -> None:
        if inputs.numel() == 0:
            # A rank whose batch routed no row has seen a max of 0 (moewire's calibration
            # records the same), and must still take part in the EP max-reduce: ModelOpt's
            # max_calibrate refuses a group where some ranks have an amax and others none.
            inputs = inputs.new_zeros(1)
        super().collect(inputs)

    @property
    def calibratable(self) -> bool:
        """Whether calibration sets the amax: not dynamic, no pinned amax (as ModelOpt)."""
        return not self._dynamic and self.constant_amax is None

    def begin_calibration(self) -> None:
        """Forget the calibrator's max, then collect with quantization off (ModelOpt's flags).

        Raises:
            RuntimeError: already calibrating (calibration does not nest).
        """
        if self.mode == "calibrate":
            raise RuntimeError(
                f"{type(self).__name__}: already calibrating; calibrating() does not nest"
            )
        self._calibrator.reset()
        self.disable_quant()
        self.enable_calib()

    def end_calibration(self) -> None:
        """Quantize again, stop collecting."""
        self.enable_quant()
        self.disable_calib()

    @contextlib.contextmanager
    def calibrating(self) -> Iterator[WireTensorQuantizer]:
        """Collect (values pass through) inside; load the max on exit
        (``moewire.quantizer.calibration`` for this quantizer alone)."""
        with calibration([(self, ())]):
            yield self

    def sync_amax(self, group: Any = None) -> None:
        """Max-all-reduce the calibrator's max and the fixed amax over a process group.

        Per tensor (a wire quantizer's amax): one collective per call whatever this rank
        holds (``moewire.quantizer.max_all_reduce``), so a rank that collected nothing
        neither hangs nor lowers the result, and gets the group's max. A per-channel amax
        (ModelOpt's math) is reduced in place, as ModelOpt's own sync does. No-op without
        an initialised group of > 1 ranks.
        """
        amax = getattr(self, "_amax", None)
        calib = (self._calibrator.compute_amax()
                 if isinstance(self._calibrator, MaxCalibrator) else None)
        present = [t for t in (calib, amax) if t is not None]
        if any(t.numel() != 1 for t in present):
            if torch.distributed.is_initialized():
                for t in present:
                    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
            return
        device = present[0].device if present else torch.device("cpu")
        zero = torch.zeros((), dtype=torch.float32, device=device)
        reduced = max_all_reduce(
            group, device, zero if amax is None else amax, zero + (amax is not None),
            zero if calib is None else calib, zero + (calib is not None),
        )
        if reduced is None:
            return
        amax_max, any_amax, calib_max, any_calib = reduced
        if any_calib:
            like = zero if calib is None else calib
            self._calibrator._calib_amax = torch.full_like(like, calib_max)
        if any_amax:
            self.amax = torch.full_like(zero if amax is None else amax, amax_max)

    def load_calib_amax(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        """Load the calibrator's max as the amax, FP32; ``None`` (amax kept) without data."""
        if not (args or kwargs) and self._calibrator.compute_amax() is None:
            return None
        super().load_calib_amax(*args, **kwargs)
        # The calibrator's max has the data's dtype (BF16); moewire keeps amax in FP32 (exact
        # for such a max), so kernels and CUDA graphs read the buffer itself, uncast.
        self._amax = self._amax.float()
        return self._amax


if not is_registered_quant_backend(BACKEND):
    register_quant_backend(BACKEND, _moewire_qdq)


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
        from moewire.integrations.vllm import register_vllm_experts

        try:
            register_vllm_experts()
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
