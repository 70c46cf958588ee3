"""The user-facing calls: quantize, calibrate (calibrating), save_scales, load_scales, summary."""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import inspect
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from moewire.formats.base import amax_is_valid
from moewire.megamoe import layout_check
from moewire.megamoe.convert import (
    _module_device,
    convert,
    is_converted,
    refuse_unconvert,
    unconvert,
)
from moewire.megamoe.quant_experts import (
    QUANTIZER_NAMES,
    QuantExperts,
    amax_rows,
    kernel_rows,
    set_amax_rows,
)
from moewire.megamoe.registry import adapter_for, registered_classes
from moewire.megamoe.scales_file import (
    LAYER_KEYS,
    Scale,
    read_scales,
    scales_path,
    write_scales,
)
from moewire.quantizer import WireQuantizer
from moewire.quantizer.contract import WireQuantizerLike, calibration

__all__ = ["calibrate", "calibrating", "load_scales", "quantize", "quantizers", "save_scales",
           "summary", "unquantize"]



def _load_recipe(recipe: Any) -> Any:
    """A ``Recipe`` from a name, a path, a Recipe, ``{"quant_cfg": [...]}`` or a list.

    The dict and list forms are ModelOpt's: ``algorithm`` and entries with
    ``parent_class`` do not apply to wire quantizers, and a cfg moewire cannot map is
    refused only when its entry matches a wire quantizer.
    """
    from moewire import recipes

    if isinstance(recipe, recipes.Recipe):
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
        return recipes.Recipe.from_entries(entries, name="quant_cfg", modelopt=True)
    if isinstance(recipe, (list, tuple)):
        return recipes.Recipe.from_entries(recipe, name="entries", modelopt=True)
    raise TypeError(
        f"quantize: recipe must be a recipe name, a YAML path, a Recipe, a dict "
        f"{{'quant_cfg': [...]}} or a list of entries, got {type(recipe).__name__}"
    )


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if adapter_for(m) is not None]


