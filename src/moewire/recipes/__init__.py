"""Named quantization recipes: YAML units and presets, in ModelOpt's ``quant_cfg`` syntax.

A recipe file is a YAML mapping with up to three keys:

- ``description``: one line for people;
- ``units``: names of other recipes whose entries come first, in this order (presets are
  built this way; a name resolves to a file next to this one, else a packaged recipe);
- ``quant_cfg``: a list of entries ``{quantizer_name: "*dispatch_quantizer", cfg: {...},
  enable: true}``. ``quantizer_name`` is an ``fnmatch`` wildcard on the quantizer's
  qualified name (``layers.3.experts.dispatch_quantizer``); ``cfg`` is a quantizer cfg
  (``moewire.config.parse_cfg``: ``num_bits`` as a list ``[4, 3]``, ``block_sizes``,
  ``axis``, ``constant_amax``, ``enable``, or moewire's ``format``); an entry needs
  ``cfg``, ``enable`` or both.

Matching follows ModelOpt's ``quant_cfg`` order: every matching entry is applied in turn, so
later entries win. An entry with a ``cfg`` replaces the quantizer's attributes (and
enables it unless ``enable: false``); an entry with only ``enable`` switches it on or off
and keeps the attributes set before.

Every cfg is validated when the file is loaded; an error names the file and line.
"""

from __future__ import annotations

import fnmatch
import importlib.resources
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from moewire import formats
from moewire.config import USE_CONSTANT_AMAX, CfgError, modelopt_table, parse_cfg

__all__ = ["Recipe", "RecipeEntry", "load", "names", "to_modelopt"]

_TOP_KEYS = ("description", "units", "quant_cfg")
_ENTRY_KEYS = ("quantizer_name", "cfg", "enable")
# ModelOpt's own entry key: it selects quantizers by their module's class (nn.BatchNorm1d...),
# which a wire quantizer never has; accepted in ModelOpt cfg dicts only.
_MODELOPT_ENTRY_KEYS = (*_ENTRY_KEYS, "parent_class")
_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class RecipeEntry:
    """One ``quant_cfg`` entry.

    Attributes:
        quantizer_name: ``fnmatch`` wildcard on quantizer qualified names.
        cfg: the quantizer cfg (validated), or ``None`` for an enable-only entry.
        enable: the entry's ``enable``, or ``None`` when it does not set one.
        source: ``"<file>:<line>"`` where the entry was written (``"<list>"`` otherwise).
        parent_class: ModelOpt's ``parent_class`` (the entry then matches no wire
            quantizer), or ``None``.
        error: why ``cfg`` has no moewire format, for an entry of a ModelOpt cfg dict whose
            check waits until it matches a wire quantizer (``Recipe.from_entries(...,
            modelopt=True)``); ``None`` when the cfg is valid.
    """

    quantizer_name: str
    cfg: Mapping[str, Any] | None = None
    enable: bool | None = None
    source: str = "<list>"
    parent_class: str | None = None
    error: str | None = None

    def matches(self, name: str) -> bool:
        """Whether ``name`` matches the wildcard (case-sensitive ``fnmatch``); an entry
        with a ``parent_class`` matches no wire quantizer."""
        return self.parent_class is None and fnmatch.fnmatchcase(name, self.quantizer_name)


