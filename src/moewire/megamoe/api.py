"""The user-facing calls: quantize, calibrate, save_scales, load_scales, summary."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moewire.megamoe.registry import adapter_for, registered_classes
from moewire.megamoe.wrapper import (
    QUANTIZER_NAMES,
    _module_device,
    amax_rows,
    convert,
    is_converted,
    kernel_rows,
    set_amax_rows,
)
from moewire.quantizer import WireQuantizer

__all__ = ["calibrate", "load_scales", "quantize", "quantizers", "save_scales", "summary"]

SCALES_VERSION = 1
_METADATA_KEY = "moewire_scales"


def _load_recipe(recipe: Any) -> Any:
    """A ``Recipe`` from a name, a path, a Recipe, ``{"quant_cfg": [...]}`` or a list."""
    from moewire import recipes

    if hasattr(recipe, "match"):
        return recipe
    if isinstance(recipe, (str, os.PathLike)):
        return recipes.load(recipe)
    if isinstance(recipe, Mapping):
        entries = recipe.get("quant_cfg")
        if not isinstance(entries, (list, tuple)):
            raise ValueError(
                "quantize: a dict recipe must be ModelOpt's list form {'quant_cfg': [{"
                "'quantizer_name': '*combine_quantizer', 'cfg': {...}}, ...]}; got keys "
                f"{sorted(map(str, recipe))} with quant_cfg of type {type(entries).__name__}"
            )
        return recipes.Recipe.from_entries(entries, name="quant_cfg")
    if isinstance(recipe, (list, tuple)):
        return recipes.Recipe.from_entries(recipe, name="entries")
    raise TypeError(
        f"quantize: recipe must be a recipe name, a YAML path, a Recipe, a dict "
        f"{{'quant_cfg': [...]}} or a list of entries, got {type(recipe).__name__}"
    )


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if adapter_for(m) is not None]


def _qualified(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr


def quantizers(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Module]]:
    """``(qualified name, experts module, quantizer)`` for every dispatch/combine quantizer
    of the model's converted experts modules, in module order."""
    for name, module in _experts_modules(model):
        if not is_converted(module):
            continue
        for attr in QUANTIZER_NAMES:
            yield _qualified(name, attr), module, getattr(module, attr)


def quantize(
    model: nn.Module, recipe: Any, forward_loop: Callable[[nn.Module], Any] | None = None
) -> nn.Module:
    """Attach dispatch/combine quantizers to every Mega-MoE experts module, and calibrate.

    Every module whose class has an experts adapter (the stand-in, vLLM's classes once
    ``moewire.integrations.vllm`` registered them) is converted in place. Each of its two
    quantizers is named ``<module path>.dispatch_quantizer`` / ``.combine_quantizer``
    (``"layers.3.experts.combine_quantizer"``) and configured from the recipe entry that
    matches that name (ModelOpt wildcard semantics, ``Recipe.match``); with no match it stays
    disabled. With ``forward_loop``, :func:`calibrate` runs it.

    Args:
        model: any ``nn.Module`` containing experts modules (or one itself).
        recipe: a recipe name or YAML path, a ``Recipe``, a ModelOpt-style dict
            ``{"quant_cfg": [...]}`` or a list of entries (``moewire.recipes.load``).
        forward_loop: ``forward_loop(model)`` runs calibration batches.

    Returns:
        ``model`` (converted in place).

    Raises:
        ValueError: the model has no experts module moewire knows.
    """
    targets = _experts_modules(model)
    if not targets:
        known = ", ".join(sorted(c.__qualname__ for c in registered_classes())) or "none"
        raise ValueError(
            f"quantize: {type(model).__name__} contains no Mega-MoE experts module moewire "
            f"knows (registered classes: {known}); register yours with "
            "moewire.megamoe.register_experts_class, or for vLLM load moewire's plugin"
        )
    rec = _load_recipe(recipe)
    for name, module in targets:
        convert(module, name or type(module).__name__)
        device = _module_device(module)
        for attr in QUANTIZER_NAMES:
            qualified = _qualified(name, attr)
            cfg = rec.match(qualified)
            quantizer = (
                WireQuantizer(enable=False, name=qualified)
                if cfg is None
                else WireQuantizer.from_cfg(cfg, name=qualified)
            )
            setattr(module, attr, quantizer.to(device))
    if forward_loop is not None:
        calibrate(model, forward_loop)
    return model