def _qualified(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr


def quantizers(model: nn.Module) -> Iterator[tuple[str, QuantExperts, WireQuantizerLike]]:
    """``(qualified name, experts module, quantizer)`` for every dispatch/combine quantizer
    of the model's converted experts modules, in module order."""
    for name, module in _experts_modules(model):
        if not is_converted(module):
            continue
        for attr in QUANTIZER_NAMES:
            yield _qualified(name, attr), module, getattr(module, attr)


def quantize(
    model: nn.Module,
    recipe: Any,
    forward_loop: Callable[[nn.Module], Any] | None = None,
    *,
    keep_scales: bool = True,
) -> nn.Module:
    """Attach dispatch/combine quantizers to every Mega-MoE experts module, and calibrate.

    Every module whose class has an experts adapter (the stand-in, vLLM's classes once
    ``moewire.integrations.vllm`` registered them) is converted in place. Each of its two
    quantizers is named ``<module path>.dispatch_quantizer`` / ``.combine_quantizer``
    (``"layers.3.experts.combine_quantizer"``) and configured from the recipe entry that
    matches that name (ModelOpt wildcard semantics, ``Recipe.match``); with no match it stays
    disabled. With ``forward_loop``, :func:`calibrate` runs it.

    On a model that is already quantized (by ``quantize``, ``mtq.quantize`` or followed by
    ``load_scales``), a quantizer that keeps its format keeps its calibrated or loaded amax
    (unless the recipe gives a ``constant_amax``). Where the format changes and the new
    one needs an amax, the old amax cannot apply: the call is refused unless
    ``forward_loop`` calibrates anew or ``keep_scales=False`` says the amax may go.

    Every check runs before the model is touched: a refused call changes nothing.

    Args:
        model: any ``nn.Module`` containing experts modules (or one itself).
        recipe: a recipe name or YAML path, a ``Recipe``, a ModelOpt-style dict
            ``{"quant_cfg": [...]}`` or a list of entries (``moewire.recipes.load``).
        forward_loop: ``forward_loop(model)`` runs calibration batches.
        keep_scales: keep the amax of quantizers already calibrated or loaded (see above);
            ``False`` starts every quantizer afresh.

    Returns:
        ``model`` (converted in place).

    Raises:
        ValueError: the model has no experts module moewire knows; no recipe entry matches
            any of its quantizers (the message lists their names); a matching entry's cfg
            has no moewire format; an amax would be lost (see above).
        TypeError: ``forward_loop`` is not callable or ``keep_scales`` is not a bool.
    """
    if forward_loop is not None:
        _check_forward_loop(forward_loop, "quantize")
    if not isinstance(keep_scales, bool):
        raise TypeError(f"quantize: keep_scales must be True or False, got {keep_scales!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize: model must be an nn.Module, got {type(model).__name__}")
    targets = _experts_modules(model)
    if not targets:
        known = ", ".join(sorted(c.__qualname__ for c in registered_classes())) or "none"
        raise ValueError(
            f"quantize: {type(model).__name__} contains no Mega-MoE experts module moewire "
            f"knows (registered classes: {known}); register yours with "
            "moewire.megamoe.register_experts_class, or for vLLM load moewire's plugin"
        )
    rec = _load_recipe(recipe)
    # Plan every quantizer first: a refusal below leaves the model as it was.
    plan: list[tuple[str, nn.Module, str, WireQuantizer]] = []
    matched = []
    for name, module in targets:
        device = _module_device(module)
        for attr in QUANTIZER_NAMES:
            qualified = _qualified(name, attr)
            cfg = rec.match(qualified)
            if cfg is None:
                quantizer = WireQuantizer(enable=False, name=qualified)
            else:
                matched.append(qualified)
                try:
                    quantizer = WireQuantizer.from_cfg(cfg, name=qualified)
                except ValueError as err:
                    raise ValueError(f"quantize: {qualified}: {err}") from None
            old = getattr(module, attr, None) if is_converted(module) else None
            if old is not None and keep_scales:
                _keep_amax(old, quantizer, qualified, calibrating=forward_loop is not None)
            plan.append((name, module, attr, quantizer.to(device)))
    if not matched:
        names = [_qualified(n, a) for n, _ in targets for a in QUANTIZER_NAMES]
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
        patterns = ", ".join(repr(e.quantizer_name) for e in rec.entries[:6])
        raise ValueError(
            f"quantize: no entry of the recipe {rec.name!r} ({patterns}) matches any wire "
            f"quantizer of {type(model).__name__}, so nothing would be quantized; its "
            f"quantizers are: {shown}. Match them with wildcards such as "
            "'*dispatch_quantizer' and '*combine_quantizer' (names are case-sensitive)"
        )
    _refuse_unmatched_entries(rec, [_qualified(n, a) for n, _ in targets for a in QUANTIZER_NAMES],
                              type(model).__name__,
                              modelopt_form=isinstance(recipe, (Mapping, list, tuple)))
    for name, module, attr, quantizer in plan:
        convert(module, name or type(module).__name__)
        setattr(module, attr, quantizer)
    if forward_loop is not None:
        calibrate(model, forward_loop)
    return model


def _aims_at_wire(pattern: str) -> bool:
    """Whether a ModelOpt cfg entry's pattern is meant for a wire quantizer: the word
    before ``_quantizer`` is close to ``dispatch`` or ``combine`` (a typo such as
    ``*combin_quantizer`` is), not one of ModelOpt's own (``input``, ``weight``, ...)."""
    word = pattern.rsplit(".", 1)[-1].strip("*?[]").lower().removesuffix("_quantizer")
    return any(difflib.SequenceMatcher(None, word, target).ratio() >= 0.6
               for target in ("dispatch", "combine"))


def _refuse_unmatched_entries(rec: Any, names: list[str], model: str, *,
                              modelopt_form: bool) -> None:
    """Refuse a recipe entry that can match no wire quantizer: a mistyped pattern
    (``*combin_quantizer``) would otherwise leave its quantizer disabled without a word.

    An entry is refused when it matches none of the model's quantizers ``names`` and its
    last dotted part matches neither ``dispatch_quantizer`` nor ``combine_quantizer``. An
    entry for one layer that this model lacks (``layers.7.experts.combine_quantizer`` on a
    pipeline stage holding other layers) passes. In a ModelOpt cfg (a dict or list),
    entries for ModelOpt's own quantizers are expected and pass; only a pattern aimed at a
    wire quantizer (:func:`_aims_at_wire`) is checked.
    """
    for entry in rec.entries:
        if entry.parent_class is not None or any(entry.matches(n) for n in names):
            continue
        tail = entry.quantizer_name.rsplit(".", 1)[-1]
        if any(fnmatch.fnmatchcase(attr, tail) for attr in QUANTIZER_NAMES):
            continue
        if modelopt_form and not _aims_at_wire(entry.quantizer_name):
            continue
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6
                                        else "")
        raise ValueError(
            f"quantize: the recipe entry {entry.quantizer_name!r} ({entry.source}) matches no "
            f"wire quantizer of {model}, so it would configure nothing; its quantizers are: "
            f"{shown}. Fix the pattern (e.g. '*dispatch_quantizer', '*combine_quantizer'; "
            "names are case-sensitive) or drop the entry"
        )


