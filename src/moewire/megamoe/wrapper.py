"""Dispatch and combine fake quantization around a Mega-MoE experts module.

:func:`convert` turns an experts module into a quantized one in place, ModelOpt style: its
class is swapped for a generated subclass ``Quant<Cls>`` (module names and the original
state-dict keys are kept) and it gains two :class:`~moewire.quantizer.WireQuantizer`
submodules, ``dispatch_quantizer`` and ``combine_quantizer``, disabled by default.

The experts' forward is never copied. Its class's adapter (``moewire.megamoe.registry``)
names two globals its forward reads at call time; moewire replaces them, once per forward
module, with proxies that pass everything through unless a quantized module's forward is
running (a context variable set by ``Quant<Cls>.forward``):

- the staging function: the ``hidden_states`` argument is replaced by
  ``dispatch_quantizer(hidden_states)``, out of place, so the router and an unfused shared
  expert (added after the kernel) see the original tokens;
- the DeepGEMM namespace: every kernel function some flavour describes
  (``flavours.kernel_functions()``) is wrapped; right after the kernel returns (before
  ``y += shared_experts(...)``) the combine rows are read from the buffer (at the place the
  flavour gives for that kernel), fake-quantized, re-summed in the kernel's order
  (:func:`~moewire.megamoe.resum.resum`) and written into ``y`` in place.

The DeepGEMM module object itself is hooked too (:class:`_HookedModule`): its kernel
functions, and its staging cast ``per_token_cast_to_fp8`` (also on ``deep_gemm.utils``),
whose first call on ``[T, hidden]`` tokens before the kernel call is the staging of a
forward that stages inline (:func:`_wrap_cast`).

Layout check: before the first use of a buffer's rows (buffers are shared by layers, so
once per buffer), the unquantized re-sum must equal ``y`` bit for bit over the tokens with a
routed row. An all-padding batch defers it. Eager: one host sync per call until checked,
none after. Under CUDA-graph capture of an unchecked buffer the comparison is recorded in
the graph as a device-side assert, evaluated on every replay.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import os
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moewire import kernels
from moewire.megamoe import flavours as _flavours
from moewire.megamoe.layout import combine_rows
from moewire.megamoe.registry import (
    ExpertsAdapter,
    adapter_for,
    registered_classes,
    stage_fn_names,
)
from moewire.megamoe.resum import resum
from moewire.quantizer import WireQuantizer

__all__ = [
    "FUSION_SWITCH",
    "QuantExperts",
    "amax_rows",
    "kernel_rows",
    "set_amax_rows",
    "convert",
    "install_proxies",
    "is_converted",
    "layout_checked",
    "reset_layout_checks",
    "set_module_name",
]

FUSION_SWITCH = "VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION=1"
QUANTIZER_NAMES = ("dispatch_quantizer", "combine_quantizer")

_ACTIVE: contextvars.ContextVar[QuantExperts | None] = contextvars.ContextVar(
    "moewire_active_experts", default=None
)
# The hooks the running quantized forward has reached ("staging", "kernel").
_REACHED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "moewire_reached_hooks", default=None
)


# DeepGEMM's staging casts: a forward that stages inline (vLLM main's DeepGemmMegaExperts,
# SPEC 2) quantizes hidden_states with one of these, looked up on the deep_gemm module
# object (`deep_gemm.utils.per_token_cast_to_fp8`, or its re-export at the top).
STAGING_CASTS = frozenset({"per_token_cast_to_fp8"})
# True while the adapter's staging function runs: it already got the quantized tokens, so
# a cast it makes through the module (the SM90 staging does) is not a staging of its own.
_IN_STAGING_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "moewire_in_staging_call", default=False
)
# Tokens a calibrating dispatch quantizer saw in a staging cast, collected at the kernel
# call (the ids that say which tokens are padding are staged after the cast).
_CAST_CALIBRATION: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar(
    "moewire_cast_calibration", default=None
)


def _reached(hook: str) -> None:
    reached = _REACHED.get()
    if reached is not None:
        reached.add(hook)


# -- proxies on the forward module's globals ------------------------------------------------


class _StagingProxy:
    """Stands in for the staging function; defers to the active quantized module, if any."""

    def __init__(self, fn: Callable) -> None:
        self._moewire_original = fn
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "staging")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = _ACTIVE.get()
        if module is None:
            return self._moewire_original(*args, **kwargs)
        _reached("staging")
        token = _IN_STAGING_CALL.set(True)
        try:
            return module._moewire_stage(self._moewire_original, args, kwargs)
        finally:
            _IN_STAGING_CALL.reset(token)

    def __repr__(self) -> str:
        return f"<moewire staging proxy of {self._moewire_original!r}>"


class _KernelNamespace:
    """Stands in for the DeepGEMM namespace; wraps the Mega-MoE kernels, passes the rest.

    Attribute writes and deletes go to the real namespace, so monkeypatching a kernel
    through the proxy patches the namespace itself.
    """

    def __init__(self, namespace: Any) -> None:
        object.__setattr__(self, "_moewire_namespace", namespace)
        object.__setattr__(self, "_moewire_wrapped", {})

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._moewire_namespace, name)
        if name in _flavours.UNSUPPORTED_KERNELS and callable(attr):
            return _refuse_kernel(attr, name)
        if isinstance(self._moewire_namespace, _HookedModule):
            return attr  # the module object hooks its kernels itself
        if name not in _flavours.kernel_functions() or not callable(attr):
            return attr
        cached = self._moewire_wrapped.get(name)
        if cached is not None and cached[0] is attr:
            return cached[1]
        wrapped = _wrap_kernel(attr, name)
        self._moewire_wrapped[name] = (attr, wrapped)
        return wrapped

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._moewire_namespace, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._moewire_namespace, name)

    def __dir__(self) -> list[str]:
        return dir(self._moewire_namespace)

    def __repr__(self) -> str:
        return f"<moewire kernel proxy of {self._moewire_namespace!r}>"


def _refuse_kernel(fn: Callable, name: str) -> Callable:
    """A kernel moewire cannot quantize around: refused inside a quantized forward whose
    quantizers are not all disabled (``flavours.UNSUPPORTED_KERNELS`` says why)."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        module = _ACTIVE.get()
        if module is not None and any(
            getattr(module, q).mode != "disabled" for q in QUANTIZER_NAMES
        ):
            raise RuntimeError(
                f"{module._moewire_name}: this Mega-MoE layer calls {name}, which moewire "
                f"does not support: {_flavours.UNSUPPORTED_KERNELS[name]}; disable its "
                "dispatch_quantizer and combine_quantizer (or leave the layer unconverted)"
            )
        return fn(*args, **kwargs)

    kernel.__name__ = getattr(fn, "__name__", name)
    kernel.__wrapped__ = fn
    return kernel