def calibrate(model: nn.Module, forward_loop: Callable[[nn.Module], Any]) -> nn.Module:
    """Calibrate every enabled quantizer (``max``), then max-reduce over each EP group.

    While ``forward_loop(model)`` runs, values pass through unquantized (ModelOpt's
    semantics); the combine quantizer sees only valid rows and the dispatch quantizer only
    tokens with at least one valid slot. Afterwards each quantizer's amax is max-reduced
    over its module's ``ep_group`` (the adapter's), in module order on every rank, also on a
    rank whose batches routed nothing.
    """
    active = [(n, m, q) for n, m, q in quantizers(model) if q.mode != "disabled"]
    with contextlib.ExitStack() as stack:
        for _, _, quantizer in active:
            if isinstance(quantizer, WireQuantizer):
                stack.enter_context(_collecting(quantizer))
            else:
                stack.enter_context(quantizer.calibrating())
        forward_loop(model)
    for _, module, quantizer in active:
        group = module._moewire_adapter.ep_group(module)
        if group is not None:
            quantizer.sync_amax(group)
        if (
            isinstance(quantizer, WireQuantizer)
            and quantizer.fmt.needs_amax
            and quantizer.constant_amax is None
        ):
            quantizer.load_calib_amax()
    return model


@contextlib.contextmanager
def _collecting(quantizer: WireQuantizer) -> Iterator[None]:
    """Calibrate mode without loading on exit: the amax is loaded after the EP reduction,
    so a rank that saw no data gets the group's max instead of a warning."""
    previous = quantizer.mode
    quantizer.reset_calibration()
    quantizer.mode = "calibrate"
    try:
        yield
    finally:
        quantizer.mode = previous


# -- scales on disk -----------------------------------------------------------------------------


def _format_name(quantizer: nn.Module) -> str | None:
    fmt = getattr(quantizer, "fmt", None)
    return None if fmt is None else fmt.name