@dataclass(frozen=True)
class Recipe:
    """A loaded recipe: its name and its entries, units expanded in order."""

    name: str
    entries: tuple[RecipeEntry, ...]
    description: str = ""
    path: str | None = None
    units: tuple[str, ...] = field(default=())

    def match(self, quantizer_name: str) -> dict[str, Any] | None:
        """The cfg the recipe gives the quantizer ``quantizer_name``, or ``None``.

        Entries are applied in order (later ones win, as in ModelOpt): a ``cfg`` entry
        replaces the attributes, an enable-only entry keeps them and sets ``enable``.

        Args:
            quantizer_name: qualified name, e.g. ``"layers.3.experts.combine_quantizer"``.

        Returns:
            A cfg for ``WireQuantizer.from_cfg`` with ``enable`` always set, or ``None``
            when no entry matches.

        Raises:
            ValueError: a matching entry's cfg has no moewire format (an entry of a ModelOpt
                cfg dict, checked only now), or an enable-only entry turns the quantizer on
                with no earlier cfg; the message names the quantizer and the entry.
        """
        result: dict[str, Any] | None = None
        configured = False
        for entry in self.entries:
            if not entry.matches(quantizer_name):
                continue
            if entry.error is not None:
                raise ValueError(f"{entry.source}: {entry.quantizer_name}: matches the wire "
                                 f"quantizer {quantizer_name}, and {entry.error}")
            if entry.cfg is None and entry.enable and not configured:
                raise ValueError(
                    f"{entry.source}: {entry.quantizer_name}: enables the wire quantizer "
                    f"{quantizer_name}, but no earlier entry gave it a cfg, so it has no "
                    "format; put an entry with a cfg (e.g. {quantizer_name: "
                    "'*combine_quantizer', cfg: {format: nvfp4}}) before it"
                )
            if entry.cfg is not None:
                configured = True
                result = dict(entry.cfg)
                result["enable"] = entry.enable if entry.enable is not None else bool(
                    entry.cfg.get("enable", True))
            else:
                result = dict(result or {})
                result["enable"] = entry.enable
        return result

    @classmethod
    def from_entries(cls, entries: Iterable[Mapping[str, Any]], name: str = "custom", *,
                     modelopt: bool = False) -> Recipe:
        """A recipe from Python dicts (``{"quantizer_name": ..., "cfg": ...}``), validated.

        Args:
            entries: the ``quant_cfg`` list.
            name: the recipe's name, used in messages (``"<name>[<index>]"``).
            modelopt: the entries come from a ModelOpt cfg dict, whose entries mostly target
                ModelOpt's own quantizers (``*weight_quantizer``, cfgs with
                ``effective_bits`` or lists of cfgs): a cfg moewire cannot map is then
                refused only if the entry matches a wire quantizer (in :meth:`match`), and
                entries with ModelOpt's ``parent_class`` (quantizers of modules of that
                class, which a wire quantizer never is) match nothing.

        Raises:
            ValueError: an entry or cfg is malformed; the message names the entry index.
        """
        if isinstance(entries, (str, bytes, Mapping)) or not isinstance(entries, Iterable):
            raise TypeError(f"{name}: the entries must be a list of dicts "
                            f"{{'quantizer_name': ..., 'cfg': ...}}, got {type(entries).__name__}")
        built = []
        for index, raw in enumerate(entries):
            where = f"{name}[{index}]"
            built.append(_entry(raw, where, lambda _key, where=where: where, defer=modelopt))
        if not built:
            raise ValueError(f"{name}: the recipe has no entries, so it would quantize nothing; "
                             "give at least one {'quantizer_name': ..., 'cfg': ...}")
        return cls(name=name, entries=tuple(built))


# -- loading -----------------------------------------------------------------------------


def _packaged() -> dict[str, Any]:
    root = importlib.resources.files(__name__)
    return {
        item.name.rsplit(".", 1)[0]: item
        for item in root.iterdir()
        if item.is_file() and item.name.endswith(_SUFFIXES)
    }


def names() -> list[str]:
    """Names of the packaged recipes (units and presets), sorted."""
    return sorted(_packaged())


def load(name_or_path: str | os.PathLike) -> Recipe:
    """Load a packaged recipe by name, or a recipe file by path.

    Args:
        name_or_path: a name from :func:`names` (``"moe_nvfp4"``) or a path to a
            ``.yaml``/``.yml`` file.

    Returns:
        The :class:`Recipe`, with every unit's entries expanded in order.

    Raises:
        ValueError: unknown name, missing file, bad YAML, unknown key, bad cfg or a cycle of
            units; the message names the file and line and says how to fix it.
    """
    return _load(name_or_path, stack=())


