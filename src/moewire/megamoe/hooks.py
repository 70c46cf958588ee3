"""The namespace hooks: how moewire reaches a Mega-MoE forward's staging and kernel calls.

The experts' forward is never copied. Its class's adapter (``moewire.megamoe.registry``)
names two globals its forward reads at call time; :func:`install_proxies` replaces them,
once per forward module, with proxies that pass everything through unless a quantized
module's forward is running (:mod:`moewire.megamoe.active`):

- the staging function (:class:`_StagingProxy`): the call goes to the running module's
  staging hook (``QuantExperts._moewire_stage``), which replaces ``hidden_states`` by
  ``dispatch_quantizer(hidden_states)``, out of place;
- the DeepGEMM namespace (:class:`_KernelNamespace`): every kernel function some flavour
  describes (``flavours.kernel_functions()``) is wrapped (:func:`_wrap_kernel`); right
  after the kernel returns the running module's combine hook runs
  (``QuantExperts._moewire_combine``).

The DeepGEMM module object itself is hooked too (:class:`_HookedModule`, :func:`hook_module`):
its kernel functions, and its staging cast ``per_token_cast_to_fp8`` (also on
``deep_gemm.utils``), whose first call on ``[T, hidden]`` tokens before the kernel call is
the staging of a forward that stages inline (:func:`_wrap_cast`).

Every global replaced and every module class changed goes through the undo ledger
(:mod:`moewire.patches`).
"""

from __future__ import annotations

import importlib
import types
import typing
import weakref
from collections.abc import Callable
from typing import Any, TypeGuard

import torch

from moewire import patches
from moewire.megamoe import flavours as _flavours
from moewire.megamoe.active import ACTIVE, IN_STAGING_CALL, PLAIN_COPY_HOOK, REACHED, reached
from moewire.megamoe.quant_experts import QUANTIZER_NAMES, QuantExperts, original_class
from moewire.megamoe.registry import ExpertsAdapter, stage_fn_names

__all__ = ["hook_module", "install_proxies"]


def _running() -> QuantExperts | None:
    """The quantized module whose forward is running (only ``QuantExperts.moewire_run`` sets
    ``ACTIVE``), or ``None``."""
    return typing.cast("QuantExperts | None", ACTIVE.get())


# -- proxies on the forward module's globals ------------------------------------------------


