"""moewire in vLLM's native Mega-MoE path (``--moe-backend deep_gemm_mega_moe``).

Where vLLM keeps its Mega-MoE experts is one declarative entry per site in
:mod:`moewire.integrations.vllm.sites` (``SITES``; docs/vllm.md has the table). The package
derives everything from those entries: discovery by structure (``discovery``:
:func:`experts_sites`, never a version), the bridge (``bridge``: vLLM's
``_import_deep_gemm()`` and each staging global made globals of one module, which the
experts adapters name), the adapters (``registration``: :func:`register_site`) and a loaded
model quantized (``quantize``). Forwards that stage inline (no staging global) are hooked on
the DeepGEMM module object: its staging cast and its kernels. Nothing of vLLM's forward is
copied. The CPU stand-ins the tests run vLLM's classes on live in ``tests/vllm/``.

This module is the glue vLLM loads: the general plugin (:func:`register`) and the worker
extension with its driver side (:class:`MoewireWorkerExtension`, :func:`calibrate`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from moewire import patches
from moewire.integrations._host import (
    ENV_RECIPE,
    ENV_SCALES,
    begin_calibration,
    finish_calibration,
    rank_path,
)
from moewire.integrations.vllm.discovery import experts_sites, vllm_version
from moewire.integrations.vllm.groups import data_parallel, ep_rank
from moewire.integrations.vllm.quantize import quantize_vllm_model
from moewire.integrations.vllm.registration import (
    kernel_flavour,
    register_site,
    register_vllm_experts,
)
from moewire.integrations.vllm.sites import (
    KERNEL_ACCESS,
    NVFP4_STAGE_FN,
    SITES,
    STAGE_FN,
    ExpertsSite,
    recognise,
)

__all__ = [
    "ENV_RECIPE", "ENV_SCALES", "KERNEL_ACCESS", "NVFP4_STAGE_FN", "SITES", "STAGE_FN",
    "ExpertsSite", "MoewireWorkerExtension", "calibrate", "experts_sites", "kernel_flavour",
    "quantize_vllm_model", "recognise", "register", "register_site", "register_vllm_experts",
    "vllm_version",
]

logger = logging.getLogger(__name__)


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
        if not self.vllm_config.model_config.enforce_eager:  # type: ignore[attr-defined]
            raise RuntimeError(
                "moewire_begin_calibration: the engine captured CUDA graphs before the "
                "quantizers existed; replays would skip them. Calibrate with LLM(..., "
                "enforce_eager=True)"
            )
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
