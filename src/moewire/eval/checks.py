"""Every check ``moewire eval`` makes before the model loads.

A run loads a checkpoint, builds each layer's Mega-MoE copy and runs every pair over every
window: a mistake found after that costs the whole run. So every argument and every file is
checked first (:func:`preflight`), and each refusal is one :class:`EvalError` that names
the argument, the cause and the fix; the CLI prints it as one line and exits with code 2.

May import: the standard library, torch, ``moewire.formats``, ``moewire.recipes``,
``moewire.integrations`` (the architectures and kernels it knows).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["EvalError", "Checked", "check_out_dir", "parse_pair", "preflight", "read_text"]

#: config.json keys that only a model with routed experts has.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class EvalError(ValueError):
    """A refused evaluation: ``"<argument>: <cause>; <fix>"``.

    Attributes:
        argument: the flag or input that is wrong (``"--out"``, ``"checkpoint"``).
    """

    def __init__(self, argument: str, message: str) -> None:
        self.argument = argument
        super().__init__(f"{argument}: {message}")


@dataclass(frozen=True)
class Checked:
    """What :func:`preflight` found: everything the run needs, read before the model loads.

    Attributes:
        path: the checkpoint directory.
        config: its ``config.json``.
        device: where the model runs.
        pairs: ``(dispatch, combine)`` of every pair.
        per_layer: the per-layer pair, or ``None``.
        recipes: the recipe names or paths, each loadable.
        has_tokenizer: the checkpoint has its own tokenizer files.
    """

    path: Path
    config: dict[str, Any]
    device: torch.device
    pairs: tuple[tuple[str, str], ...]
    per_layer: tuple[str, str] | None
    recipes: tuple[str, ...]
    has_tokenizer: bool

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's part of the config (``text_config`` of a multimodal one)."""
        return self.config.get("text_config") or self.config

    def number(self, key: str) -> int:
        """An integer of the config (``vocab_size``, ``hidden_size``), 0 when absent."""
        return int(self.config.get(key) or self.text_config.get(key) or 0)


def parse_pair(text: str, argument: str = "--pairs") -> tuple[str, str]:
    """``"fp8:nvfp4"`` -> ``("fp8", "nvfp4")`` (dispatch, combine), formats checked."""
    from moewire import formats

    parts = text.split(":")
    if len(parts) != 2 or not all(parts):
        raise EvalError(argument, f"{text!r} is not DISPATCH:COMBINE; write it as e.g. fp8:nvfp4")
    for name in parts:
        try:
            formats.get(name)
        except (KeyError, ValueError):
            raise EvalError(
                argument, f"{text!r}: unknown format {name!r}; pick from "
                f"{', '.join(formats.names())} (`moewire formats` lists them)"
            ) from None
    return parts[0], parts[1]


def read_text(path: str | os.PathLike) -> str:
    """The ``--text`` file, as UTF-8.

    Raises:
        EvalError: the file does not exist, is not a file, cannot be read or is not UTF-8.
    """
    path = Path(path)
    if not path.is_file():
        raise EvalError("--text", f"{path} does not exist or is not a file; pass a text file")
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise EvalError("--text", f"cannot read {path} ({exc.strerror or exc}); pass a file "
                        "you can read") from None
    except UnicodeDecodeError as exc:
        raise EvalError("--text", f"{path} is not UTF-8 text (byte {exc.start}); pass a UTF-8 "
                        "text file") from None


def check_out_dir(out: str | os.PathLike) -> Path:
    """Create ``--out`` (with parents) and write a probe file there, before any work.

    Raises:
        EvalError: ``--out`` is an existing file, or cannot be created or written.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise EvalError("--out", f"{path} exists and is not a directory; pass a directory (it "
                        "is created if missing), e.g. --out moewire-eval")
    probe = path / ".moewire-write-check"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise EvalError("--out", f"cannot write into {path} ({exc.strerror or exc}); pass a "
                        "directory you can write to") from None
    return path


def _check_config(path: Path) -> dict[str, Any]:
    """The checkpoint directory's ``config.json``, parsed, of an architecture moewire knows."""
    if not path.is_dir():
        raise EvalError("checkpoint", f"{path} is not a directory; pass a local checkpoint "
                        "directory (config.json and safetensors, as save_pretrained writes them)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise EvalError("checkpoint", f"{path} has no config.json; pass a transformers "
                        "checkpoint directory")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = (f" (line {exc.lineno}, column {exc.colno}: {exc.msg})"
                 if isinstance(exc, json.JSONDecodeError) else f" ({exc})")
        raise EvalError("checkpoint", f"{config_file} is not valid JSON{where}; repair it or "
                        "write it again with save_pretrained") from None
    if not isinstance(config, dict):
        raise EvalError("checkpoint", f"{config_file} holds a {type(config).__name__}, not a "
                        "JSON object; write it again with save_pretrained")
    from moewire.integrations.transformers import ARCHITECTURES

    known = {a.model_type: a for a in ARCHITECTURES}
    model_type = config.get("model_type")
    text_config = config.get("text_config") or {}
    if model_type not in known:
        if not any(k in config or k in text_config for k in _MOE_KEYS):
            raise EvalError("checkpoint", f"{path} is a {model_type!r} model without routed "
                            f"experts (none of {', '.join(_MOE_KEYS)} in config.json); moewire "
                            "eval measures MoE models")
        raise EvalError("checkpoint", f"{path}: unknown architecture {model_type!r}; moewire "
                        f"knows the experts of {', '.join(sorted(known))}")
    if known[model_type].refused:
        raise EvalError("checkpoint", f"{path}: {known[model_type].refused}")
    if not any(f.suffix in _WEIGHT_SUFFIXES for f in path.iterdir()):
        raise EvalError("checkpoint", f"{path} has config.json but no weights (*.safetensors); "
                        "write the model with save_pretrained")
    return config