def _resolve(name_or_path: str | os.PathLike, base: Path | None) -> tuple[str, Any]:
    text = os.fspath(name_or_path)
    looks_like_path = text.endswith(_SUFFIXES) or os.sep in text or "/" in text
    if looks_like_path:
        path = Path(text)
        if base is not None and not path.is_absolute():
            path = base / path
        if not path.is_file():
            raise ValueError(f"recipe file {str(path)!r} does not exist")
        return str(path), path
    if base is not None:
        for suffix in _SUFFIXES:
            sibling = base / f"{text}{suffix}"
            if sibling.is_file():
                return str(sibling), sibling
    packaged = _packaged()
    if text not in packaged:
        raise ValueError(
            f"unknown recipe {text!r}; packaged recipes: {', '.join(sorted(packaged))} "
            "(or pass a path to a .yaml file)"
        )
    return str(packaged[text]), packaged[text]


def _load(name_or_path: str | os.PathLike, stack: tuple[str, ...], base: Path | None = None
          ) -> Recipe:
    where, resource = _resolve(name_or_path, base)
    if where in stack:
        chain = " -> ".join((*stack, where))
        raise ValueError(f"recipe units form a cycle: {chain}; remove one of the units")
    try:
        text = resource.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = resource.read_bytes()[: err.start].count(b"\n") + 1
        raise ValueError(
            f"{where}:{line}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
            f"{err.start}); save the recipe as UTF-8"
        ) from None
    except OSError as err:
        raise ValueError(f"{where}: cannot read the recipe ({err.strerror or err})") from None
    name = resource.name.rsplit(".", 1)[0]
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{where}{line}: not valid YAML: {err.problem}") from None
    except yaml.reader.ReaderError as err:  # a control character such as NUL
        line = text[: err.position].count("\n") + 1
        char = chr(err.character) if isinstance(err.character, int) else err.character
        raise ValueError(
            f"{where}:{line}: not valid YAML: the character {char!r} at offset "
            f"{err.position} is not allowed (a binary or corrupted file?); remove it"
        ) from None
    if node is None:
        raise ValueError(f"{where}:1: the recipe is empty; give quant_cfg entries or units")
    base_dir = Path(where).parent if isinstance(resource, Path) else None
    return _recipe(node, name, where, (*stack, where), base_dir)


def _line(where: str, node: yaml.Node) -> str:
    return f"{where}:{node.start_mark.line + 1}"


def _pairs(node: yaml.MappingNode, where: str) -> list[tuple[Any, yaml.Node, yaml.Node]]:
    """``(key, key node, value node)`` of a mapping node; duplicate keys are refused."""
    loader = yaml.SafeLoader("")
    seen: dict[Any, yaml.Node] = {}
    pairs = []
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise ValueError(
                f"{_line(where, key_node)}: the key {key!r} appears twice (first at line "
                f"{seen[key].start_mark.line + 1}); keep one"
            )
        seen[key] = key_node
        pairs.append((key, key_node, value_node))
    return pairs


def _value(node: yaml.Node) -> Any:
    return yaml.SafeLoader("").construct_object(node, deep=True)


