"""The module SGLang's Mega-MoE sites are rebound to, and the experts adapter that names it.

- each site's function is rebound, in every module SGLang calls it through, to a
  trampoline to a global of this module (:func:`moewire.integrations._host.rebind_global`)
  that runs the original through the quantized experts module
  (``QuantExperts.moewire_run``: hooks active, then the fail-closed check) after
  refusing the paths moewire cannot see (:mod:`moewire.integrations.sglang.refusals`);
- the experts adapter names this module for the staging global (SGLang's own
  ``mega_moe_pre_dispatch``, rebound here) and for ``deep_gemm``; DeepGEMM's own staging
  functions (``mega_moe_pre_dispatch_sm90``, ``mega_moe_pre_dispatch``) and kernels are
  hooked on its module object (the ``sgl-deep-gemm-*`` builds name them);
- on nvfp4xnvfp4 and mxf4xmxf4 the dispatch quantizer runs before
  ``deep_gemm.mega_moe_pre_dispatch``'s own 4-bit cast (a hooked staging cast): the wire
  carries ``NVFP4(q(x))`` / ``MXFP4(q(x))``, as vLLM's NVFP4 staging does;
- the buffer of the call in progress (an argument on SM90, ``_get_mega_moe_symm_buffer``'s
  result on SM100) is what the adapter's ``get_symm_buffer`` returns.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from moewire import patches
from moewire.integrations._host import rebind_global
from moewire.integrations.sglang.refusals import _refusal, _refuse_post_norm
from moewire.integrations.sglang.sites import SITES, SglangSite
from moewire.integrations.sglang.sites import recognise as recognise_site
from moewire.megamoe.registry import ExpertsAdapter

__all__ = ["STAGE_GLOBAL", "install"]

STAGE_GLOBAL = "stage__sglang_mega_moe_pre_dispatch"


@dataclass
class _Call:
    """The SGLang Mega-MoE call in progress: its buffer and whether a shared expert is
    fused into it."""

    buffer: Any = None
    fused_shared: bool = False


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "moewire_sglang_call", default=None
)


def __getattr__(name: str) -> Any:
    if name == "deep_gemm":
        return importlib.import_module("deep_gemm")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- the trampolines --------------------------------------------------------------------------


def _global_name(site: SglangSite) -> str:
    return f"run__{site.name.replace('-', '_')}"


def _runner(site: SglangSite) -> Callable[..., Any]:
    """The function the trampolines of ``site`` call: the original, run through the
    quantized experts module when ``experts`` is one."""
    global_name = _global_name(site)
    # The original's signature, read once per original (the runner runs on every MoE
    # layer's forward); on the runner, so it goes with it.
    signature: list[tuple[Callable[..., Any], inspect.Signature]] = []

    def run(experts: Any, *args: Any, **kwargs: Any) -> Any:
        original = globals()[f"{global_name}__original"]
        if not hasattr(experts, "moewire_run"):
            return original(experts, *args, **kwargs)
        if not signature or signature[0][0] is not original:
            signature[:] = [(original, inspect.signature(original))]
        bound = signature[0][1].bind(experts, *args, **kwargs).arguments
        why = _refusal(site, experts, bound)
        if why is not None:
            raise RuntimeError(why)
        call = _CALL.get()
        state = _Call(
            buffer=bound.get(site.buffer_arg) if site.buffer_arg else None,
            fused_shared=bound.get("shared_l1_weights") is not None
            or (call is not None and call.fused_shared),
        )
        token = _CALL.set(state)
        try:
            from moewire.megamoe.active import ACTIVE

            if ACTIVE.get() is experts:  # the SM90 hand-off inside run_mega_routed_experts
                return original(experts, *args, **kwargs)
            return experts.moewire_run(original, experts, *args, **kwargs)
        finally:
            _CALL.reset(token)

    run.__name__ = site.function
    return run


def _record_buffer(*args: Any, **kwargs: Any) -> Any:
    """SGLang's ``_get_mega_moe_symm_buffer``, whose result is the buffer of the call."""
    buffer = globals()["buffer__original"](*args, **kwargs)
    call = _CALL.get()
    if call is not None:
        call.buffer = buffer
    return buffer



# -- the adapter ------------------------------------------------------------------------------


