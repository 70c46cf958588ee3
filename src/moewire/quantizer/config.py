"""Quantizer config: ModelOpt-style cfg dicts mapped to wire formats (:func:`parse_cfg`).

A cfg is what one recipe entry (``moewire.recipes``) or one ModelOpt ``quant_cfg`` entry
holds: ModelOpt's attribute names (``num_bits``, ``block_sizes``, ``axis``,
``constant_amax``, ``use_constant_amax``, ``enable``) plus moewire's ``format`` and
``allow_dynamic``. Which attributes name which format is declared by each format
(``WireFormat.modelopt_spelling``); :func:`modelopt_table` reads them from the registry,
so a new format with a spelling is accepted here without a change to this module.

Parsing a cfg is not the quantizer's state: the quantizer's modules read this one, and
nothing here reads them.

May import: torch and ``moewire.formats``; nothing else of moewire.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moewire import formats

__all__ = ["CFG_KEYS", "USE_CONSTANT_AMAX", "CfgError", "QuantizerSpec", "modelopt_table",
           "parse_cfg"]

#: Keys a quantizer cfg may hold: ModelOpt's attribute names plus moewire's own
#: ``format`` and ``allow_dynamic``.
CFG_KEYS = ("num_bits", "block_sizes", "axis", "constant_amax", "use_constant_amax", "enable",
            "format", "allow_dynamic", "accumulate")
#: The amax ModelOpt's ``use_constant_amax: true`` pins (the FP8 E4M3 maximum).
USE_CONSTANT_AMAX = 448.0

_BLOCK_KEYS = (-1, "type", "scale_bits")
_FP32_MAX = float(torch.finfo(torch.float32).max)
_FP32_TINY = float(torch.finfo(torch.float32).smallest_normal)
_NAMED_BITS = {"e4m3": (4, 3), "e2m1": (2, 1), "e8m0": (8, 0)}
_PER_TOKEN_AXES = (0, -2)

#: A cfg's ModelOpt attributes, normalised: (num_bits, block size along the last dim,
#: block scale_bits, ``"tensor"`` or ``"token"``).
Spelling = tuple[tuple[int, int], int | None, tuple[int, int] | None, str]


def modelopt_table() -> dict[Spelling, str]:
    """Every registered format's ModelOpt spelling, normalised, mapped to the format name."""
    table = {}
    for name in formats.names():
        fmt = formats.get(name)
        spelling = fmt.modelopt_spelling
        if spelling is not None:
            axis = "tensor" if spelling.axis is None else "token"
            table[(spelling.num_bits, fmt.block_size, spelling.scale_bits, axis)] = name
    return table


def _describe_table(table: dict[Spelling, str]) -> str:
    lines = []
    for (bits, block, scale_bits, axis), name in table.items():
        parts = [f"num_bits: {list(bits)}"]
        if block is not None:
            blocks = f"{{-1: {block}, type: dynamic"
            if scale_bits is not None:
                blocks += f", scale_bits: {list(scale_bits)}"
            parts.append(f"block_sizes: {blocks}}}")
        if axis == "token":
            parts.append("axis: 0")
        lines.append(f"{', '.join(parts)} -> {name}")
    return "; ".join(lines)


class CfgError(ValueError):
    """A quantizer cfg moewire cannot map; ``key`` is the path of the offending key.

    ``key`` is a tuple such as ``("num_bits",)`` or ``("block_sizes", "scale_bits")``
    (empty when the cfg as a whole is wrong), so a recipe loader can point at the line.
    """

    def __init__(self, message: str, key: tuple[Any, ...] = ()) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class QuantizerSpec:
    """What a cfg maps to: the :class:`WireQuantizer` constructor arguments."""

    fmt: str
    constant_amax: float | None = None
    enable: bool = True
    allow_dynamic: bool = True
    accumulate: str | None = None


def _bits(value: Any, key: tuple[Any, ...]) -> tuple[int, int]:
    if isinstance(value, str) and value.lower() in _NAMED_BITS:
        return _NAMED_BITS[value.lower()]
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return (value[0], value[1])
    if isinstance(value, int) and not isinstance(value, bool):
        raise CfgError(
            f"{'.'.join(map(str, key))}={value!r} is integer quantization, which no moewire "
            "wire format implements; use a float format, e.g. num_bits: [4, 3] (FP8 E4M3) "
            "or [2, 1] (FP4 E2M1)",
            key,
        )
    raise CfgError(
        f"{'.'.join(map(str, key))}={value!r} is not a pair (exponent bits, mantissa "
        "bits); write it as a list, e.g. [4, 3] for E4M3, [2, 1] for E2M1, [8, 0] for E8M0",
        key,
    )