def _wrap_kernel(fn: Callable, name: str) -> Callable:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        module = _ACTIVE.get()
        if module is None:
            return fn(*args, **kwargs)
        _reached("kernel")
        y = args[0] if args else kwargs.get("y")
        if not isinstance(y, torch.Tensor):
            raise RuntimeError(
                f"{module._moewire_name}: the Mega-MoE kernel {name} was called "
                "without its output y as the first argument (or keyword y); moewire "
                "cannot find the tensor to re-sum into"
            )
        module._moewire_collect_cast_calibration()
        staged = module._moewire_before_kernel(y)
        result = fn(*args, **kwargs)
        if staged is not None:
            module._moewire_combine(y, staged, name)
        return result

    kernel.__name__ = getattr(fn, "__name__", name)
    kernel.__doc__ = getattr(fn, "__doc__", None)
    kernel.__wrapped__ = fn
    return kernel


def _stages_tokens(module: QuantExperts, x: Any) -> bool:
    """Whether a cast's input is the layer's tokens: ``[T, H]`` with ``H`` the experts'
    hidden size (the buffer's ``hidden``, else the width of its staged ``x``)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return False
    symm_buffer = module._moewire_adapter.get_symm_buffer(module)
    hidden = getattr(symm_buffer, "hidden", None)
    if hidden is None:
        hidden = symm_buffer.x.shape[-1]
    return x.shape[1] == hidden


def _wrap_cast(fn: Callable, name: str) -> Callable:
    """DeepGEMM's per-token cast as a staging hook, for a forward that stages inline.

    Inside a quantized forward whose dispatch quantizer is not disabled, the first call
    whose input ``x`` is ``[T, H]`` (``H`` the experts' hidden size), before the kernel
    call, is the staging of the dispatched tokens: it goes through the staging hook's own
    logic (``QuantExperts._moewire_stage``: its refusals, calibration, and the cast run
    on ``dispatch_quantizer(x)``, out of place) and counts as the ``staging`` hook for the
    fail-closed check. A second such call, or one after the kernel call, in the same
    forward raises: moewire cannot tell which of the casts stages the tokens, and would
    quantize the wrong tensor. Other inputs, calls outside a quantized forward, and calls
    made by the adapter's staging function (its tokens are quantized already) pass
    through.
    """

    def cast(*args: Any, **kwargs: Any) -> Any:
        module = _ACTIVE.get()
        if (
            module is None
            or _IN_STAGING_CALL.get()
            or module.dispatch_quantizer.mode == "disabled"
        ):
            return fn(*args, **kwargs)
        x = args[0] if args else kwargs.get("x")
        if not _stages_tokens(module, x):
            return fn(*args, **kwargs)
        reached = _REACHED.get() or set()
        if reached & {"staging", "kernel"}:
            when = (
                "after the Mega-MoE kernel call"
                if "kernel" in reached
                else "after the tokens were staged already (by an earlier cast or the staging "
                "call)"
            )
            raise RuntimeError(
                f"{module._moewire_name}: DeepGEMM's {name} was called on a "
                f"{list(x.shape)} tensor (the experts' hidden size) {when}, in one forward "
                f"of {_original_class(type(module)).__qualname__}; moewire quantizes the "
                "dispatched tokens in the first such cast before the kernel call and cannot "
                "tell which cast stages them, so it would quantize the wrong tensor. Stage "
                f"once per forward ({name}(hidden_states, ...) before the kernel call; one "
                "forward per chunk), or disable dispatch_quantizer"
            )
        _reached("staging")
        return module._moewire_stage(fn, args, kwargs, cast=name)

    cast.__name__ = getattr(fn, "__name__", name)
    cast.__doc__ = getattr(fn, "__doc__", None)
    cast.__wrapped__ = fn
    return cast


class _HookedModule(types.ModuleType):
    """The class a DeepGEMM module object gets once hooked: reading one of its Mega-MoE
    kernel functions, or a staging cast (``STAGING_CASTS``, see :func:`_wrap_cast`), while
    a quantized forward runs gives the wrapped function.

    A hook on DeepGEMM's own module object reaches every caller that looks the function
    up on it at call time, however it got the module (a global, ``_import_deep_gemm()``,
    or ``import deep_gemm`` inside the forward, as vLLM main's ``DeepGemmMegaExperts``
    does, staging with ``deep_gemm.utils.per_token_cast_to_fp8``); a caller that bound
    the function earlier is caught by the fail-closed check.
    """

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        cast = name in STAGING_CASTS
        if not (cast or name.endswith("mega_moe")) or _ACTIVE.get() is None or not callable(
            attr
        ):
            return attr
        if name in _flavours.UNSUPPORTED_KERNELS:
            return _refuse_kernel(attr, name)
        if cast or name in _flavours.kernel_functions():
            cached = _MODULE_WRAPPED.get((id(self), name))
            if cached is None or cached[0] is not attr:
                cached = (attr, (_wrap_cast if cast else _wrap_kernel)(attr, name))
                _MODULE_WRAPPED[(id(self), name)] = cached
            return cached[1]
        return attr


_MODULE_WRAPPED: dict[tuple[int, str], tuple[Callable, Callable]] = {}


def _holds_cast(module: Any) -> bool:
    return type(module) is types.ModuleType and any(n in vars(module) for n in STAGING_CASTS)


def hook_module(namespace: Any) -> bool:
    """Hook a DeepGEMM module object's kernel functions and staging casts in place; True
    if it is hooked.

    Only a plain module is hooked (its class becomes :class:`_HookedModule`); anything
    else (a test's namespace object) keeps the global proxy alone. DeepGEMM defines its
    casts in ``deep_gemm.utils.math`` and re-exports them from ``deep_gemm.utils`` and
    ``deep_gemm``: those submodules are hooked too where they hold a staging cast.
    """
    if not isinstance(namespace, _HookedModule):
        if type(namespace) is not types.ModuleType:
            return False
        namespace.__class__ = _HookedModule
    utils = vars(namespace).get("utils")
    for holder in (utils, vars(utils).get("math") if _holds_cast(utils) else None):
        if _holds_cast(holder):
            holder.__class__ = _HookedModule
    return True


def install_proxies(adapter: ExpertsAdapter) -> None:
    """Replace the adapter's two globals by proxies (once: a proxy is never wrapped again),
    and hook the DeepGEMM module object itself where the namespace is a module."""
    try:
        module = importlib.import_module(adapter.forward_module)
    except ImportError as exc:
        raise RuntimeError(
            f"experts adapter {adapter.name!r}: cannot import its forward module "
            f"{adapter.forward_module!r} ({exc}); fix the adapter's forward_module"
        ) from exc
    stage_fns = stage_fn_names(adapter)
    for attr in (*stage_fns, adapter.kernel_ns):
        if not hasattr(module, attr):
            raise RuntimeError(
                f"experts adapter {adapter.name!r}: {adapter.forward_module} has no global "
                f"{attr!r}; the experts' forward must read it at call time (fix stage_fn / "
                "kernel_ns of the adapter)"
            )
    for stage_fn in stage_fns:
        stage = getattr(module, stage_fn)
        if not isinstance(stage, _StagingProxy):
            setattr(module, stage_fn, _StagingProxy(stage))
    namespace = getattr(module, adapter.kernel_ns)
    if not isinstance(namespace, _KernelNamespace):
        hook_module(namespace)
        setattr(module, adapter.kernel_ns, _KernelNamespace(namespace))
    else:
        hook_module(namespace._moewire_namespace)


# -- the layout check registry ------------------------------------------------------------------


@dataclass
class _BufferCheck:
    flat: weakref.ref  # the checked flat tensor; a dead reference means "check again"
    graph_warned: bool = False
    checked: bool = False
    # Stored slots a fused shared row could also be read from, that no batch has yet ruled
    # out (None: not started). The buffer is checked once this is empty.
    unrefuted: set[int] | None = None


@dataclass(frozen=True)
class _Combine:
    """One kernel call's combine, as the checks and the re-sum read it."""

    rows: torch.Tensor  # BF16 [k (+1), Tmax, H], the combine region
    topk_idx: torch.Tensor  # int64 [T, k], staged before the kernel ran
    num_tokens: int
    shared: str | None  # where a fused shared row is added (None: none fused)
    weights: torch.Tensor | None  # FP32 [T, k] for a kernel that leaves unweighted rows
    y: torch.Tensor  # the kernel's output
    flavour: _flavours.Flavour
    kernel: str

    def resum(self, rows: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """``resum`` of these rows (or a reordering of them) in this call's order."""
        return resum(
            self.rows if rows is None else rows, self.topk_idx, self.num_tokens,
            shared_position=self.shared, weights=self.weights, **kwargs,
        )


_CHECKS: dict[tuple[str, int], _BufferCheck] = {}


def _buffer_state(symm_buffer: Any) -> _BufferCheck:
    flat = symm_buffer.buffer
    key = (str(flat.device), flat.untyped_storage().data_ptr())
    state = _CHECKS.get(key)
    if state is None or state.flat() is None:
        state = _BufferCheck(weakref.ref(flat))
        _CHECKS[key] = state
    return state


def layout_checked(symm_buffer: Any) -> bool:
    """Whether the eager layout check has passed for ``symm_buffer``'s storage."""
    return _buffer_state(symm_buffer).checked


def reset_layout_checks() -> None:
    """Forget every passed check (tests; a process that swaps its DeepGEMM build)."""
    _CHECKS.clear()


def _debug_env_hint() -> str:
    value = os.environ.get("DG_COMM_KERNEL_DEBUG", "")
    if value.strip() not in ("", "0"):
        return (
            f" DG_COMM_KERNEL_DEBUG={value} is set in this process: it zeroes the buffer "
            "after every call, so the rows are gone; unset it."
        )
    return ""


# -- the quantized experts class ------------------------------------------------------------


def _locate_hidden(
    fn: Callable, args: tuple, kwargs: dict, where: int | str, name: str
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[tuple, dict]]]:
    """Find ``hidden_states`` in a staging call; returns it and a function that rebuilds
    the call's ``(args, kwargs)`` with a replacement."""
    if isinstance(where, int) and len(args) > where:

        def put_positional(value: torch.Tensor) -> tuple[tuple, dict]:
            return args[:where] + (value,) + args[where + 1 :], kwargs

        return args[where], put_positional
    if isinstance(where, str) and where in kwargs:

        def put_keyword(value: torch.Tensor) -> tuple[tuple, dict]:
            return args, {**kwargs, where: value}

        return kwargs[where], put_keyword
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    key = params[where] if isinstance(where, int) and where < len(params) else where
    if isinstance(key, str) and key in kwargs:
        return _locate_hidden(fn, args, kwargs, key, name)
    if isinstance(key, str) and key in params and params.index(key) < len(args):
        return _locate_hidden(fn, args, kwargs, params.index(key), name)
    raise RuntimeError(
        f"{name}: the staging call has no hidden_states argument at {where!r} (got "
        f"{len(args)} positional and keywords {sorted(kwargs)}); fix the adapter's "
        "stage_hidden_arg"
    )


class QuantExperts:
    """Mixin of the generated ``Quant<Cls>`` classes (first in their MRO).

    Needs two submodules, ``dispatch_quantizer`` and ``combine_quantizer``, with the
    :class:`~moewire.quantizer.WireQuantizer` surface (``mode``, ``is_static_scale()``,
    ``static_amax``, ``collect(x)``, ``__call__``); another class-swap framework (ModelOpt's
    ``QuantModuleRegistry``) can put this mixin first in its own generated class, create
    the two quantizers and call :func:`install_proxies` for the class's adapter. The
    adapter is looked up from the class (``adapter_for``); :func:`set_module_name` sets the
    name used in errors (default: the class name).
    """

    _moewire_quant_class = True
    dispatch_quantizer: nn.Module
    combine_quantizer: nn.Module

    @property
    def _moewire_adapter(self) -> ExpertsAdapter:
        adapter = self.__dict__.get("_moewire_adapter_")
        if adapter is None:
            adapter = adapter_for(self)
            if adapter is None:
                raise TypeError(
                    f"{type(self).__name__} has no experts adapter; register its base class "
                    "with moewire.megamoe.register_experts_class"
                )
            self.__dict__["_moewire_adapter_"] = adapter
        return adapter

    @property
    def _moewire_name(self) -> str:
        return self.__dict__.get("_moewire_name_") or type(self).__name__

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The generated class is not a module attribute, so pickle (torch.save(model))
        # cannot find it by name: rebuild it from the original class on load instead.
        state = {k: v for k, v in self.__dict__.items() if k != "_moewire_adapter_"}
        return _rebuild_quant, (_original_class(type(self)),), state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        reached: set[str] = set()
        pending: list[torch.Tensor] = []
        token, reached_token = _ACTIVE.set(self), _REACHED.set(reached)
        pending_token = _CAST_CALIBRATION.set(pending)
        try:
            result = super().forward(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)
            _REACHED.reset(reached_token)
            _CAST_CALIBRATION.reset(pending_token)
        if pending:
            raise RuntimeError(
                f"{self._moewire_name}: dispatch_quantizer is calibrating and the forward of "
                f"{_original_class(type(self)).__qualname__} staged its tokens with DeepGEMM's "
                "per_token_cast_to_fp8, but no hooked Mega-MoE kernel call followed, so "
                "moewire never saw which tokens were staged with a valid slot (padding must "
                "stay out of the amax) and collected nothing; call the kernel through the "
                "deep_gemm module in the same forward, or calibrate through a staging "
                "function (an experts adapter's stage_fn)"
            )
        self._moewire_require_hooks(reached)
        return result

    def _moewire_require_hooks(self, reached: set[str]) -> None:
        """Fail closed: an enabled quantizer whose hook the forward never reached.

        The dispatch quantizer acts in the staging call, the combine quantizer right after
        the kernel call; a forward that stages inline, imports ``deep_gemm`` under another
        name or calls a kernel function no flavour describes would otherwise run
        unquantized without a word.
        """
        needed = (
            ("dispatch_quantizer", "staging", "the staging call"),
            ("combine_quantizer", "kernel", "the Mega-MoE kernel call"),
        )
        for quantizer_name, hook, what in needed:
            if getattr(self, quantizer_name).mode == "disabled" or hook in reached:
                continue
            adapter = self._moewire_adapter
            if hook == "staging":
                looked = (
                    f"{adapter.forward_module}.{adapter.stage_fn}, or the first "
                    "per_token_cast_to_fp8 of [T, hidden] tokens through the hooked deep_gemm "
                    "module before the kernel call"
                )
            else:
                looked = (
                    f"{adapter.forward_module}.{adapter.kernel_ns}.<"
                    f"{'|'.join(sorted(_flavours.kernel_functions()))}>"
                )
            raise RuntimeError(
                f"{self._moewire_name}: the forward of {_original_class(type(self)).__qualname__} "
                f"({adapter.runtime()}) finished without reaching moewire's {hook} hook "
                f"({what}, through {looked}), so {quantizer_name} did not run and the output "
                "is unquantized. This forward stages or calls the kernel some other way "
                "(inline staging, a local import of deep_gemm, a kernel function no flavour "
                f"describes); register an experts adapter for it, or disable {quantizer_name}"
            )

    # -- dispatch ------------------------------------------------------------------------

    def _moewire_stage(
        self, fn: Callable, args: tuple, kwargs: dict, cast: str | None = None
    ) -> Any:
        """The staging hook: run ``fn`` (the staging function, or with ``cast`` DeepGEMM's
        staging cast of that name, hidden states first) on ``dispatch_quantizer(hidden)``.

        Calibrating, ``fn`` runs on the original tokens and the tokens with a valid staged
        slot are collected: right after a staging function (it stages the ids), or at the
        kernel call after a cast (the caller stages the ids after casting).
        """
        quantizer = self.dispatch_quantizer
        if quantizer.mode == "disabled":
            return fn(*args, **kwargs)
        adapter = self._moewire_adapter
        if adapter.fused_shared(self):
            raise RuntimeError(
                f"{self._moewire_name}: the dispatch quantizer is enabled but a shared expert "
                "is fused into the Mega-MoE kernel, which reads the same staged tokens, so it "
                f"would see quantized inputs too; run with {FUSION_SWITCH} (vLLM) or build "
                "the layer with the shared expert unfused, or disable the dispatch quantizer"
            )
        where = adapter.stage_hidden_arg if cast is None else 0
        hidden, put = _locate_hidden(fn, args, kwargs, where, self._moewire_name)
        _on_device(quantizer, hidden.device, self._moewire_name, "dispatch_quantizer")
        if quantizer.mode == "calibrate":
            result = fn(*args, **kwargs)
            if cast is None:
                self._moewire_collect_staged(hidden)
            else:
                pending = _CAST_CALIBRATION.get()
                if pending is not None:
                    pending.append(hidden)
            return result
        args, kwargs = put(quantizer(hidden))
        return fn(*args, **kwargs)

    def _moewire_collect_staged(self, hidden: torch.Tensor) -> None:
        """Calibrate the dispatch amax on the tokens staged with a valid slot."""
        staged = self._moewire_adapter.get_symm_buffer(self).topk_idx[: hidden.shape[0]]
        # Only tokens with a valid slot reach an expert; padding never does. Boolean
        # indexing syncs with the host, which calibration (eager, before capture) allows.
        self.dispatch_quantizer.collect(hidden[(staged >= 0).any(dim=1)])

    def _moewire_collect_cast_calibration(self) -> None:
        """At the kernel call, before the kernel runs (it may clear the buffer): collect
        the tokens a staging cast saw, now that their ids are staged."""
        pending = _CAST_CALIBRATION.get()
        while pending:
            self._moewire_collect_staged(pending.pop())

    # -- combine -------------------------------------------------------------------------

    def _moewire_before_kernel(
        self, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The staged ids and router weights of this call, copied before the kernel runs
        (or None when the combine is off): a kernel may clear the buffer
        (``DG_COMM_KERNEL_DEBUG=1`` zeroes all of it), and validity read afterwards would
        turn padding into routed slots."""
        if self.combine_quantizer.mode == "disabled":
            return None
        symm_buffer = self._moewire_adapter.get_symm_buffer(self)
        t = y.shape[0]
        return symm_buffer.topk_idx[:t].clone(), symm_buffer.topk_weights[:t].clone()

    def _moewire_combine(
        self, y: torch.Tensor, staged: tuple[torch.Tensor, torch.Tensor], kernel: str
    ) -> None:
        """Check, then calibrate or re-sum the combine rows into ``y``.

        Args:
            y: the kernel's output, BF16 ``[T, H]``.
            staged: int64 ``[T, k]`` ids and FP32 ``[T, k]`` router weights, as staged
                before the kernel ran (the weights enter the sum of a weighted kernel only).
            kernel: the kernel function that ran (``"fp8_fp4_mega_moe"``).
        """
        topk_idx, topk_weights = staged
        quantizer = self.combine_quantizer
        name = self._moewire_name
        if quantizer.mode == "quantize" and not quantizer.is_static_scale():
            raise RuntimeError(
                f"{name}: the combine quantizer needs a calibrated or constant amax (each "
                "rank re-quantizes rows from all expert ranks, and a scale computed per call "
                "from this rank's rows would also see padding and stale rows); run "
                "calibration or set constant_amax"
            )
        adapter = self._moewire_adapter
        flavour = _flavours.get(adapter.flavour(self))
        fused = bool(adapter.fused_shared(self))
        symm_buffer = adapter.get_symm_buffer(self)
        layout = flavour.layout(kernel)
        rows = combine_rows(symm_buffer, flavour, kernel, fused_shared=fused)
        kind = _flavours.rows_kind(layout)
        self.__dict__["_moewire_kernel_rows_"] = kind
        described = amax_rows(self)
        if quantizer.mode == "quantize" and described not in (None, kind):
            raise RuntimeError(
                f"{name}: the combine quantizer's amax was calibrated on {described} combine "
                f"rows, but {kernel} leaves {kind} rows (nvfp4_mega_moe's rows are unweighted "
                "expert outputs, fp8_fp4_mega_moe's and bf16_mega_moe's are router-weighted); "
                "calibrate the combine amax on this kernel, or load scales saved from it"
            )
        shared = layout.shared_position if fused else None
        # nvfp4_mega_moe's rows are unweighted: its combine applies the router weights.
        weights = topk_weights.float() if layout.weighted else None
        num_tokens = y.shape[0]
        _on_device(quantizer, y.device, name, "combine_quantizer")
        state = _buffer_state(symm_buffer)
        call = _Combine(rows, topk_idx, num_tokens, shared, weights, y, flavour, kernel)
        if not state.checked and _one_pass(quantizer, y):
            self._moewire_check_in_one_pass(state, call)
            return
        if not state.checked:
            self._moewire_check(state, call)
        if quantizer.mode == "calibrate":
            # Valid rows only: invalid slots hold stale rows, padding tokens have no valid
            # slot, and the fused shared row (index k) is not on the wire. For a weighted
            # kernel these are the unweighted expert outputs (docs/formats.md).
            valid = (topk_idx[:num_tokens] >= 0).T
            quantizer.collect(rows[: topk_idx.shape[1], :num_tokens][valid])
            self.__dict__["_moewire_amax_rows_"] = kind
            return
        call.resum(row_quantizer=quantizer, out=y)

    def _moewire_check_in_one_pass(self, state: _BufferCheck, call: _Combine) -> None:
        """Check and quantize in one pass over the rows (CUDA, the fused kernel).

        The fused kernel re-sums the quantized rows into a scratch output and, in the same
        pass, compares the unquantized re-sum with ``y`` over the compared tokens (as
        :meth:`_moewire_check`), counting mismatching elements on the device. Eager: one
        host read of that count; ``y`` is replaced only when it is 0, and a mismatch is
        reported by the torch check (``y`` is intact), which names the tokens. Inside a CUDA
        graph capture the count feeds a device-side assert, and ``y`` is replaced. The
        proof of which stored row is the shared one still needs its alternative readings
        (eager, until refuted), as in :meth:`_moewire_check`.
        """
        quantizer = self.combine_quantizer
        fmt, y = quantizer.fmt, call.y
        out = torch.empty_like(y)
        flag = torch.zeros(1, dtype=torch.int32, device=y.device)
        amax = quantizer.static_amax if fmt.needs_amax else None
        kernels.fused_combine(
            call.rows, call.topk_idx, call.num_tokens, out, fmt.name, amax, call.shared, y,
            flag, weights=call.weights,
        )
        if _capturing(y):
            self._moewire_assert_in_graph(state, flag[0] == 0, call.flavour)
            y.copy_(out)
            return
        has_routed, bad = torch.stack(
            [(call.topk_idx[: call.num_tokens] >= 0).any().to(torch.int32), flag[0]]
        ).tolist()
        if has_routed and bad:
            # The torch comparison names the mismatching tokens (and raises).
            self._moewire_compare(state, call)
            raise RuntimeError(
                f"{self._moewire_name}: the fused kernel's layout check counted {bad} "
                "mismatching elements, but the torch check found none: a moewire bug; set "
                "MOEWIRE_DISABLE_KERNELS=1 and report it"
            )
        if has_routed:
            self._moewire_refute_shared_readings(state, call)
        y.copy_(out)

    def _moewire_check(self, state: _BufferCheck, call: _Combine) -> None:
        """Unquantized re-sum == ``y`` bit for bit, and proof of which row is which.

        Compared tokens: those with a routed row, and with a fused shared expert every
        token (the kernel gives every token its shared row: ``impls/sm100_*_mega_moe.cuh``,
        lane ``kNumTopk`` is always valid). With a fused shared expert, sums that match
        do not yet say which stored row is the shared one: with every slot valid, reading
        the shared row from another slot adds the same rows. So the buffer is marked
        checked only once, over one or more batches, every other reading (shared row at
        slot ``j < k``, routed slots shifted past it) has failed to reproduce ``y`` on some
        token (a token with an invalid slot, or a padding token with the shared row only);
        until then every eager batch is checked again.
        """
        if self._moewire_compare(state, call):
            self._moewire_refute_shared_readings(state, call)

    def _moewire_compare(self, state: _BufferCheck, call: _Combine) -> bool:
        """The unquantized re-sum against ``y``: raise on a mismatch (eager), or record
        the comparison as a device-side assert (capture). True when an eager batch with a
        routed row matched, i.e. when the buffer may be marked."""
        y = call.y
        expected = call.resum()
        routed = (call.topk_idx[: call.num_tokens] >= 0).any(dim=1)
        compared = routed | (call.shared is not None)
        differs = (expected.view(torch.int16) != y.view(torch.int16)).any(dim=1) & compared
        if _capturing(y):
            self._moewire_assert_in_graph(state, ~differs.any(), call.flavour)
            return False
        has_routed, bad, total = torch.stack(
            [routed.any().long(), differs.sum(), compared.sum()]
        ).tolist()
        if not has_routed:
            return False
        if bad:
            raise RuntimeError(
                f"{self._layout_failure(call)} ({bad} of {total} compared "
                f"tokens differ).{_debug_env_hint()} {_layout_causes()}"
            )
        return True

    def _layout_failure(self, call: _Combine) -> str:
        flavour, kernel, shared = call.flavour, call.kernel, call.shared
        return (
            f"{self._moewire_name}: the Mega-MoE layout check failed: the unquantized re-sum "
            f"of the combine rows of {kernel} read with kernel flavour {flavour.name!r} (combine "
            f"base {flavour.layout(kernel).base_rule}, fused shared row added "
            f"{shared if shared else '- (none fused)'}) does not reproduce the kernel output"
        )

    def _moewire_assert_in_graph(
        self, state: _BufferCheck, ok: torch.Tensor, flavour: _flavours.Flavour
    ) -> None:
        """Record the layout check in the CUDA graph being captured: a device-side assert."""
        if not state.graph_warned:
            state.graph_warned = True
            warnings.warn(
                f"{self._moewire_name}: the layout check of this Mega-MoE buffer runs inside "
                "the CUDA graph being captured (no eager batch with a routed row came "
                "first); a replay that stops with 'device-side assert triggered' is this "
                f"check failing. {_layout_causes()}",
                stacklevel=3,
            )
        # torch caps a device-assert message at 254 characters; the warning above
        # carries the full explanation.
        short = (
            f"{self._moewire_name}: the Mega-MoE layout check failed (flavour "
            f"{flavour.name!r}); see moewire's capture-time warning"
        )
        torch._assert_async(ok, short[:254])

    def _moewire_refute_shared_readings(self, state: _BufferCheck, call: _Combine) -> None:
        """After a passing check: mark the buffer checked, or, with a fused shared expert,
        once every other reading of the shared row has failed to reproduce ``y`` (every
        token has its shared row, so every token is compared)."""
        if call.shared is not None:
            k = call.topk_idx.shape[1]
            if state.unrefuted is None:
                state.unrefuted = set(range(k))
            for j in sorted(state.unrefuted):
                # Shared row read from slot j, routed slots j.. shifted up by one.
                order = [*range(j), *range(j + 1, k + 1), j]
                alternative = call.resum(call.rows[order])
                if bool((alternative.view(torch.int16) != call.y.view(torch.int16)).any()):
                    state.unrefuted.discard(j)
            if state.unrefuted:
                return
        state.checked = True


def _layout_causes() -> str:
    return (
        "Likely causes: DG_COMM_KERNEL_DEBUG=1 (it zeroes the buffer after every call); "
        "a DeepGEMM build that changed the combine layout or order; or the wrong flavour "
        f"for this build (registered: {', '.join(_flavours.names())}; set it in the "
        "experts adapter)."
    )


def _one_pass(quantizer: Any, y: torch.Tensor) -> bool:
    """Whether the fused kernel can check and quantize this combine in one pass: a CUDA
    output, the kernels available, and a quantizer in quantize mode whose format has a
    kernel (the same conditions under which ``resum`` takes the kernel)."""
    fmt = getattr(quantizer, "fmt", None)
    return (
        y.is_cuda
        and quantizer.mode == "quantize"
        and fmt is not None
        and kernels.available()
        and kernels.supports(fmt.name)
    )


def amax_rows(module: nn.Module) -> str | None:
    """Which combine rows the module's combine amax describes (``flavours.rows_kind``):
    set by calibration or :func:`set_amax_rows`; ``None`` when unknown."""
    return module.__dict__.get("_moewire_amax_rows_")


def kernel_rows(module: nn.Module) -> str | None:
    """The kind of combine rows the module's kernel left in its last forward, or ``None``."""
    return module.__dict__.get("_moewire_kernel_rows_")


def set_amax_rows(module: nn.Module, kind: str | None) -> None:
    """Record which combine rows a loaded amax describes (``load_scales``)."""
    if kind is not None and kind not in _flavours.ROWS_KINDS:
        raise ValueError(
            f"set_amax_rows: kind must be 'weighted', 'unweighted' or None, got {kind!r}"
        )
    module.__dict__["_moewire_amax_rows_"] = kind


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s work is being recorded into a CUDA graph right now."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _on_device(quantizer: nn.Module, device: torch.device, name: str, which: str) -> None:
    """Keep the quantizer's state where the data is: moved eagerly, refused mid-capture."""
    state = [t for t in (quantizer.static_amax, *quantizer.buffers()) if t is not None]
    if all(t.device == device for t in state):
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{name}.{which}: its state is on {state[0].device} while a CUDA graph is being "
            f"captured on {device}; move the model to the device (model.to({str(device)!r})) "
            "or run one eager forward before capture"
        )
    quantizer.to(device)


# -- conversion ---------------------------------------------------------------------------------

_QUANT_CLASSES: dict[type, type] = {}


def _quant_class(cls: type) -> type:
    quant = _QUANT_CLASSES.get(cls)
    if quant is None:
        quant = type(
            f"Quant{cls.__name__}",
            (QuantExperts, cls),
            {"__module__": __name__, "__doc__": f"{cls.__name__} with wire quantizers."},
        )
        _QUANT_CLASSES[cls] = quant
    return quant


def _original_class(quant: type) -> type:
    """The experts class a generated ``Quant<Cls>`` was made from."""
    for cls, generated in _QUANT_CLASSES.items():
        if generated is quant:
            return cls
    raise TypeError(f"{quant.__qualname__} is not a class generated by moewire's convert")


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
    return object.__new__(_quant_class(cls))


def _module_device(module: nn.Module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")


def set_module_name(module: nn.Module, name: str) -> None:
    """Set the name a quantized experts module uses in its errors (its path in the model)."""
    module.__dict__["_moewire_name_"] = name


def is_converted(module: nn.Module) -> bool:
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
    set_module_name(module, name or original)
    for attr in QUANTIZER_NAMES:
        label = f"{name or original}.{attr}"
        if make_quantizer is None:
            quantizer = WireQuantizer(enable=False, name=label).to(device)
        else:
            quantizer = make_quantizer(attr, label, device)
        attach(module, attr, quantizer)
    return module
