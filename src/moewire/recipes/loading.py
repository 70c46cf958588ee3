"""Recipe files: a packaged name or a path to a YAML file, its units expanded in order, every
entry checked with the file and line it was written at (the package docstring has the format).
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Any

import yaml

from moewire.recipes.recipe import Recipe, RecipeEntry, _entry

__all__ = ["load", "names"]

_TOP_KEYS = ("description", "units", "quant_cfg")
_SUFFIXES = (".yaml", ".yml")


def _packaged() -> dict[str, Any]:
    root = importlib.resources.files("moewire.recipes")
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