def _blocks(value: Any) -> tuple[int | None, tuple[int, int] | None]:
    if value is None:
        return None, None
    if not isinstance(value, Mapping):
        raise CfgError(
            f"block_sizes={value!r} must be a mapping such as "
            "{-1: 16, type: dynamic, scale_bits: [4, 3]}",
            ("block_sizes",),
        )
    for key in value:
        if key not in _BLOCK_KEYS:
            raise CfgError(
                f"block_sizes has the key {key!r}; moewire's blocks run along the last dim "
                f"only, so the accepted keys are {list(_BLOCK_KEYS)}",
                ("block_sizes", key),
            )
    size = value.get(-1)
    if not isinstance(size, int) or isinstance(size, bool):
        raise CfgError(
            f"block_sizes[-1]={size!r}: give the block size along the last dim as an "
            "integer (16 for NVFP4, 32 for MX, 128 for FP8 1x128)",
            ("block_sizes", -1),
        )
    kind = value.get("type")
    if kind != "dynamic":
        raise CfgError(
            f"block_sizes type={kind!r}: moewire's block scales are computed from each block "
            "(ModelOpt's 'dynamic'); set type: dynamic",
            ("block_sizes", "type"),
        )
    scale_bits = value.get("scale_bits")
    if scale_bits is not None:
        scale_bits = _bits(scale_bits, ("block_sizes", "scale_bits"))
    return size, scale_bits


def _axis(value: Any) -> str:
    if value is None:
        return "tensor"
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if isinstance(value, int) and not isinstance(value, bool) and value in _PER_TOKEN_AXES:
        return "token"
    raise CfgError(
        f"axis={value!r} has no moewire format: moewire takes axis: null (one amax per "
        "tensor) or a per-token axis (0 or -2: one scale per row, NVFP4 only -> nvfp4_token); "
        "per-channel amax (axis: -1) is not a wire format",
        ("axis",),
    )


def positive_amax(value: Any, key: tuple[Any, ...]) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CfgError(
            f"{key[0]}={value!r} must be a number, e.g. constant_amax: 2688.0", key
        )
    amax = float(value)
    if not math.isfinite(amax) or amax <= 0:
        raise CfgError(
            f"{key[0]}={amax!r} must be finite and > 0 (2688.0 = 6 * 448 makes the NVFP4 "
            "global scale 1)",
            key,
        )
    # The amax is an FP32 buffer: a value FP32 rounds to inf or to 0 would be stored as
    # something else than what was asked for.
    if not _FP32_TINY <= amax <= _FP32_MAX:
        raise CfgError(
            f"{key[0]}={amax!r} is outside FP32's range [{_FP32_TINY:.4g}, {_FP32_MAX:.4g}] "
            "(the amax is stored in FP32); give a value in that range, e.g. 2688.0",
            key,
        )
    return amax