def _recipe(node: yaml.Node, name: str, where: str, stack: tuple[str, ...],
            base: Path | None) -> Recipe:
    if isinstance(node, yaml.SequenceNode):
        entries_node, units_node, description = node, None, ""
    elif isinstance(node, yaml.MappingNode):
        entries_node = units_node = None
        description = ""
        for key, key_node, value_node in _pairs(node, where):
            if key not in _TOP_KEYS:
                raise ValueError(
                    f"{_line(where, key_node)}: unknown recipe key {key!r}; a recipe has "
                    f"{', '.join(_TOP_KEYS)}"
                )
            if key == "quant_cfg":
                entries_node = value_node
            elif key == "units":
                units_node = value_node
            else:
                description = _value(value_node)
                if not isinstance(description, str):
                    raise ValueError(f"{_line(where, value_node)}: description must be text")
    else:
        raise ValueError(
            f"{_line(where, node)}: a recipe is a mapping with quant_cfg/units (or a list of "
            "entries), got a scalar"
        )
    entries: list[RecipeEntry] = []
    units: list[str] = []
    if units_node is not None:
        if not isinstance(units_node, yaml.SequenceNode):
            raise ValueError(f"{_line(where, units_node)}: units must be a list of recipe names")
        for unit_node in units_node.value:
            unit = _value(unit_node)
            if not isinstance(unit, str):
                raise ValueError(f"{_line(where, unit_node)}: a unit is a recipe name, got "
                                 f"{unit!r}")
            try:
                loaded = _load(unit, stack, base)
            except ValueError as err:
                raise ValueError(f"{_line(where, unit_node)}: unit {unit!r}: {err}") from None
            units.append(loaded.name)
            entries.extend(loaded.entries)
    if entries_node is not None:
        if not isinstance(entries_node, yaml.SequenceNode):
            raise ValueError(
                f"{_line(where, entries_node)}: quant_cfg must be a list of entries "
                "({quantizer_name: ..., cfg: ...})"
            )
        for entry_node in entries_node.value:
            entries.append(_node_entry(entry_node, where))
    if not entries:
        raise ValueError(f"{_line(where, node)}: the recipe has no entries; add quant_cfg or "
                         "units")
    return Recipe(name=name, entries=tuple(entries), description=description, path=where,
                  units=tuple(units))


def _node_entry(node: yaml.Node, where: str) -> RecipeEntry:
    if not isinstance(node, yaml.MappingNode):
        raise ValueError(
            f"{_line(where, node)}: a quant_cfg entry is a mapping "
            "{quantizer_name: ..., cfg: ...}"
        )
    marks: dict[tuple[Any, ...], yaml.Node] = {(): node}
    for key, key_node, value_node in _pairs(node, where):
        marks[(key,)] = key_node
        if key == "cfg" and isinstance(value_node, yaml.MappingNode):
            marks[("cfg",)] = value_node
            for sub, sub_key_node, sub_value_node in _pairs(value_node, where):
                marks[("cfg", sub)] = sub_key_node
                if isinstance(sub_value_node, yaml.MappingNode):
                    for deep, deep_key_node, _ in _pairs(sub_value_node, where):
                        marks[("cfg", sub, deep)] = deep_key_node

    def locate(key: tuple[Any, ...]) -> str:
        while key not in marks:
            key = key[:-1]
        return _line(where, marks[key])

    return _entry(_value(node), where, locate)


def _entry(raw: Any, where: str, locate: Any, defer: bool = False) -> RecipeEntry:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{locate(())}: a quant_cfg entry is a mapping, got {raw!r}")
    accepted = _MODELOPT_ENTRY_KEYS if defer else _ENTRY_KEYS
    for key in raw:
        if key not in accepted:
            raise ValueError(
                f"{locate((key,))}: unknown entry key {key!r}; an entry has "
                f"{', '.join(accepted)}"
            )
    pattern = raw.get("quantizer_name")
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(
            f"{locate(('quantizer_name',))}: quantizer_name must be a wildcard such as "
            f"'*dispatch_quantizer', got {pattern!r}"
        )
    enable = raw.get("enable")
    if enable is not None and not isinstance(enable, bool):
        raise ValueError(f"{locate(('enable',))}: {pattern}: enable must be true or false, got "
                         f"{enable!r}")
    parent_class = raw.get("parent_class")
    if parent_class is not None and not isinstance(parent_class, str):
        raise ValueError(f"{locate(('parent_class',))}: {pattern}: parent_class must be a class "
                         f"name such as 'nn.Linear', got {parent_class!r}")
    cfg = raw.get("cfg")
    if cfg is None and enable is None:
        raise ValueError(f"{locate(())}: {pattern}: the entry needs cfg, enable or both")
    error = None
    if cfg is not None:
        try:
            if not isinstance(cfg, Mapping):
                raise CfgError(f"cfg must be a mapping, got {type(cfg).__name__}: {cfg!r}")
            checked = dict(cfg)
            if enable is not None:
                checked["enable"] = enable
            parse_cfg(checked)
        except CfgError as err:
            if not defer:
                raise ValueError(f"{locate(('cfg', *err.key))}: {pattern}: {err}") from None
            error = str(err)
    return RecipeEntry(
        quantizer_name=pattern,
        cfg=cfg,
        enable=enable,
        source=locate(()),
        parent_class=parent_class,
        error=error,
    )