def save_scales(model: nn.Module, path: str | Path) -> Path:
    """Save every dispatch/combine quantizer's fixed amax, keyed by its qualified name.

    ``*.safetensors``: one FP32 tensor per quantizer with an amax, plus a JSON metadata
    entry ``moewire_scales`` with each quantizer's format and whether it has an amax. Any
    other suffix: JSON ``{"moewire_scales": 1, "quantizers": {name: {"format", "shape",
    "amax"}}}`` (amax as a list of floats, exact for FP32; ``null`` without one).

    Returns:
        The path written.
    """
    path = Path(path)
    entries: dict[str, dict[str, Any]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, module, quantizer in quantizers(model):
        amax = quantizer.static_amax
        entry: dict[str, Any] = {"format": _format_name(quantizer), "shape": None, "amax": None}
        if name.endswith("combine_quantizer"):
            # Which kernel's rows the amax describes (nvfp4_mega_moe: unweighted).
            entry["rows"] = amax_rows(module)
        if amax is not None:
            amax = amax.detach().float().cpu().contiguous()
            entry["shape"] = list(amax.shape)
            tensors[name] = amax
            entry["amax"] = amax.reshape(-1).tolist()
        entries[name] = entry
    if not entries:
        raise ValueError(
            f"save_scales: {type(model).__name__} has no quantized Mega-MoE experts module; "
            "run moewire.quantize(model, recipe) first"
        )
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        meta = {
            n: {k: v for k, v in e.items() if k != "amax"} for n, e in entries.items()
        }
        header = json.dumps({"version": SCALES_VERSION, "quantizers": meta})
        save_file(tensors, str(path), metadata={_METADATA_KEY: header})
    else:
        path.write_text(
            json.dumps({_METADATA_KEY: SCALES_VERSION, "quantizers": entries}, indent=1)
        )
    return path


def _read_rows_tags(path: Path) -> dict[str, str | None]:
    """The ``rows`` entry of each saved combine quantizer (absent in older files: None)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            entries = json.loads((f.metadata() or {})[_METADATA_KEY])["quantizers"]
    else:
        entries = json.loads(path.read_text())["quantizers"]
    return {name: entry.get("rows") for name, entry in entries.items()}


def _read_scales(path: Path) -> dict[str, tuple[str | None, torch.Tensor | None]]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            header = (f.metadata() or {}).get(_METADATA_KEY)
            if header is None:
                raise ValueError(
                    f"load_scales: {path} has no '{_METADATA_KEY}' metadata; it was not "
                    "written by moewire.save_scales"
                )
            meta = json.loads(header)["quantizers"]
            stored = set(f.keys())
            return {
                n: (e["format"], f.get_tensor(n) if n in stored else None) for n, e in meta.items()
            }
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"load_scales: {path} is not JSON ({exc})") from exc
    if not isinstance(data, dict) or _METADATA_KEY not in data:
        raise ValueError(
            f"load_scales: {path} has no '{_METADATA_KEY}' key; it was not written by "
            "moewire.save_scales"
        )
    out = {}
    for name, entry in data["quantizers"].items():
        amax = None
        if entry.get("amax") is not None:
            amax = torch.tensor(entry["amax"], dtype=torch.float32).reshape(entry["shape"])
        out[name] = (entry.get("format"), amax)
    return out


def load_scales(model: nn.Module, path: str | Path) -> list[str]:
    """Load amax values saved by :func:`save_scales` into the model's quantizers.

    Everything is validated before anything is set: the file and the model must name the
    same quantizers, with the same format, and each saved amax must be one finite value
    >= 0 of the quantizer's amax shape.

    Returns:
        The qualified names whose amax was set, in module order.

    Raises:
        ValueError: a quantizer missing on either side, a format or shape mismatch, or a
            file moewire did not write.
    """
    path = Path(path)
    saved = _read_scales(path)
    present = {name: q for name, _, q in quantizers(model)}
    missing_in_model = sorted(set(saved) - set(present))
    if missing_in_model:
        raise ValueError(
            f"load_scales: {path} has scales for {missing_in_model[:4]} but the model has no "
            f"such module (its quantizers: {sorted(present)[:4]}...); load into the model the "
            "scales were saved from, quantized with the same recipe"
        )
    missing_in_file = sorted(set(present) - set(saved))
    if missing_in_file:
        raise ValueError(
            f"load_scales: the model's quantizers {missing_in_file[:4]} are not in {path}; "
            "save the scales of this model (moewire.save_scales) or quantize it like the "
            "saved one"
        )
    rows_tags = _read_rows_tags(path)
    modules = {name: module for name, module, _ in quantizers(model)}
    updates = []
    for name, quantizer in present.items():
        fmt, amax = saved[name]
        tag = rows_tags.get(name)
        seen = kernel_rows(modules[name])
        if tag is not None and seen is not None and tag != seen:
            raise ValueError(
                f"load_scales: {name} in {path} was calibrated on {tag} combine rows, but this "
                f"model's kernel leaves {seen} rows (nvfp4_mega_moe's rows are unweighted "
                "expert outputs, fp8_fp4_mega_moe's router-weighted): the amaxes are not "
                "interchangeable; calibrate this model or load scales saved from the same kernel"
            )
        current = _format_name(quantizer)
        if fmt != current:
            raise ValueError(
                f"load_scales: {name} was saved with format {fmt!r} but is {current!r}"
                " in the model; quantize with the recipe the scales were calibrated for"
            )
        if amax is None:
            continue
        if tuple(amax.shape) != ():
            raise ValueError(
                f"load_scales: {name} has a saved amax of shape {list(amax.shape)}; a wire "
                "quantizer's amax is one value (shape [])"
            )
        value = float(amax)
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"load_scales: {name} has a saved amax {value}; it must be finite >= 0"
            )
        constant = getattr(quantizer, "constant_amax", None)
        if constant is not None and value != constant:
            raise ValueError(
                f"load_scales: {name} has constant_amax={constant} in the model and "
                f"amax={value} in {path}; drop constant_amax from the recipe to load "
                "calibrated scales"
            )
        updates.append((name, quantizer, amax))
    for _, quantizer, amax in updates:
        quantizer.load_amax(amax)
    for name, tag in rows_tags.items():
        if tag is not None and name in modules:
            set_amax_rows(modules[name], tag)
    return [name for name, _, _ in updates]


def summary(model: nn.Module) -> str:
    """One line per dispatch/combine quantizer: name, format, mode, amax (and where it
    came from: calibrated, constant, loaded), and whether its scale is static (row-local)
    or computed per call."""
    lines = []
    for name, _, q in quantizers(model):
        amax = q.static_amax
        amax_text = "none" if amax is None else f"{float(amax):.6g}"
        source = getattr(q, "amax_source", None)
        if amax is not None and source:
            amax_text += f" ({source})"
        scale = "static" if q.is_static_scale() else "per-call"
        lines.append(
            f"{name}: format={_format_name(q)} mode={q.mode} amax={amax_text} scale={scale}"
        )
    if not lines:
        return "no quantized Mega-MoE experts modules"
    return "\n".join(lines)
