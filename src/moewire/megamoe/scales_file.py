"""The scales file: what ``moewire.save_scales`` writes and ``moewire.load_scales`` reads.

Three encodings, chosen by the suffix, of one record per quantizer, keyed by its qualified
name (``layers.3.experts.combine_quantizer``): its format name, its amax (FP32 ``[]``, or
none), the layer shape it was calibrated on (``layer``: ``{"num_experts", "hidden",
"top_k"}``, or ``null`` where the experts module does not say) and, for a combine quantizer,
which kernel's rows that amax describes (``rows``: ``"weighted"``, ``"unweighted"`` or
``null``).

- ``.safetensors``: one FP32 tensor per quantizer with an amax, plus a JSON metadata entry
  ``moewire_scales`` = ``{"version": 2, "quantizers": {name: {"format", "shape", "layer"[,
  "rows"]}}}`` naming every quantizer (``shape`` ``null`` without an amax).
- ``.json``: ``{"moewire_scales": 2, "quantizers": {name: {"format", "shape", "layer",
  "amax"[, "rows"]}}}`` (amax as a list of floats, exact for FP32; ``null`` without one).
- ``.pt``: ``torch.save`` of the JSON document with each amax an FP32 tensor (read back
  with ``weights_only=True``).

Any other suffix is refused. Version 1 files (before ``layer`` was recorded) still load,
without the shape check.

Reading checks everything the writer guarantees (version, keys, types, FP32 values) and
names the file and the fault; whether the records fit a model is ``load_scales``'s job.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from moewire.megamoe.flavours import ROWS_KINDS

__all__ = ["SCALES_VERSION", "SUFFIXES", "Scale", "read_scales", "scales_path", "write_scales"]

SCALES_VERSION = 2
#: The versions this moewire reads (1: no ``layer`` record).
_READS = (1, 2)
#: The suffixes a scales file may have, each its own encoding (module docstring).
SUFFIXES = (".safetensors", ".json", ".pt")
#: The keys of a ``layer`` record.
LAYER_KEYS = ("num_experts", "hidden", "top_k")
_METADATA_KEY = "moewire_scales"


class Scale(NamedTuple):
    """One quantizer's record.

    Attributes:
        format: the quantizer's format name, or ``None`` (no format).
        amax: FP32 ``[]`` on the CPU, or ``None`` when the quantizer has none.
        rows: the combine rows the amax describes (``flavours.ROWS_KINDS``) or ``None``.
        has_rows: whether the record carries ``rows`` at all (combine quantizers do).
        layer: ``{"num_experts", "hidden", "top_k"}`` of the experts module the amax was
            calibrated on, or ``None`` (unknown, or a version 1 file).
    """

    format: str | None
    amax: torch.Tensor | None
    rows: str | None = None
    has_rows: bool = False
    layer: Mapping[str, int] | None = None


def scales_path(path: object, caller: str) -> Path:
    """``path`` as a :class:`~pathlib.Path`; ``caller`` names the call in the error.

    Raises:
        TypeError: ``path`` is not a str or ``os.PathLike``.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{caller}: path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ValueError(
            f"{caller}: {path} has the suffix {path.suffix or '(none)'!r}, and a scales file is "
            f"{', '.join(SUFFIXES)} (each its own encoding); rename it, e.g. "
            f"{path.with_suffix('.safetensors').name}"
        )
    return path


