"""A loaded recipe: its ``quant_cfg`` entries, each validated, and how they match a quantizer.

The entries come from a YAML file (:mod:`moewire.recipes.loading`) or from Python dicts
(:meth:`Recipe.from_entries`); either way :func:`_entry` checks each one.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moewire.quantizer.config import CfgError, parse_cfg

__all__ = ["Recipe", "RecipeEntry"]

_ENTRY_KEYS = ("quantizer_name", "cfg", "enable")
# ModelOpt's own entry key: it selects quantizers by their module's class (nn.BatchNorm1d...),
# which a wire quantizer never has; accepted in ModelOpt cfg dicts only.
_MODELOPT_ENTRY_KEYS = (*_ENTRY_KEYS, "parent_class")


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