def _symm_buffer(module: nn.Module) -> Any:
    call = _CALL.get()
    if call is None or call.buffer is None:
        raise RuntimeError(
            f"{getattr(module, '_moewire_name', type(module).__name__)}: no SGLang Mega-MoE "
            "call is in progress, so moewire has no buffer for it; the experts run outside "
            "run_mega_routed_experts / run_sm90_mega_routed (SGLang's fallback path for "
            "batches above SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK): raise the "
            "cap, or disable the quantizers"
        )
    return call.buffer


def _flavour(module: nn.Module) -> str:
    from moewire.megamoe.flavours import detect

    return detect(importlib.import_module("deep_gemm"),
                  getattr(module, "_moewire_name", type(module).__name__)).name


def _ep_group(module: nn.Module) -> Any:
    try:
        from sglang.srt.runtime_context import get_parallel

        group = get_parallel().moe_ep_group.device_group
    except (ImportError, AttributeError, RuntimeError):
        return None
    return group if group is not None and group.size() > 1 else None


def _runtime() -> str:
    try:
        from importlib.metadata import version

        return f"SGLang {version('sglang')}"
    except Exception:  # noqa: BLE001 - a message only
        return "SGLang (version unknown)"


def _adapter(stage_fn: str | tuple[str, ...]) -> ExpertsAdapter:
    """The experts adapter of SGLang's experts modules (``stage_fn``: SGLang's own staging
    global when its site is installed; DeepGEMM's staging is hooked on its module)."""
    return ExpertsAdapter(
        name="sglang-mega-moe",
        forward_module=__name__,
        stage_fn=stage_fn,
        stage_hidden_arg=0,
        kernel_ns="deep_gemm",
        get_symm_buffer=_symm_buffer,
        flavour=_flavour,
        fused_shared=lambda m: bool(_CALL.get() is not None and _CALL.get().fused_shared),
        ep_group=_ep_group,
        runtime=_runtime,
        applies=lambda m: bool(getattr(m, "_mega_moe_weights_built", False)),
    )


def _install_site(site: SglangSite) -> None:
    """Point every caller of ``site.function`` at its runner (the original kept here)."""
    name = _global_name(site)
    runner = globals().get(name)
    if runner is None:
        original = getattr(importlib.import_module(site.module), site.function)
        patches.patch_attr(sys.modules[__name__], f"{name}__original", original)
        runner = _runner(site)
        patches.patch_attr(sys.modules[__name__], name, runner)
    for caller in site.called_from:
        try:
            module = importlib.import_module(caller)
        except ImportError:  # SGLang cannot call it through a module that does not import
            continue
        if getattr(module, site.function, None) is not runner:
            patches.patch_attr(module, site.function, runner)
    if site.buffer_arg is None:
        # SGLang's own staging cast (fp8xfp4), and the buffer of the call.
        rebind_global(site.module, "mega_moe_pre_dispatch", __name__, STAGE_GLOBAL)
        module = sys.modules[site.module]
        if getattr(module, site.buffer_fn) is not _record_buffer:
            patches.patch_attr(sys.modules[__name__], "buffer__original",
                               getattr(module, site.buffer_fn))
            patches.patch_attr(module, site.buffer_fn, _record_buffer)


def install() -> ExpertsAdapter:
    """Rebind every recognised site (idempotent, through the undo ledger).

    Returns:
        The experts adapter for the sites installed.

    Raises:
        RuntimeError: SGLang has none of the sites; the message says why each was rejected.
    """
    found, rejected = [], []
    for site in SITES:
        why = recognise_site(site)
        if why is not None:
            rejected.append(why)
            continue
        _install_site(site)
        found.append(site)
    if not found:
        raise RuntimeError(
            "moewire.integrations.sglang: this SGLang has no Mega-MoE site with the "
            f"structure moewire hooks: {'; '.join(rejected)}"
        )
    deep_gemm = importlib.import_module("deep_gemm")
    kernel = getattr(deep_gemm, "fp8_fp4_mega_moe", None)
    if callable(kernel) and not getattr(kernel, "_moewire_post_norm_guard", False):
        patches.patch_attr(deep_gemm, "fp8_fp4_mega_moe", _refuse_post_norm(kernel))
    return _adapter(STAGE_GLOBAL if any(s.buffer_arg is None for s in found) else ())