def unquantize(model: nn.Module) -> nn.Module:
    """Undo :func:`quantize`: every converted experts module gets its original class back
    and loses its two quantizers; once no converted module remains in the process, every
    global, namespace, module class and loader moewire patched is restored
    (:mod:`moewire.patches`). The model then runs bit for bit as one never quantized.

    Every check runs before the model is touched: a refused call changes nothing.

    Args:
        model: a model quantized by :func:`quantize` (or one experts module).

    Returns:
        ``model``, unquantized in place.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; a module was converted by ModelOpt's
            ``mtq.quantize`` (moewire cannot undo ModelOpt's class swap).
        ValueError: the model has no quantized experts module (nothing to undo: calling
            this on a model never quantized is a mistake, e.g. the wrong model).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"unquantize: model must be an nn.Module, got {type(model).__name__}")
    converted = [(name, m) for name, m in model.named_modules() if is_converted(m)]
    if not converted:
        raise ValueError(
            f"unquantize: {type(model).__name__} has no experts module quantized by "
            "moewire, so there is nothing to undo; pass the model moewire.quantize returned"
        )
    for name, module in converted:
        refuse_unconvert(module, name or None)
    for name, module in converted:
        unconvert(module, name or None)
    return model


def _keep_amax(old: WireQuantizerLike, new: WireQuantizer, name: str, calibrating: bool) -> None:
    """Carry ``old``'s calibrated or loaded amax over to ``new`` (same format), or refuse
    when the new format needs an amax that nothing would give it."""
    amax = old.static_amax
    source = old.amax_source or "calibrated"
    if amax is None or source == "constant" or old.constant_amax is not None:
        return
    if not new.fmt.needs_amax or new.constant_amax is not None:
        return
    if _format_name(old) == new.fmt.name:
        new.load_amax(amax.detach())
        new.amax_source = source
        return
    if calibrating or new.mode == "disabled":
        return
    raise ValueError(
        f"quantize: {name} is already quantized as {_format_name(old)!r} with a {source} "
        f"amax ({float(amax):.6g}), and the recipe makes it {new.fmt.name!r}, which needs "
        "its own amax: without one it would use a per-call amax. To re-quantize on "
        "purpose, pass forward_loop= to calibrate the new format, or keep_scales=False to "
        "drop the old amax"
    )


def calibrating(
    model: nn.Module, *, extra_groups: Sequence[Any] = ()
) -> contextlib.AbstractContextManager[None]:
    """The calibration context of a quantized model (``moewire.quantizer.calibration``).

    Inside, every enabled quantizer collects while values pass through unquantized
    (ModelOpt's semantics); the combine quantizer sees only valid rows and the dispatch
    quantizer only tokens with at least one valid slot. On exit each quantizer's collected
    max is max-reduced over its module's ``ep_group`` and ``dp_groups`` (the adapter's), then
    over each of ``extra_groups`` (vLLM's data-parallel group, as ModelOpt syncs over DP and EP), in
    module order on every rank, also on a rank whose batches routed nothing; then it
    becomes the amax. The context may span calls (``ExitStack.enter_context`` ...
    ``close()``), as the two calibration RPCs of a vLLM worker do.

    Args:
        model: a model converted by :func:`quantize`.
        extra_groups: more process groups to max-reduce every amax over (``None`` entries
            and groups of one rank are skipped).
    """
    return calibration(
        (q, (module._moewire_adapter.ep_group(module),
             *module._moewire_adapter.dp_groups(module), *extra_groups))
        for _, module, q in quantizers(model)
    )


def calibrate(
    model: nn.Module,
    forward_loop: Callable[[nn.Module], Any],
    *,
    extra_groups: Sequence[Any] = (),
) -> nn.Module:
    """Run ``forward_loop(model)`` inside :func:`calibrating`: collect, sync, load.

    Args:
        model: a model converted by :func:`quantize`.
        forward_loop: ``forward_loop(model)`` runs the calibration batches.
        extra_groups: more process groups to max-reduce every amax over (see
            :func:`calibrating`).

    Returns:
        ``model``.

    Raises:
        ValueError: ``model`` has no moewire quantizer: nothing would be calibrated.
    """
    _check_forward_loop(forward_loop, "calibrate")
    if next(quantizers(model), None) is None:
        raise ValueError(
            f"calibrate: {type(model).__name__} has no moewire quantizer (no experts module of "
            "it is quantized), so there is nothing to calibrate; call moewire.quantize(model, "
            "recipe, forward_loop) first, which calibrates as well"
        )
    with calibrating(model, extra_groups=extra_groups):
        forward_loop(model)
    return model


def _check_forward_loop(forward_loop: Any, caller: str) -> None:
    """Refuse a ``forward_loop`` that cannot be called as ``forward_loop(model)``."""
    if not callable(forward_loop):
        raise TypeError(f"{caller}: forward_loop must be callable (forward_loop(model)), got "
                        f"{type(forward_loop).__name__}")
    try:
        signature = inspect.signature(forward_loop)
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    try:
        signature.bind(object())
    except TypeError:
        raise TypeError(
            f"{caller}: forward_loop{signature} cannot be called with the model; moewire "
            "calls forward_loop(model) once: define it as def forward_loop(model): ... and run "
            "the calibration batches through model"
        ) from None


# -- scales on disk -----------------------------------------------------------------------------


def _format_name(quantizer: WireQuantizerLike) -> str | None:
    return None if quantizer.fmt is None else quantizer.fmt.name


def _lacks_needed_amax(quantizer: WireQuantizerLike) -> bool:
    """Enabled, with a format that needs an amax, and neither a constant nor a fixed one:
    such a quantizer would fall back to a per-call amax."""
    needs = quantizer.fmt is not None and quantizer.fmt.needs_amax
    return (
        needs
        and quantizer.mode != "disabled"
        and quantizer.constant_amax is None
        and quantizer.static_amax is None
    )


def layer_shape(module: nn.Module) -> dict[str, int] | None:
    """``{"num_experts", "hidden", "top_k"}`` of an experts module, as a scales file records
    it, or ``None`` when the module does not carry them (DeepGEMM's and the stand-in's
    experts do: ``num_experts``, ``hidden``, ``top_k``)."""
    values: list[Any] = [getattr(module, key, None) for key in LAYER_KEYS]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return None
    return dict(zip(LAYER_KEYS, values, strict=True))


def _shape_text(shape: Mapping[str, int]) -> str:
    return f"E={shape['num_experts']} H={shape['hidden']} k={shape['top_k']}"


def save_scales(model: nn.Module, path: str | Path) -> Path:
    """Save every dispatch/combine quantizer's fixed amax, keyed by its qualified name.

    The file's encoding follows its suffix (``.safetensors``, ``.json`` or ``.pt``,
    :mod:`moewire.megamoe.scales_file`); each record names the layer shape
    (:func:`layer_shape`) that :func:`load_scales` checks.

    Returns:
        The path written.

    Raises:
        ValueError: the model has no quantized experts module; an enabled quantizer whose
            format needs an amax has none (the model was never calibrated: the file would
            be refused by every ``load_scales``); the suffix is not one of the three; the
            directory does not exist. Nothing is written then.
        TypeError: ``path`` is not a str or path.
    """
    path = scales_path(path, "save_scales")
    scales: dict[str, Scale] = {}
    uncalibrated = []
    for name, module, quantizer in quantizers(model):
        if _lacks_needed_amax(quantizer):
            uncalibrated.append(name)
        # Which kernel's rows a combine amax describes (nvfp4_mega_moe: unweighted).
        combine = name.endswith("combine_quantizer")
        scales[name] = Scale(
            _format_name(quantizer), quantizer.static_amax,
            amax_rows(module) if combine else None, combine, layer_shape(module),
        )
    if not scales:
        raise ValueError(
            f"save_scales: {type(model).__name__} has no quantized Mega-MoE experts module; "
            "run moewire.quantize(model, recipe) first"
        )
    if uncalibrated:
        raise ValueError(
            f"save_scales: {uncalibrated[:6]}"
            f"{f' ({len(uncalibrated)} in all)' if len(uncalibrated) > 6 else ''} are enabled "
            "and their format needs an amax, but they have none: the model was never "
            "calibrated, and no server could load these scales. Run "
            "moewire.calibrate(model, forward_loop) (or moewire.quantize(model, recipe, "
            f"forward_loop=...)) first, then save_scales; nothing was written to {path}"
        )
    return write_scales(path, scales)


def load_scales(model: nn.Module, path: str | Path, *, allow_extra: bool = False) -> list[str]:
    """Load amax values saved by :func:`save_scales` into the model's quantizers.

    Everything is validated before anything is set, so a refused file leaves the model as
    it was: the file must be one ``save_scales`` writes (its version, keys and types; an
    amax is FP32 ``[]``, finite, >= 0), every quantizer of the model must be in it with the
    same format, every enabled quantizer whose format needs an amax (and has no
    ``constant_amax``) must get one, and the file must name no quantizer the model lacks.

    Args:
        model: the quantized model.
        path: a ``.safetensors`` or JSON file from :func:`save_scales`.
        allow_extra: accept (and skip) quantizers in the file that the model does not have,
            e.g. scales of a whole model loaded into one of its layers.

    Returns:
        The qualified names whose amax was set, in module order.

    Raises:
        ValueError: naming the file and what is wrong: unreadable, truncated or malformed,
            wrong version or dtype, a quantizer missing on either side, an enabled
            quantizer left without an amax, a format or amax shape mismatch, or a layer
            shape (experts, hidden size, top-k) other than the one the file records.
        TypeError: ``path`` is not a str or path.
    """
    path = scales_path(path, "load_scales")
    if not isinstance(allow_extra, bool):
        raise TypeError(f"load_scales: allow_extra must be True or False, got {allow_extra!r}")
    present = {name: q for name, _, q in quantizers(model)}
    if not present:
        raise ValueError(
            f"load_scales: {type(model).__name__} has no quantized Mega-MoE experts module; "
            f"run moewire.quantize(model, recipe) before loading {path}"
        )
    saved = read_scales(path)
    missing_in_model = sorted(set(saved) - set(present))
    if missing_in_model and not allow_extra:
        raise ValueError(
            f"load_scales: {path} has scales for {missing_in_model[:4]} but the model has no "
            f"such module (its quantizers: {sorted(present)[:4]}...); load into the model the "
            "scales were saved from, quantized with the same recipe, or pass "
            "allow_extra=True to skip them"
        )
    missing_in_file = sorted(set(present) - set(saved))
    if missing_in_file:
        raise ValueError(
            f"load_scales: the model's quantizers {missing_in_file[:4]} are not in {path}; "
            "save the scales of this model (moewire.save_scales) or quantize it like the "
            "saved one"
        )
    modules = {name: module for name, module, _ in quantizers(model)}
    updates, uncovered = [], []
    for name, quantizer in present.items():
        fmt, amax, tag, _, shape = saved[name]
        here = layer_shape(modules[name])
        if shape is not None and here is not None and dict(shape) != here:
            raise ValueError(
                f"load_scales: {name} in {path} was calibrated on a layer of "
                f"{_shape_text(shape)}, but this model's is {_shape_text(here)}: an amax "
                "describes the rows of one layer shape; load the scales saved from this "
                "model, or calibrate it (moewire.calibrate)"
            )
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
                f"load_scales: {path}: {name} was saved with format {fmt!r} but is "
                f"{current!r} in the model; quantize with the recipe the scales were "
                "calibrated for"
            )
        if amax is None:
            needs = quantizer.fmt is not None and quantizer.fmt.needs_amax
            if needs and quantizer.mode != "disabled" and quantizer.constant_amax is None:
                uncovered.append(name)
            continue
        if tuple(amax.shape) != ():
            raise ValueError(
                f"load_scales: {path}: {name} has a saved amax of shape {list(amax.shape)}; a "
                "wire quantizer's amax is one value (shape [])"
            )
        value = float(amax)
        if not amax_is_valid(value):
            raise ValueError(
                f"load_scales: {path}: {name} has a saved amax {value}; it must be finite >= 0"
            )
        constant = quantizer.constant_amax
        if constant is not None and value != constant:
            raise ValueError(
                f"load_scales: {name} has constant_amax={constant} in the model and "
                f"amax={value} in {path}; drop constant_amax from the recipe to load "
                "calibrated scales"
            )
        updates.append((name, quantizer, amax))
    if uncovered:
        raise ValueError(
            f"load_scales: {path} holds no amax for {uncovered[:6]}"
            f"{f' ({len(uncovered)} in all)' if len(uncovered) > 6 else ''}, which are "
            "enabled and need one (without it they would use a per-call amax); calibrate "
            "them before save_scales, set constant_amax in the recipe, or disable them"
        )
    for _, quantizer, amax in updates:
        quantizer.load_amax(amax)
    for name, scale in saved.items():
        if scale.rows is not None and name in modules:
            set_amax_rows(modules[name], scale.rows)
    return [name for name, _, _ in updates]


def _unproven_layout(module: nn.Module) -> tuple[str, ...]:
    """The readings of ``module``'s buffer that its layout check has not yet ruled out;
    empty before its first call and once checked. A buffer the adapter cannot give now (a
    host's buffer not yet allocated, or refused under ``DG_COMM_KERNEL_DEBUG``, which its
    next forward reports) has no proof to report either."""
    adapter = getattr(module, "_moewire_adapter", None)
    try:
        buffer = None if adapter is None else adapter.get_symm_buffer(module)
    except (AttributeError, RuntimeError):
        return ()
    return () if buffer is None else layout_check.unproven_readings(buffer)


def summary(model: nn.Module) -> str:
    """One line per dispatch/combine quantizer: name, format, mode, amax (and where it
    came from: calibrated, constant, loaded), and whether its scale is static (row-local)
    or computed per call. An experts module whose buffer's layout proof is still open (a
    fused shared row whose readings no batch has yet told apart) adds a line naming them."""
    lines = []
    for name, module in _experts_modules(model):
        if is_converted(module):
            open_readings = _unproven_layout(module)
            if open_readings:
                lines.append(
                    f"{name}: layout proof open (each eager batch is checked until its rows "
                    f"tell these apart): {', '.join(open_readings)}"
                )
    for name, _, q in quantizers(model):
        amax = q.static_amax
        amax_text = "none" if amax is None else f"{float(amax):.6g}"
        source = q.amax_source
        if amax is not None and source:
            amax_text += f" ({source})"
        scale = "static" if q.is_static_scale() else "per-call"
        lines.append(
            f"{name}: format={_format_name(q)} mode={q.mode} amax={amax_text} scale={scale}"
        )
    if not lines:
        return "no quantized Mega-MoE experts modules"
    return "\n".join(lines)