def write_scales(path: Path, scales: Mapping[str, Scale]) -> Path:
    """Write ``scales`` to ``path`` (safetensors by suffix, else JSON), with the process
    umask's permissions, as any file the user writes.

    Returns:
        ``path``.

    Raises:
        ValueError: the directory of ``path`` does not exist (nothing is created).
    """
    if not path.parent.is_dir():
        raise ValueError(
            f"save_scales: the directory {path.parent} does not exist; create it first (e.g. "
            f"os.makedirs({str(path.parent)!r}, exist_ok=True)) or pick another path"
        )
    entries: dict[str, dict[str, Any]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, scale in scales.items():
        entry: dict[str, Any] = {"format": scale.format, "shape": None, "amax": None,
                                 "layer": None if scale.layer is None else dict(scale.layer)}
        if scale.has_rows:
            entry["rows"] = scale.rows
        if scale.amax is not None:
            amax = scale.amax.detach().float().cpu().contiguous()
            entry["shape"] = list(amax.shape)
            tensors[name] = amax
            entry["amax"] = amax.reshape(-1).tolist()
        entries[name] = entry
    if path.suffix == ".safetensors":
        from safetensors.torch import save

        meta = {
            n: {k: v for k, v in e.items() if k != "amax"} for n, e in entries.items()
        }
        header = json.dumps({"version": SCALES_VERSION, "quantizers": meta})
        # safetensors' save_file creates the file 0600; plain writing honours the umask.
        path.write_bytes(save(tensors, metadata={_METADATA_KEY: header}))
    elif path.suffix == ".pt":
        for name, entry in entries.items():
            entry["amax"] = tensors.get(name)
        torch.save({_METADATA_KEY: SCALES_VERSION, "quantizers": entries}, path)
    else:
        path.write_text(
            json.dumps({_METADATA_KEY: SCALES_VERSION, "quantizers": entries}, indent=1)
        )
    return path


class _ScalesFileError(ValueError):
    """A scales file that is not what ``save_scales`` writes (the message names it)."""


def _bad(path: Path, what: str) -> _ScalesFileError:
    return _ScalesFileError(
        f"load_scales: {path}: {what}; it was not written by moewire.save_scales (version "
        f"{' or '.join(map(str, _READS))}) or was changed since: save the scales again"
    )


def _check_version(path: Path, version: Any) -> int:
    if isinstance(version, bool) or version not in _READS:
        raise _bad(path, f"version is {version!r}, and this moewire reads versions "
                         f"{', '.join(map(str, _READS))}")
    checked: int = version
    return checked


def _check_layer(path: Path, name: str, entry: Mapping[str, Any], version: int) -> None:
    if version == 1:
        return
    if "layer" not in entry:
        raise _bad(path, f"{name}: no 'layer' record (version {version} writes one)")
    layer = entry["layer"]
    if layer is None:
        return
    if not isinstance(layer, Mapping) or sorted(layer) != sorted(LAYER_KEYS) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in layer.values()):
        raise _bad(path, f"{name}: layer is {layer!r}, not {{{', '.join(LAYER_KEYS)}}} sizes")