# -- ModelOpt ----------------------------------------------------------------------------

# moewire-only cfg keys: ``format`` is respelled in ModelOpt's attributes; ``allow_dynamic``
# has no ModelOpt counterpart (an uncalibrated ModelOpt quantizer is dynamic).
_MOEWIRE_ONLY_KEYS = ("format", "allow_dynamic")


def _to_modelopt_cfg(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    spec = parse_cfg(cfg)
    out = {k: v for k, v in cfg.items() if k not in _MOEWIRE_ONLY_KEYS and k not in (
        "num_bits", "block_sizes", "axis")}
    if out.pop("use_constant_amax", False):
        # The same amax, in the key ModelOpt's experts quantizers take (ModelOpt keeps
        # use_constant_amax for its KV-cache quantizers).
        out["constant_amax"] = USE_CONSTANT_AMAX
    if not spec.enable and "num_bits" not in cfg and "format" not in cfg:
        return out
    spelled = formats.get(spec.fmt).modelopt_cfg()
    if spelled is None:
        raise ValueError(
            f"to_modelopt: {where} uses format {spec.fmt!r}, which ModelOpt cannot spell "
            "(no num_bits/block_sizes/axis for it); use moewire.quantize for this recipe, or "
            f"pick a format with a ModelOpt spelling ({', '.join(modelopt_table().values())})"
        )
    return {**spelled, **out}


def to_modelopt(name_or_path: str | os.PathLike) -> list[dict[str, Any]]:
    """A recipe as ModelOpt's ``quant_cfg`` list (for ``mtq.quantize``).

    ``units`` are expanded in order; each entry keeps ``quantizer_name`` and ``enable``; its
    ``cfg`` is written in ModelOpt's attribute names only: ``format`` becomes ``num_bits``
    / ``block_sizes`` / ``axis`` (tuples, as ModelOpt writes them), ``allow_dynamic`` is
    dropped, ``constant_amax`` and ``enable`` stay, ``use_constant_amax: true`` becomes
    ``constant_amax: 448.0`` (the same amax; moewire's ModelOpt quantizers take that key). With
    ``moewire.integrations.modelopt.register()`` done, ``mtq.quantize(model, {"quant_cfg":
    [*other_entries, *to_modelopt(name)], "algorithm": "max"}, forward_loop)`` configures
    the experts' ``dispatch_quantizer`` / ``combine_quantizer`` as ``moewire.quantize(model,
    name, forward_loop)`` does.

    Args:
        name_or_path: a packaged recipe name or a recipe file (:func:`load`).

    Returns:
        ``[{"quantizer_name": ..., "cfg": {...}, "enable": ...}, ...]``, fresh dicts.

    Raises:
        ValueError: the recipe does not load (see :func:`load`), or an entry enables a
            format ModelOpt has no spelling for (``logfmt10``, ``fp8_b32_ue8m0``, ``bf16``).
    """
    recipe = load(name_or_path)
    entries = []
    for entry in recipe.entries:
        out: dict[str, Any] = {"quantizer_name": entry.quantizer_name}
        if entry.cfg is not None:
            out["cfg"] = _to_modelopt_cfg(entry.cfg, entry.source)
        if entry.enable is not None:
            out["enable"] = entry.enable
        entries.append(out)
    return entries