def _flag(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise CfgError(f"{key}={value!r} must be true or false", (key,))
    return value


def parse_cfg(cfg: Mapping[str, Any]) -> QuantizerSpec:
    """Map a ModelOpt-style quantizer cfg to a moewire format and options.

    Accepted keys (:data:`CFG_KEYS`): ``num_bits``, ``block_sizes``, ``axis``,
    ``constant_amax``, ``use_constant_amax``, ``enable`` (ModelOpt's attribute names), and
    moewire's own ``format`` (a registered format name), ``allow_dynamic`` and
    ``accumulate`` (``bf16`` or ``fp32``: how the combine adds the dequantized rows; absent,
    the format's ``combine_accumulate``). ``use_constant_amax: true`` pins the amax to 448.0
    (:data:`USE_CONSTANT_AMAX`, ModelOpt's FP8 E4M3 range), i.e. ``constant_amax: 448.0``;
    the two keys are mutually exclusive, as in ModelOpt.

    ``num_bits``/``block_sizes``/``axis`` name the format whose ``modelopt_spelling`` they
    spell (:func:`modelopt_table`; docs/recipes.md lists the built-in ones): ``num_bits`` and
    ``scale_bits`` are pairs (a tuple, or a list in YAML) or the names ``"e4m3"``,
    ``"e2m1"``, ``"e8m0"``; ``block_sizes`` is ``{-1: size, type: dynamic, scale_bits: ...}``;
    ``axis`` is ``None`` or a per-token ``0``/``-2``. A format without a spelling
    (``fp8_b32_ue8m0``, ``logfmt10``, ``bf16``) is named with ``format``. ``format`` together
    with ``num_bits`` must name the same format. A cfg with ``enable: false`` and no format
    maps to ``bf16`` (disabled; identity if enabled later).

    Args:
        cfg: the cfg mapping (one recipe entry's ``cfg``).

    Returns:
        The :class:`QuantizerSpec` (format name, ``constant_amax``, ``enable``,
        ``allow_dynamic``).

    Raises:
        CfgError: (a ``ValueError``) an unknown key, a value of the wrong type, a
            combination with no moewire format, ``constant_amax`` on a format without a
            global amax, or an unregistered format; ``.key`` names the offending key.
    """
    if not isinstance(cfg, Mapping):
        raise CfgError(f"a quantizer cfg must be a mapping, got {type(cfg).__name__}: {cfg!r}")
    for key in cfg:
        if key not in CFG_KEYS:
            raise CfgError(
                f"unknown cfg key {key!r}; accepted keys: {', '.join(CFG_KEYS)}", (key,)
            )
    enable = _flag(cfg, "enable", True)
    allow_dynamic = _flag(cfg, "allow_dynamic", True)
    derived = None
    if any(cfg.get(key) is not None for key in ("num_bits", "block_sizes", "axis")):
        if cfg.get("num_bits") is None:
            raise CfgError(
                "block_sizes/axis are given without num_bits; add num_bits, e.g. [4, 3]",
                ("num_bits",),
            )
        bits = _bits(cfg["num_bits"], ("num_bits",))
        block, scale_bits = _blocks(cfg.get("block_sizes"))
        axis = _axis(cfg.get("axis"))
        table = modelopt_table()
        derived = table.get((bits, block, scale_bits, axis))
        if derived is None:
            blocks = cfg.get("block_sizes")
            raise CfgError(
                f"num_bits={list(bits)}, block_sizes={blocks!r}, axis={cfg.get('axis')!r} "
                f"name no moewire format; accepted: {_describe_table(table)}; or format: <name> "
                f"({', '.join(formats.names())})",
                ("block_sizes",) if blocks is not None and bits in ((4, 3), (2, 1))
                else ("num_bits",),
            )
    name = cfg.get("format")
    if name is not None:
        if not isinstance(name, str) or name not in formats.names():
            raise CfgError(
                f"format={name!r} is not a registered wire format; known formats: "
                f"{', '.join(formats.names())}",
                ("format",),
            )
        if derived is not None and derived != name:
            raise CfgError(
                f"format={name!r} disagrees with num_bits/block_sizes/axis, which name "
                f"{derived!r}; keep one of the two, or make them agree",
                ("format",),
            )
    name = name or derived
    if name is None:
        if enable:
            raise CfgError(
                "the cfg names no format: add num_bits (ModelOpt spelling, e.g. [4, 3]) or "
                "format (e.g. format: nvfp4), or set enable: false",
                (),
            )
        name = "bf16"
    if name not in formats.names():
        raise CfgError(
            f"the cfg maps to format {name!r}, which is not registered in this build "
            f"(known: {', '.join(formats.names())})",
            ("format",) if "format" in cfg else ("num_bits",),
        )
    constant = cfg.get("constant_amax")
    if constant is not None:
        constant = positive_amax(constant, ("constant_amax",))
    if _flag(cfg, "use_constant_amax", False):
        if constant is not None:
            raise CfgError(
                "use_constant_amax and constant_amax are both set; they are mutually exclusive "
                "(as in ModelOpt): keep use_constant_amax (amax 448) or constant_amax",
                ("use_constant_amax",),
            )
        constant = USE_CONSTANT_AMAX
    if constant is not None and not formats.get(name).needs_amax:
        key = "constant_amax" if "constant_amax" in cfg else "use_constant_amax"
        raise CfgError(
            f"{key} is set but format {name!r} has no global amax (its scales "
            f"come from each block or row); remove {key}",
            (key,),
        )
    accumulate = cfg.get("accumulate")
    if accumulate is not None and accumulate not in formats.ACCUMULATE_MODES:
        raise CfgError(
            f"accumulate={accumulate!r} is not one of {', '.join(formats.ACCUMULATE_MODES)} "
            "(bf16: QDQ each row to BF16, then sum; fp32: sum the FP32 dequantized values, "
            "as the real FP8/FP4 combine kernels do); leave it out for the format's own",
            ("accumulate",),
        )
    return QuantizerSpec(name, constant, enable, allow_dynamic, accumulate)

