"""A loaded vLLM model's Mega-MoE experts quantized (:func:`quantize_vllm_model`): what the
plugin's loader hook and the worker extension's RPCs run in every worker.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moewire.integrations._host import rank_path
from moewire.integrations.vllm import bridge
from moewire.integrations.vllm.groups import ep_rank
from moewire.integrations.vllm.registration import _register_found, _register_subclasses
from moewire.integrations.vllm.sites import ExpertsSite

__all__ = ["quantize_vllm_model"]


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
    count = sum(any(_holds(m, cls, site) for cls, site in found) for m in model.modules())
    if count == 0:
        raise RuntimeError(
            f"moewire: the model has none of the Mega-MoE experts classes "
            f"{[cls.__qualname__ for cls, _ in found]}; serve with --moe-backend "
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


def _holds(module: nn.Module, cls: type, site: ExpertsSite) -> bool:
    """Whether ``module`` is an experts module of ``site``: an instance of ``cls``, or for
    an experts object that is no ``nn.Module`` (``site.holder``) the layer holding one."""
    return isinstance(site.experts_of(module), cls)


def _refuse_sites(model: nn.Module, found: list[tuple[type, ExpertsSite]]) -> None:
    """Refuse a model holding an experts class that moewire recognises but refuses
    (``ExpertsSite.refusal``), before any module is converted: the class's instances, and
    for a ``site.holder`` site the layers holding one."""
    for name, module in model.named_modules():
        for cls, site in found:
            if site.refusal is not None and _holds(module, cls, site):
                raise RuntimeError(
                    f"moewire: {name or type(module).__name__} is a {site.path}, which "
                    f"moewire does not quantize: {site.refusal}"
                )