class _StagingProxy:
    """Stands in for the staging function; defers to the active quantized module, if any."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._moewire_original = fn
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "staging")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = _running()
        if module is None:
            return self._moewire_original(*args, **kwargs)
        _refuse_second_staging(module, self.__name__)
        reached("staging")
        token = IN_STAGING_CALL.set(True)
        try:
            return module._moewire_stage(self._moewire_original, args, kwargs)
        finally:
            IN_STAGING_CALL.reset(token)

    def __repr__(self) -> str:
        return f"<moewire staging proxy of {self._moewire_original!r}>"


class _KernelNamespace:
    """Stands in for the DeepGEMM namespace; wraps the Mega-MoE kernels (and, on a namespace
    that is no module, its staging casts), passes the rest.

    Attribute writes and deletes go to the real namespace, so monkeypatching a kernel
    through the proxy patches the namespace itself.
    """

    def __init__(self, namespace: Any) -> None:
        object.__setattr__(self, "_moewire_namespace", namespace)
        object.__setattr__(self, "_moewire_wrapped", {})

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._moewire_namespace, name)
        if isinstance(self._moewire_namespace, _HookedModule):
            return attr  # the module object hooks its kernels (and refusals) itself
        if name in _flavours.UNSUPPORTED_KERNELS and callable(attr):
            return _refuse_kernel(attr, name)
        # A namespace that is no module holds its staging cast as its own attribute
        # (transformers 5.23's DeepGEMM bundle, a dataclass of entry points): hooked here.
        cast = name in _flavours.staging_casts()
        if not (cast or name in _flavours.kernel_functions()) or not callable(attr):
            return attr
        cached = self._moewire_wrapped.get(name)
        if cached is not None and cached[0] is attr:
            return cached[1]
        wrapped = (_wrap_cast if cast else _wrap_kernel)(attr, name)
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



def _refuse_second_staging(module: QuantExperts, name: str) -> None:
    """A staging call or cast after the forward's own tokens were quantized (it stages
    with a plain copy) would quantize them a second time: refused."""
    if PLAIN_COPY_HOOK in (REACHED.get() or ()):
        raise RuntimeError(
            f"{module._moewire_name}: the forward of {original_class(type(module)).__qualname__} "
            f"called {name} although moewire had quantized its tokens argument for a plain-copy "
            "staging (the adapter's forward_dispatch said this call copies the tokens into "
            "the buffer); the tokens would be quantized twice. Fix the adapter's "
            "forward_dispatch (the site's plain_copy branch), or disable dispatch_quantizer"
        )


def _refusal(module: QuantExperts, name: str) -> str | None:
    """Why ``name`` is refused for ``module``, or ``None`` where the module's build models it.

    Refusals belong to builds, not to kernel names: two builds may ship different kernels
    under one name (vLLM 0.33/0.34's ``fp4_fp4_mega_moe`` normalises its rows, DeepGEMM
    2.8.0's does not). A build that neither models nor refuses ``name``, or a module whose
    build cannot be told, gets a build's reason (fail closed).
    """
    try:
        flavour = _flavours.get(module._moewire_adapter.flavour(module))
    except (RuntimeError, ValueError):
        return _flavours.UNSUPPORTED_KERNELS[name]
    if name in flavour.kernels and name not in flavour.refused:
        return None
    return flavour.refused.get(name, _flavours.UNSUPPORTED_KERNELS[name])


def _refuse_kernel(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A kernel some build refuses (``flavours.UNSUPPORTED_KERNELS``): refused inside a
    quantized forward whose quantizers are not all disabled when the module's own build
    refuses it (:func:`_refusal`), else the combine hook of :func:`_wrap_kernel` where a
    build models the name."""
    wrapped = _wrap_kernel(fn, name) if name in _flavours.kernel_functions() else fn

    def kernel(*args: Any, **kwargs: Any) -> Any:
        module = _running()
        if module is not None and any(
            getattr(module, q).mode != "disabled" for q in QUANTIZER_NAMES
        ):
            why = _refusal(module, name)
            if why is not None:
                raise RuntimeError(
                    f"{module._moewire_name}: this Mega-MoE layer calls {name}, which moewire "
                    f"does not support on its build: {why}; disable its dispatch_quantizer "
                    "and combine_quantizer (or leave the layer unconverted)"
                )
        return wrapped(*args, **kwargs)

    kernel.__name__ = getattr(fn, "__name__", name)
    kernel.__wrapped__ = fn  # type: ignore[attr-defined]
    return kernel


def _wrap_kernel(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        module = _running()
        if module is None:
            return fn(*args, **kwargs)
        reached("kernel")
        y = args[0] if args else kwargs.get("y")
        if not isinstance(y, torch.Tensor):
            raise RuntimeError(
                f"{module._moewire_name}: the Mega-MoE kernel {name} was called "
                "without its output y as the first argument (or keyword y); moewire "
                "cannot find the tensor to re-sum into"
            )
        module._moewire_collect_cast_calibration()
        # A fused shared expert's own launch on the original tokens, then the owed staging
        # of the quantized ones (the dispatch quantizer quantizing); None otherwise.
        shared_row = module._moewire_shared_pass(fn, args, kwargs, name)
        staged = module._moewire_before_kernel(y, shared_pass=shared_row is not None)
        result = fn(*args, **kwargs)
        if staged is not None:
            module._moewire_combine(y, staged, name, (fn, args, kwargs), shared_row=shared_row)
        return result

    kernel.__name__ = getattr(fn, "__name__", name)
    kernel.__doc__ = getattr(fn, "__doc__", None)
    kernel.__wrapped__ = fn  # type: ignore[attr-defined]
    return kernel


def _stages_tokens(x: Any, module: QuantExperts) -> TypeGuard[torch.Tensor]:
    """Whether a cast's input is the layer's tokens: ``[T, H]`` with ``H`` the experts'
    hidden size (the buffer's ``hidden``, else the width of its staged ``x``)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return False
    symm_buffer = module._moewire_adapter.get_symm_buffer(module)
    hidden = getattr(symm_buffer, "hidden", None)
    if hidden is None:
        hidden = symm_buffer.x.shape[-1]
    return bool(x.shape[1] == hidden)


def _wrap_cast(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
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
        module = _running()
        if (
            module is None
            or IN_STAGING_CALL.get()
            or module.dispatch_quantizer.mode == "disabled"
        ):
            return fn(*args, **kwargs)
        x = args[0] if args else kwargs.get("x")
        if not _stages_tokens(x, module):
            return fn(*args, **kwargs)
        _refuse_second_staging(module, name)
        seen = REACHED.get() or set()
        if seen & {"staging", "kernel"}:
            when = (
                "after the Mega-MoE kernel call"
                if "kernel" in seen
                else "after the tokens were staged already (by an earlier cast or the staging "
                "call)"
            )
            raise RuntimeError(
                f"{module._moewire_name}: DeepGEMM's {name} was called on a "
                f"{list(x.shape)} tensor (the experts' hidden size) {when}, in one forward "
                f"of {original_class(type(module)).__qualname__}; moewire quantizes the "
                "dispatched tokens in the first such cast before the kernel call and cannot "
                "tell which cast stages them, so it would quantize the wrong tensor. Stage "
                f"once per forward ({name}(hidden_states, ...) before the kernel call; one "
                "forward per chunk), or disable dispatch_quantizer"
            )
        reached("staging")
        return module._moewire_stage(fn, args, kwargs, cast=name)

    cast.__name__ = getattr(fn, "__name__", name)
    cast.__doc__ = getattr(fn, "__doc__", None)
    cast.__wrapped__ = fn  # type: ignore[attr-defined]
    return cast


class _HookedModule(types.ModuleType):
    """The class a DeepGEMM module object gets once hooked: reading one of its Mega-MoE
    kernel functions, or a staging cast (``flavours.staging_casts()``, see
    :func:`_wrap_cast`), while a quantized forward runs gives the wrapped function.

    A hook on DeepGEMM's own module object reaches every caller that looks the function
    up on it at call time, however it got the module (a global, ``_import_deep_gemm()``,
    or ``import deep_gemm`` inside the forward, as vLLM main's ``DeepGemmMegaExperts``
    does, staging with ``deep_gemm.utils.per_token_cast_to_fp8``); a caller that bound
    the function earlier is caught by the fail-closed check.
    """

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        # The names come from the builds (``flavours.hooked_names()``): kernels, refused
        # kernels and the staging casts a forward may call inline.
        if ACTIVE.get() is None or not callable(attr) or name not in _flavours.hooked_names():
            return attr
        cast = name in _flavours.staging_casts()
        if name in _flavours.UNSUPPORTED_KERNELS:
            return _refuse_kernel(attr, name)
        if cast or name in _flavours.kernel_functions():
            wrapped = _MODULE_WRAPPED.setdefault(self, {})
            cached = wrapped.get(name)
            if cached is None or cached[0] is not attr:
                cached = (attr, (_wrap_cast if cast else _wrap_kernel)(attr, name))
                wrapped[name] = cached
            return cached[1]
        return attr


# A hooked module object's wrapped functions, on the module's life: (function, wrapper) by
# name, so a function replaced on the module (a test's monkeypatch) is wrapped again.
_Wrapped = dict[str, tuple[Callable[..., Any], Callable[..., Any]]]
_MODULE_WRAPPED: weakref.WeakKeyDictionary[types.ModuleType, _Wrapped] = weakref.WeakKeyDictionary()


def _holds_cast(module: Any) -> bool:
    return type(module) is types.ModuleType and any(
        n in vars(module) for n in _flavours.staging_casts()
    )


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
        patches.patch_class(namespace, _HookedModule)
    utils = vars(namespace).get("utils")
    for holder in (utils, vars(utils).get("math") if _holds_cast(utils) else None):
        if _holds_cast(holder):
            patches.patch_class(holder, _HookedModule)
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
            patches.patch_attr(module, stage_fn, _StagingProxy(stage))
    namespace = getattr(module, adapter.kernel_ns)
    if namespace is None:
        raise RuntimeError(
            f"experts adapter {adapter.name!r}: {adapter.forward_module}.{adapter.kernel_ns} is "
            "None: the forward has not loaded its DeepGEMM yet, so there is nothing to hook; "
            f"load it before quantizing ({adapter.runtime()})"
        )
    if not isinstance(namespace, _KernelNamespace):
        hook_module(namespace)
        patches.patch_attr(module, adapter.kernel_ns, _KernelNamespace(namespace))
    else:
        hook_module(namespace._moewire_namespace)