def _check_entries(path: Path, quantizers_: Any,
                   version: int = SCALES_VERSION) -> dict[str, Mapping[str, Any]]:
    if not isinstance(quantizers_, Mapping):
        raise _bad(path, f"'quantizers' is a {type(quantizers_).__name__}, not a mapping")
    for name, entry in quantizers_.items():
        if not isinstance(entry, Mapping):
            raise _bad(path, f"the entry of {name!r} is a {type(entry).__name__}, not a mapping")
        fmt = entry.get("format")
        if fmt is not None and not isinstance(fmt, str):
            raise _bad(path, f"{name}: format is {fmt!r}, not a format name")
        shape = entry.get("shape")
        if shape is not None and (not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise _bad(path, f"{name}: shape is {shape!r}, not a list of sizes")
        rows = entry.get("rows")
        if rows is not None and rows not in ROWS_KINDS:
            raise _bad(path, f"{name}: rows is {rows!r}, not one of {ROWS_KINDS}")
        _check_layer(path, name, entry, version)
    return dict(quantizers_)


def _scale(entry: Mapping[str, Any], amax: torch.Tensor | None) -> Scale:
    layer = entry.get("layer")
    return Scale(entry.get("format"), amax, entry.get("rows"), "rows" in entry,
                 None if layer is None else dict(layer))


def _read_safetensors(path: Path) -> dict[str, Scale]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = (f.metadata() or {}).get(_METADATA_KEY)
            stored = {n: f.get_tensor(n) for n in f.keys()}
    except _ScalesFileError:
        raise
    except Exception as exc:  # safetensors raises its own SafetensorError, OSError, ...
        raise _bad(path, f"not a readable safetensors file ({type(exc).__name__}: {exc}); "
                         "truncated or not safetensors") from None
    if header is None:
        raise _bad(path, f"no '{_METADATA_KEY}' metadata")
    try:
        doc = json.loads(header)
    except json.JSONDecodeError as exc:
        raise _bad(path, f"the '{_METADATA_KEY}' metadata is not JSON ({exc})") from None
    if not isinstance(doc, Mapping) or "quantizers" not in doc:
        raise _bad(path, f"the '{_METADATA_KEY}' metadata has no 'quantizers'")
    version = _check_version(path, doc.get("version"))
    meta = _check_entries(path, doc["quantizers"], version)
    unlisted = sorted(set(stored) - set(meta))
    if unlisted:
        raise _bad(path, f"it holds tensors {unlisted[:4]} its metadata does not list")
    out = {}
    for name, entry in meta.items():
        tensor = stored.get(name)
        if (entry.get("shape") is None) != (tensor is None):
            state = "holds no tensor" if tensor is None else "holds a tensor"
            raise _bad(path, f"{name}: the metadata says shape={entry.get('shape')!r} but the "
                             f"file {state} for it (a truncated or edited file)")
        if tensor is not None and tensor.dtype != torch.float32:
            raise _bad(path, f"{name}: the amax is {tensor.dtype}; an amax is stored as FP32 "
                             "(torch.float32)")
        out[name] = _scale(entry, tensor)
    return out


def _document_entries(path: Path, data: Any) -> dict[str, Mapping[str, Any]]:
    """The checked quantizer entries of a JSON or torch scales document (a dict holding
    the format version under the metadata key and the entries under ``quantizers``)."""
    if not isinstance(data, dict) or _METADATA_KEY not in data:
        raise _bad(path, f"no '{_METADATA_KEY}' key")
    version = _check_version(path, data[_METADATA_KEY])
    return _check_entries(path, data.get("quantizers"), version)


def _read_json(path: Path) -> dict[str, Scale]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"not JSON ({exc}); a safetensors file needs the .safetensors "
                         "suffix") from None
    entries = _document_entries(path, data)
    out = {}
    for name, entry in entries.items():
        amax, values = None, entry.get("amax")
        if values is not None:
            if not isinstance(values, list) or not all(
                    isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool))
                    for v in values):
                raise _bad(path, f"{name}: amax is {values!r}, not a list of numbers")
            amax = torch.tensor(values, dtype=torch.float64)
            if not torch.equal(amax.float().double(), amax):
                raise _bad(path, f"{name}: amax {values!r} is not an FP32 value (save_scales "
                                 "writes FP32 values exactly)")
            shape = entry.get("shape")
            if shape is None or math.prod(shape) != amax.numel():
                raise _bad(path, f"{name}: amax has {amax.numel()} values and shape {shape!r}")
            amax = amax.float().reshape(shape)
        out[name] = _scale(entry, amax)
    return out


def _read_pt(path: Path) -> dict[str, Scale]:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and torch errors alike mean the same fix
        raise _bad(path, f"not a readable torch file ({type(exc).__name__}: {exc})") from None
    entries = _document_entries(path, data)
    out = {}
    for name, entry in entries.items():
        amax = entry.get("amax")
        if amax is not None and (not isinstance(amax, torch.Tensor)
                                 or amax.dtype != torch.float32
                                 or list(amax.shape) != entry.get("shape")):
            raise _bad(path, f"{name}: amax is not an FP32 tensor of shape "
                             f"{entry.get('shape')!r}")
        if (amax is None) != (entry.get("shape") is None):
            raise _bad(path, f"{name}: shape {entry.get('shape')!r} and amax disagree")
        out[name] = _scale(entry, amax)
    return out


def read_scales(path: Path) -> dict[str, Scale]:
    """The records of a scales file, by qualified name.

    Raises:
        ValueError: naming the file and the fault: missing, unreadable, truncated or
            malformed, wrong version, keys or types, an amax that is not FP32.
    """
    if not path.is_file():
        raise ValueError(f"load_scales: {path} does not exist or is not a file; pass the path "
                         "save_scales wrote")
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    if path.suffix == ".pt":
        return _read_pt(path)
    return _read_json(path)