def _check_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise EvalError("--device", f"{device!r} is not a device; pass cpu or cuda (or cuda:N)"
                        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise EvalError("--device", f"{device!r}: moewire eval runs on cpu or cuda; pass one")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EvalError("--device", f"{device} was asked for but torch sees no CUDA "
                            "device; pass --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise EvalError("--device", f"{device}: torch sees {count} CUDA device(s), "
                            f"cuda:0..cuda:{count - 1}; pass one of them")
    return dev


def _check_kernel(kernel: str, mma_type: str | None) -> None:
    """Refuse an unknown kernel or build, and the real SM90 kernel where it cannot run."""
    from moewire.integrations import deepgemm_sm90
    from moewire.integrations.transformers import KERNELS

    if kernel not in KERNELS:
        raise EvalError("--kernel", f"{kernel!r} is not one of {', '.join(KERNELS)}; pick one")
    if mma_type is not None and mma_type not in KERNELS[kernel]:
        raise EvalError("--mma", f"kernel {kernel!r} has the builds "
                        f"{', '.join(KERNELS[kernel])}, not {mma_type!r}; pick one of them")
    if kernel == "deepgemm-sm90":
        ok, why = deepgemm_sm90.available()
        if not ok:
            raise EvalError("--kernel deepgemm-sm90", f"DeepGEMM's real SM90 fp8_mega_moe "
                            f"cannot run here ({why}); run on a Hopper GPU with the package on "
                            "PYTHONPATH (docs/real-kernel.md), or use --kernel stand-in")


def _check_formats(pairs: Sequence[tuple[str, str]], argument: str, hidden: int) -> None:
    """A block-scaled format's blocks must tile the hidden size."""
    from moewire import formats

    for pair in pairs:
        for name in pair:
            block = formats.get(name).block_size
            if block is not None and hidden and hidden % block:
                raise EvalError(argument, f"format {name!r} has blocks of {block}, which do not "
                                f"divide the model's hidden size {hidden}; drop it")


def _check_recipes(recipes: Sequence[str]) -> None:
    from moewire import recipes as recipe_registry

    for recipe in recipes:
        try:
            recipe_registry.load(recipe)
        except ValueError as exc:
            raise EvalError("--recipe", f"{exc}") from None


def _positive_int(value: Any, argument: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EvalError(argument, f"must be an integer >= {minimum}, got {value!r}")


def preflight(
    checkpoint: str | os.PathLike,
    pairs: Sequence[tuple[str, str]],
    *,
    recipes: Sequence[str],
    per_layer: tuple[str, str] | None,
    max_tokens: int,
    seq_len: int,
    kernel: str,
    mma_type: str | None,
    device: str | torch.device | None,
    budget: float | None,
) -> Checked:
    """Check every argument and file of :func:`moewire.eval.evaluate`; load nothing.

    Order: the numbers, the pairs and recipes, the kernel, the device, the checkpoint's
    files. The caller checks the output directory last (:func:`check_out_dir` creates it),
    so that a refused run leaves no directory behind.

    Raises:
        EvalError: the first thing wrong, naming the argument and the fix.
    """
    _positive_int(max_tokens, "--max-tokens", 2)
    _positive_int(seq_len, "--seq-len", 2)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not math.isfinite(budget) or budget < 0):
        raise EvalError("--budget", f"must be a finite mean KL >= 0 (e.g. 1e-3), got {budget!r}")
    pairs = tuple(tuple(p) for p in pairs)
    for pair in pairs:
        parse_pair(":".join(pair))
    if per_layer is not None:
        parse_pair(":".join(per_layer), "--per-layer")
    if not pairs and not recipes and per_layer is None:
        raise EvalError("--pairs", "no pair, recipe or --per-layer pair to measure, only the "
                        "baseline; pass pairs (e.g. --pairs fp8:nvfp4) or leave --pairs out "
                        "for the default three")
    _check_recipes(recipes)
    _check_kernel(kernel, mma_type)
    dev = _check_device(device)
    path = Path(checkpoint)
    config = _check_config(path)
    checked = Checked(path, config, dev, pairs, per_layer, tuple(map(str, recipes)),
                      any((path / f).is_file() for f in _TOKENIZER_FILES))
    hidden = checked.number("hidden_size")
    _check_formats(pairs, "--pairs", hidden)
    if per_layer is not None:
        _check_formats([per_layer], "--per-layer", hidden)
    positions = checked.number("max_position_embeddings")
    if positions and seq_len > positions:
        raise EvalError("--seq-len", f"{seq_len} tokens per window is more than the model's "
                        f"max_position_embeddings {positions}; use --seq-len {positions} or less")
    return checked
