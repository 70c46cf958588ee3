"""Scales files under the serving engines' names: :func:`serving_name` maps a transformers
experts name to vLLM's or SGLang's, :func:`save_scales` writes one file for a model on one
rank or under expert parallelism (docs/eval.md).

May import: the standard library, torch, ``moewire.megamoe`` and this package's
``architectures`` and ``ep``.
"""

from __future__ import annotations

import re
from pathlib import Path

from torch import nn

from moewire.integrations.transformers import ep
from moewire.integrations.transformers.architectures import architecture_of
from moewire.megamoe import api
from moewire.megamoe.scales_file import read_scales, write_scales

__all__ = ["save_scales", "save_serving_scales", "serving_name"]

_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts(\.(?:dispatch|combine)_quantizer)?$")


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(
            f"{type(model).__name__} has no config.model_type; pass a transformers model"
        )
    return model_type


def serving_name(name: str, model_type: str, host: str) -> str:
    """The serving engine's name for a transformers experts module or quantizer name.

    ``serving_name("model.layers.3.mlp.experts.combine_quantizer", "deepseek_v4", "vllm")``
    is ``"model.layers.3.ffn.experts.combine_quantizer"``.

    Args:
        name: ``model.layers.N.mlp.experts`` with an optional ``.dispatch_quantizer`` /
            ``.combine_quantizer``.
        model_type: the transformers ``config.model_type``.
        host: ``"vllm"`` or ``"sglang"``.

    Raises:
        ValueError: an unknown host, architecture or name shape, or a family the host has
            no path for.
    """
    if host not in ("vllm", "sglang"):
        raise ValueError(f"serving_name: host must be 'vllm' or 'sglang', got {host!r}")
    arch = architecture_of(model_type)
    match = _NAME.match(name)
    if match is None:
        raise ValueError(
            f"serving_name: {name!r} is not a transformers experts name "
            "(model.layers.N.mlp.experts[.dispatch_quantizer|.combine_quantizer])"
        )
    template = getattr(arch, host)
    if template is None:
        raise ValueError(f"serving_name: {host} has no experts path for {model_type}")
    return template.format(n=match.group(1)) + (match.group(2) or "")


def save_serving_scales(model: nn.Module, path: str | Path, host: str) -> Path:
    """:func:`moewire.save_scales` with every name mapped to ``host``'s (:func:`serving_name`),
    so the file loads into the engine's experts modules.

    Returns:
        ``path``.
    """
    path = Path(path)
    model_type = _model_type(model)
    api.save_scales(model, path)
    scales = read_scales(path)
    return write_scales(path, {serving_name(n, model_type, host): s for n, s in scales.items()})


def save_scales(model: nn.Module, path: str | Path, host: str | None = None) -> Path:
    """One scales file for a model on one rank or under expert parallelism: every rank calls
    it, rank 0 writes, every rank returns once the file exists.

    Under a process group the amaxes must agree on every rank (calibration reduced them over
    the EP and DP groups, :mod:`.ep`), which is checked first; the file is then the one a
    one-rank run writes, loadable by every rank of a serving engine.

    Args:
        model: the quantized (calibrated) model.
        path: the scales file (``.json``, ``.safetensors`` or ``.pt``).
        host: ``"vllm"`` or ``"sglang"`` to write the engine's module names
            (:func:`save_serving_scales`), ``None`` for transformers' names.

    Returns:
        ``path``.

    Raises:
        RuntimeError: an amax differs between ranks (the message names the quantizers); on
            ranks other than 0, rank 0 could not write the file (the message names its
            cause).
        ValueError: what :func:`moewire.save_scales` refuses (on rank 0, any error of the
            writer is raised as it is).
    """
    import torch.distributed as dist

    path = Path(path)
    differ = ep.ranks_agree(model)
    if differ:
        raise RuntimeError(
            f"save_scales: the amax of {differ[:4]}{' ...' if len(differ) > 4 else ''} differs "
            "between ranks: the model was calibrated without reducing over the EP and DP "
            "groups; calibrate with moewire.quantize / moewire.calibrate after prepare(model), "
            "which records the groups"
        )
    distributed = dist.is_available() and dist.is_initialized()
    error: Exception | None = None
    if not distributed or dist.get_rank() == 0:
        try:
            if host is None:
                api.save_scales(model, path)
            else:
                save_serving_scales(model, path, host)
            if not path.is_file():
                raise OSError(f"save_scales: the writer returned but {path} does not exist")
        # Any failure, not only the refusals: a rank 0 that left before the broadcast below
        # would keep every other rank waiting until the process group times out.
        except Exception as exc:
            error = exc
    if distributed:
        # Every rank learns whether rank 0 wrote the file, and why not: no rank returns the
        # path of a file that does not exist.
        cause = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(cause, src=0)
        if cause[0] is not None and error is None:
            raise RuntimeError(
                f"save_scales: rank 0 could not write {path}: {cause[0]}; fix that cause "
                "(rank 0's traceback shows it) and call save_scales again on every rank"
            )
    if error is not None:
        raise error
    return path
