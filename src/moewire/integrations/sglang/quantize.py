"""A loaded SGLang model's Mega-MoE experts quantized (:func:`quantize_sglang_model`), and
calibrated around prompts (:func:`calibrating`).
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from moewire.integrations._host import rank_path
from moewire.integrations.sglang.paths import refuse_other_paths
from moewire.integrations.sglang.trampolines import _ep_group, install

__all__ = ["calibrating", "experts_modules", "quantize_sglang_model"]


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
        RuntimeError: a module runs on a Mega-MoE path with no site entry (FlashInfer,
            FlyDSL, Muse Spark, or one moewire has not read:
            :mod:`moewire.integrations.sglang.paths`), no Mega-MoE experts (SGLang not run
            with ``--moe-a2a-backend megamoe``), or an SGLang without the sites moewire hooks.
    """
    from moewire.megamoe import api
    from moewire.megamoe.registry import register_experts_class

    refuse_other_paths(model)
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
