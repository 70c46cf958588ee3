"""moewire in SGLang's Mega-MoE path (``--moe-a2a-backend megamoe``).

Where SGLang runs its Mega-MoE experts is one declarative entry per site in
:mod:`moewire.integrations.sglang.sites`; the package derives the rest: the trampolines the
sites are rebound to and the experts adapter that names them (``trampolines``), the paths
moewire cannot see, refused with the fix (``refusals``), and a loaded model quantized and
calibrated (``quantize``). SGLang's Mega-MoE paths with no site entry (FlashInfer, FlyDSL,
Muse Spark) are one entry each in :mod:`moewire.integrations.sglang.paths`, refused at load.

This module is the glue SGLang loads. :func:`register` is SGLang's general plugin (entry
point ``sglang.srt.plugins``): with ``MOEWIRE_RECIPE`` set, it quantizes every Mega-MoE
experts module right after ``ModelRunner.load_model`` and loads ``MOEWIRE_SCALES`` when set;
:class:`SchedulerCalibration` and :func:`calibrate` are the calibration RPCs and their
driver side.
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
from moewire.integrations.sglang.paths import OTHER_PATHS
from moewire.integrations.sglang.quantize import (
    _ep_rank,
    calibrating,
    experts_modules,
    quantize_sglang_model,
)
from moewire.integrations.sglang.refusals import ENV_FP8_COMBINE, ENV_MEGA_GATE
from moewire.integrations.sglang.sites import MEGA_MOE, SITES
from moewire.integrations.sglang.sites import recognise as recognise_site
from moewire.integrations.sglang.trampolines import STAGE_GLOBAL, install

__all__ = [
    "ENV_FP8_COMBINE", "ENV_MEGA_GATE", "ENV_RECIPE", "ENV_SCALES", "MEGA_MOE", "OTHER_PATHS",
    "SITES",
    "STAGE_GLOBAL", "SchedulerCalibration", "calibrate", "calibrating", "experts_modules",
    "install", "quantize_sglang_model", "recognise_site", "register",
]

logger = logging.getLogger(__name__)


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
