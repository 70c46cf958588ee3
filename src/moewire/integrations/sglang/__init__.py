"""moewire in SGLang's Mega-MoE path (``--moe-a2a-backend megamoe``).

Where SGLang runs its Mega-MoE experts is one declarative entry per site in
:mod:`moewire.integrations.sglang.sites`; this module derives the rest:

- each site's function is rebound, in every module SGLang calls it through, to a
  trampoline to a global of this module (:func:`moewire.integrations._host.rebind_global`)
  that runs the original through the quantized experts module
  (``QuantExperts.moewire_run``: hooks active, then the fail-closed check) after
  refusing the paths moewire cannot see (:func:`_refusal`);
- the experts adapter names this module for the staging global (SGLang's own
  ``mega_moe_pre_dispatch``, rebound here) and for ``deep_gemm``; DeepGEMM's own staging
  functions (``mega_moe_pre_dispatch_sm90``, ``mega_moe_pre_dispatch``) and kernels are
  hooked on its module object (the ``sgl-deep-gemm-*`` builds name them);
- on nvfp4xnvfp4 and mxf4xmxf4 the dispatch quantizer runs before
  ``deep_gemm.mega_moe_pre_dispatch``'s own 4-bit cast (a hooked staging cast): the wire
  carries ``NVFP4(q(x))`` / ``MXFP4(q(x))``, as vLLM's NVFP4 staging does;
- the buffer of the call in progress (an argument on SM90, ``_get_mega_moe_symm_buffer``'s
  result on SM100) is what the adapter's ``get_symm_buffer`` returns.

:func:`register` is SGLang's general plugin (entry point ``sglang.srt.plugins``): with
``MOEWIRE_RECIPE`` set, it quantizes every Mega-MoE experts module right after
``ModelRunner.load_model`` and loads ``MOEWIRE_SCALES`` when set.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from moewire import patches
from moewire.integrations._host import (
    ENV_RECIPE,
    ENV_SCALES,
    begin_calibration,
    finish_calibration,
    rank_path,
    rebind_global,
)
from moewire.integrations.sglang.sites import MEGA_MOE, SITES, SglangSite
from moewire.integrations.sglang.sites import recognise as recognise_site
from moewire.megamoe.registry import ExpertsAdapter

__all__ = [
    "ENV_FP8_COMBINE",
    "ENV_RECIPE",
    "ENV_SCALES",
    "SITES",
    "SchedulerCalibration",
    "calibrate",
    "calibrating",
    "install",
    "quantize_sglang_model",
    "register",
]

logger = logging.getLogger(__name__)

#: sgl-deep-gemm's switch to FP8 combine rows (impls/sm100_fp8_fp4_mega_moe.cuh).
ENV_FP8_COMBINE = "DG_USE_FP8_COMBINE"
#: SGLang's Mega-Gate switch (``sglang/srt/layers/moe/mega_gate.py``).
ENV_MEGA_GATE = "SGLANG_OPT_DEEPGEMM_MEGA_GATE"
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


# -- the paths moewire cannot see -------------------------------------------------------------


def _enabled(experts: nn.Module) -> list[str]:
    return [q for q in ("dispatch_quantizer", "combine_quantizer")
            if getattr(experts, q).mode != "disabled"]


def _mma_type(experts: nn.Module) -> str:
    """The ``mma_type`` SGLang derives for ``experts`` (``mega_moe._mega_moe_mma_type``).

    Without SGLang's ``mega_moe`` module only ``run_sm90_mega_routed`` can run, and only on
    FP8 dispatch (sgl-deep-gemm's ``get_symm_buffer_for_mega_moe`` asserts it on SM90).
    """
    module = sys.modules.get(MEGA_MOE)
    derive = getattr(module, "_mega_moe_mma_type", None)
    return str(derive(experts)) if callable(derive) else "fp8xfp4"


def _refusal(site: SglangSite, experts: nn.Module, args: dict[str, Any]) -> str | None:
    """Why moewire cannot quantize this call (with the fix), or ``None``."""
    name = experts._moewire_name
    enabled = _enabled(experts)
    if not enabled:
        return None
    if args.get("routing_in_buffer"):
        return (
            f"{name}: SGLang's Mega-Gate (run_mega_gate) wrote the routing into the Mega-MoE "
            "buffer itself, and the tokens were staged without a call moewire can hook, so "
            f"{'/'.join(enabled)} would not run; serve with {ENV_MEGA_GATE}=0, or disable "
            "the quantizers of this layer"
        )
    hidden = args.get("hidden_states")
    tag = getattr(sys.modules.get(MEGA_MOE), "MEGA_MOE_INPUT_TAG", "_mega_moe_input_in_buffer")
    if getattr(hidden, tag, None) is not None:
        return (
            f"{name}: the op before this MoE (mega_moe_input_target) wrote x and its scales "
            "straight into the Mega-MoE buffer, so the dispatched tokens never pass a staging "
            f"call moewire can hook; serve with {ENV_MEGA_GATE}=0 (the fused input needs "
            "Mega-Gate), or disable the quantizers of this layer"
        )
    if os.environ.get(ENV_FP8_COMBINE, "0").strip() not in ("", "0"):
        return (
            f"{name}: {ENV_FP8_COMBINE}=1 makes sgl-deep-gemm's combine rows FP8 with one "
            "UE8M0 scale per 128 columns, and moewire reads BF16 combine rows only; unset "
            f"{ENV_FP8_COMBINE}, or disable the quantizers of this layer"
        )
    mma = _mma_type(experts)
    if mma not in site.mma_types:
        return (
            f"{name}: SGLang runs this layer with mma_type={mma!r}, which moewire does not "
            f"know for {site.path} (known: {', '.join(site.mma_types)}); use an FP8 "
            "(fp8xfp4) checkpoint for the layer, or disable its quantizers"
        )
    return None


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


def _refuse_post_norm(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fp8_fp4_mega_moe`` refusing ``post_expert_norm`` inside a quantized SGLang call."""
    if getattr(fn, "_moewire_post_norm_guard", False):
        return fn

    def fp8_fp4_mega_moe(*args: Any, **kwargs: Any) -> Any:
        from moewire.megamoe.active import ACTIVE

        module = ACTIVE.get()
        if module is not None and kwargs.get("post_expert_norm") and _enabled(module):
            raise RuntimeError(
                f"{module._moewire_name}: fp8_fp4_mega_moe was called with "
                "post_expert_norm=True: the combine RMS-normalises each expert row before "
                "summing, so the rows in the buffer are not what it adds; call it without "
                "post_expert_norm, or disable the quantizers of this layer"
            )
        return fn(*args, **kwargs)

    fp8_fp4_mega_moe._moewire_post_norm_guard = True  # type: ignore[attr-defined]
    fp8_fp4_mega_moe.__wrapped__ = fn  # type: ignore[attr-defined]
    return fp8_fp4_mega_moe


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


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The Mega-MoE experts modules of a loaded SGLang model (their mega weights built)."""
    return [(n, m) for n, m in model.named_modules()
            if getattr(m, "_mega_moe_weights_built", False)]


def quantize_sglang_model(model: nn.Module, recipe: Any, scales_path: str | None = None) -> int:
    """Quantize the Mega-MoE experts of a loaded SGLang model, then load scales if given.

    Args:
        model: ``ModelRunner.model`` after ``load_model``.
        recipe: a recipe name or path, or a loaded recipe.
        scales_path: a file saved after calibration (``{rank}``: the EP rank), or ``None``.

    Returns:
        The number of quantized experts modules.

    Raises:
        RuntimeError: no Mega-MoE experts (SGLang not run with ``--moe-a2a-backend
            megamoe``), or an SGLang without the sites moewire hooks.
    """
    from moewire.megamoe import api
    from moewire.megamoe.registry import register_experts_class

    found = experts_modules(model)
    if not found:
        raise RuntimeError(
            "moewire: the model has no Mega-MoE experts (no module with its Mega-MoE weights "
            "built); serve with --moe-a2a-backend megamoe"
        )
    adapter = install()
    for cls in {type(m) for _, m in found}:
        register_experts_class(cls, adapter)
    api.quantize(model, recipe)
    if scales_path:
        api.load_scales(model, rank_path(scales_path, _ep_rank()))
    return len(found)


def _ep_rank() -> int:
    group = _ep_group(None)  # type: ignore[arg-type]
    return group.rank() if group is not None else 0


def calibrating(model: nn.Module, scales_path: str) -> Any:
    """A context manager: calibrate inside it (run prompts), save the scales on exit.

    Run it before CUDA-graph capture (``--disable-cuda-graph``), as for vLLM: graphs
    captured before calibration replay without it.
    """
    from moewire.megamoe import api

    @contextlib.contextmanager
    def run() -> Any:
        with api.calibrating(model):
            yield model
        api.save_scales(model, rank_path(scales_path, _ep_rank()))

    return run()


def _after_load_model(result: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    count = quantize_sglang_model(runner.model, os.environ[ENV_RECIPE],
                                  os.environ.get(ENV_SCALES))
    logger.info("moewire: quantized %d Mega-MoE experts modules", count)
    return result


class SchedulerCalibration:
    """Calibration RPCs added to SGLang's ``Scheduler`` (``Engine.collective_rpc``).

    ``collective_rpc(method, **kwargs)`` calls ``getattr(scheduler, method)(**kwargs)`` in
    every scheduler process (``sglang/srt/managers/scheduler.py``, ``handle_rpc_request``),
    where the model is ``scheduler.tp_worker.model_runner.model``. Calibrate with CUDA
    graphs off (``disable_cuda_graph=True``): graphs captured before the quantizers existed
    replay without them.
    """

    def moewire_begin_calibration(self, recipe: Any) -> None:
        """Quantize the experts and put every quantizer in calibrate mode."""
        from moewire.megamoe import api

        model = self.tp_worker.model_runner.model  # type: ignore[attr-defined]
        quantize_sglang_model(model, recipe)
        begin_calibration(self, api.calibrating(model))

    def moewire_finish_calibration(self, scales_path: str) -> None:
        """Leave calibrate mode (amaxes max-reduced over the EP group), save the scales."""
        from moewire.megamoe import api

        finish_calibration(self, "call moewire_begin_calibration first")
        model = self.tp_worker.model_runner.model  # type: ignore[attr-defined]
        api.save_scales(model, rank_path(scales_path, _ep_rank()))


def calibrate(engine: Any, recipe: Any, prompts: list[str], scales_path: str) -> None:
    """Calibrate an ``sglang.Engine(..., disable_cuda_graph=True)`` and save the scales.

    Args:
        engine: the engine (its scheduler processes loaded moewire's plugin).
        recipe: recipe name or path.
        prompts: calibration prompts.
        scales_path: where each rank saves; ``{rank}`` is replaced by the EP rank.
    """
    engine.collective_rpc("moewire_begin_calibration", recipe=recipe)
    engine.generate(prompts, {"max_new_tokens": 1})
    engine.collective_rpc("moewire_finish_calibration", scales_path=scales_path)


def register() -> None:
    """SGLang general plugin (entry point ``sglang.srt.plugins: moewire``).

    SGLang loads it in every process (``load_plugins``). It adds the calibration RPCs
    (:class:`SchedulerCalibration`) to ``Scheduler``, and with ``MOEWIRE_RECIPE`` set
    registers an AFTER hook on ``ModelRunner.load_model`` (SGLang's ``HookRegistry``;
    ``load_plugins`` applies it) that quantizes the Mega-MoE experts once their weights are
    built, before warm-up and CUDA-graph capture, and loads ``MOEWIRE_SCALES`` when set.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    try:
        from sglang.srt.managers.scheduler import Scheduler
    except ImportError:  # a process without the scheduler (the tests load no scheduler)
        Scheduler = None  # noqa: N806
    if Scheduler is not None:
        for name in ("moewire_begin_calibration", "moewire_finish_calibration"):
            patches.patch_attr(Scheduler, name, getattr(SchedulerCalibration, name))
    if not os.environ.get(ENV_RECIPE):
        return
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model",
        _after_load_model,
        HookType.AFTER,
    )
