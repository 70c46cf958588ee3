"""Every check ``moewire eval`` makes before the model loads.

A run loads a checkpoint, builds each layer's Mega-MoE copy and runs every pair over every
window: a mistake found after that costs the whole run. So every argument and every file is
checked first (:func:`preflight`), and each refusal is one :class:`EvalError` that names
the argument, the cause and the fix; the CLI prints it as one line and exits with code 2.

Under ``torchrun`` (:class:`Ranks`, read from the variables it sets) every rank makes the
same checks on the same arguments and files, so every rank refuses alike before any process
group exists; the checks that depend on the rank (its memory, rank 0's output directory) run
once the ranks have joined, and the first refusal is raised on every rank
(:mod:`moewire.eval.runner`).

May import: the standard library, torch, ``moewire.formats``, ``moewire.recipes``,
``moewire.integrations`` (the architectures and kernels it knows).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moewire.extras import PACKAGES, install_command
from moewire.study.paths import writable_dir

__all__ = ["EvalError", "Checked", "Ranks", "check_out_dir", "parse_pair", "preflight",
           "read_text"]

#: config.json keys that only a model with routed experts has.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
#: config.json keys of the number of routed experts (DeepSeek, Qwen3-MoE, Mixtral).
_EXPERTS_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class EvalError(ValueError):
    """A refused evaluation: ``"<argument>: <cause>; <fix>"``.

    Attributes:
        argument: the flag or input that is wrong (``"--out"``, ``"checkpoint"``).
        cause: the rest of the message (the cause and the fix).
    """

    def __init__(self, argument: str, message: str) -> None:
        self.argument, self.cause = argument, message
        super().__init__(f"{argument}: {message}")


@dataclass(frozen=True)
class Ranks:
    """The ``torchrun`` launch this process belongs to, from the variables torchrun sets
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``); one rank without them.

    Under several ranks the model is sharded by transformers' expert parallelism over all of
    them (the EP size is ``world``), each rank on its own device.
    """

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    local_world: int = 1

    @classmethod
    def from_env(cls, env: Any = None) -> Ranks:
        """Read the launch from ``env`` (default ``os.environ``).

        Raises:
            EvalError: a variable that is not an integer, or a rank outside the world.
        """
        env = os.environ if env is None else env
        if "WORLD_SIZE" not in env:
            return cls()
        values = {}
        for key, name in (("RANK", "rank"), ("LOCAL_RANK", "local_rank"),
                          ("WORLD_SIZE", "world"), ("LOCAL_WORLD_SIZE", "local_world")):
            text = env.get(key, env["WORLD_SIZE"] if key == "LOCAL_WORLD_SIZE" else "0")
            try:
                values[name] = int(text)
            except ValueError:
                raise EvalError("torchrun", f"{key}={text!r} is not an integer; launch with "
                                "torchrun --nproc-per-node N -m moewire eval ...") from None
        ranks = cls(**values)
        if not (ranks.world >= 1 and 0 <= ranks.rank < ranks.world
                and 0 <= ranks.local_rank < ranks.local_world <= ranks.world):
            raise EvalError("torchrun", f"RANK {ranks.rank}, LOCAL_RANK {ranks.local_rank}, "
                            f"WORLD_SIZE {ranks.world}, LOCAL_WORLD_SIZE {ranks.local_world} "
                            "do not describe a launch; let torchrun set them")
        return ranks


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

    @property
    def experts(self) -> int:
        """The number of routed experts (DeepSeek's, Qwen3-MoE's or Mixtral's key)."""
        return next((self.number(k) for k in _EXPERTS_KEYS if self.number(k)), 0)


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
    """Check that the plot can be drawn (matplotlib), then create ``--out`` (with parents)
    and write a probe file there, before any work.

    Raises:
        EvalError: matplotlib is missing; ``--out`` is an existing file, or cannot be
            created or written.
    """
    _require("matplotlib", "--out", "the plot kl.png", "matplotlib")
    return writable_dir(out, EvalError, "moewire-eval")


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


def _check_device(device: str | torch.device | None, ranks: Ranks) -> torch.device:
    if ranks.world > 1:
        return _rank_device(device, ranks)
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


def _rank_device(device: str | torch.device | None, ranks: Ranks) -> torch.device:
    """A rank's device under torchrun: transformers binds each rank to the machine's
    accelerator, ``cuda:LOCAL_RANK`` (5.23.0 ``distributed/utils.py``,
    ``_bind_local_device``), or runs every rank on the CPU where there is none."""
    cuda = torch.cuda.is_available()
    name = ("cuda" if cuda else "cpu") if device is None else str(device)
    if name not in ("cpu", "cuda"):
        raise EvalError("--device", f"{name!r} under torchrun: each of the {ranks.world} ranks "
                        "runs on its own device, cuda:LOCAL_RANK; pass --device cuda (or cpu "
                        "on a machine without CUDA)")
    if name == "cpu" and cuda:
        raise EvalError("--device", "cpu under torchrun on a machine with CUDA: transformers "
                        "places each rank on cuda:LOCAL_RANK; pass --device cuda")
    if name == "cpu":
        return torch.device("cpu")
    if not cuda:
        raise EvalError("--device", "cuda was asked for but torch sees no CUDA device; pass "
                        "--device cpu")
    count = torch.cuda.device_count()
    if ranks.local_world > count:
        raise EvalError("--device", f"torchrun starts {ranks.local_world} ranks on this node "
                        f"and torch sees {count} CUDA device(s): one GPU per rank; launch with "
                        f"--nproc-per-node {count} or fewer")
    return torch.device("cuda", ranks.local_rank)


def _check_ranks(config: dict[str, Any], ranks: Ranks) -> None:
    """Under several ranks transformers gives each rank ``E / world`` whole experts
    (``MoEParamShard``, ``Shard(0)``), so the world size must divide ``E``."""
    text_config = config.get("text_config") or config
    experts = next((int(c[k]) for k in _EXPERTS_KEYS for c in (config, text_config)
                    if c.get(k)), 0)
    if experts % ranks.world:
        fits = [n for n in range(1, experts + 1) if experts % n == 0]
        raise EvalError("--nproc-per-node", f"{ranks.world} ranks do not divide the model's "
                        f"{experts} routed experts (expert parallelism gives each rank whole "
                        f"experts, E / ranks of them); launch with one of {fits}")


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


#: The builds' names in messages (``bf16xbf16`` -> ``BF16 x BF16``), where they differ.
_BUILD_NAMES = {"fp4xfp4": "NVFP4 x NVFP4"}


def _fits(build: Any, hidden: int, intermediate: int) -> bool:
    return not ((build.hidden_multiple and hidden % build.hidden_multiple)
                or (build.intermediate_multiple and intermediate % build.intermediate_multiple))


def _check_kernel_shape(checked: Checked, kernel: str, mma_type: str | None) -> None:
    """Every build's shape rules, from the config alone: ``H`` a multiple of the build's
    ``hidden_multiple`` and the experts' ``I`` of its ``intermediate_multiple``
    (``moewire.reference.catalogue``: the stand-in's buffer checks, DeepGEMM 2.8.0's
    ``csrc/apis/mega_moe.hpp`` for NVFP4 x NVFP4, DeepGEMM PR #323's TMA rows for the SM90
    kernel); ``top-k <= E`` (``moewire.reference._alloc.check_split``) where config.json
    gives both (else transformers' defaults apply). The default build (``mma_type`` ``None``) is
    the kernel's first."""
    from moewire.integrations.transformers import KERNELS
    from moewire.reference import catalogue

    experts = checked.experts
    top_k = checked.number("num_experts_per_tok")
    if top_k and experts and top_k > experts:
        raise EvalError("checkpoint", f"{checked.path}: config.json routes each token to "
                        f"num_experts_per_tok={top_k} of {experts} routed experts; a Mega-MoE "
                        "kernel needs top-k <= experts; repair config.json")
    mma = mma_type or next(iter(KERNELS[kernel]))
    build = catalogue.build(kernel, mma)
    sizes = {"hidden_size": checked.number("hidden_size"),
             "moe_intermediate_size": (checked.number("moe_intermediate_size")
                                       or checked.number("intermediate_size"))}
    if _fits(build, *sizes.values()):
        return
    key, size, multiple = next(
        (k, v, m) for (k, v), m in zip(sizes.items(), (build.hidden_multiple,
                                                       build.intermediate_multiple), strict=True)
        if m and v % m)
    others = [b.mma_type for b in catalogue.builds(kernel, "transformers")
              if b.mma_type != mma and _fits(b, *sizes.values())]
    fix = (f"use --mma {' or '.join(others)} for this model" if others
           else f"no build of --kernel {kernel} takes this model"
           + ("; use --kernel stand-in" if kernel != catalogue.STAND_IN else ""))
    name = _BUILD_NAMES.get(mma, mma.upper().replace("X", " x "))
    argument = f"--mma {mma}" if mma_type else "checkpoint"
    default = "" if mma_type else f" (--kernel {kernel}'s default --mma {mma})"
    raise EvalError(argument, f"the {name} kernel{default} needs sizes that are multiples of "
                    f"{multiple}, but the model's {key} is {size}; {fix}")


def _quantizer_names(checked: Checked) -> list[str]:
    """The wire quantizers' qualified names of the model, from its experts modules on the
    meta device (built from config.json, no weights read): ``<module>.dispatch_quantizer``
    and ``<module>.combine_quantizer`` (``moewire.megamoe.quant_experts.QUANTIZER_NAMES``)."""
    import transformers

    import moewire.integrations.transformers as mt
    from moewire.megamoe.quant_experts import QUANTIZER_NAMES

    mt.register()
    try:
        config = transformers.AutoConfig.from_pretrained(checked.path, local_files_only=True)
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(
                config, experts_implementation=mt.IMPLEMENTATION)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise EvalError("checkpoint", f"transformers cannot build the model of {checked.path} "
                        f"from its config.json ({type(exc).__name__}: {exc}); repair config.json "
                        "or write it again with save_pretrained") from None
    return [f"{name}.{attr}" for name, _ in mt.experts_modules(skeleton)
            for attr in QUANTIZER_NAMES]


def _check_recipe_names(recipes: Sequence[str], names: list[str]) -> None:
    """Each recipe configures some of the model's wire quantizers ``names``, and none of its
    entries aims at a quantizer the model lacks: what ``moewire.quantize`` refuses once the
    model is loaded (``moewire.megamoe.api``), refused before."""
    from moewire import recipes as recipe_registry
    from moewire.megamoe.api import _refuse_unmatched_entries

    shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
    for recipe in recipes:
        rec = recipe_registry.load(recipe)
        try:
            matched = [n for n in names if rec.match(n) is not None]
            if not matched:
                patterns = ", ".join(repr(e.quantizer_name) for e in rec.entries[:4])
                raise ValueError(f"no entry ({patterns}) matches any wire quantizer of the "
                                 f"model, so nothing would be quantized; its quantizers are "
                                 f"{shown}; match them with '*dispatch_quantizer' and "
                                 "'*combine_quantizer' (names are case-sensitive)")
            _refuse_unmatched_entries(rec, names, "the model", modelopt_form=False)
        except ValueError as exc:
            raise EvalError("--recipe", f"{recipe}: {str(exc).removeprefix('quantize: ')}"
                            ) from None


def _require(package: str, argument: str, needed_by: str, install: str) -> None:
    """Refuse when ``package`` cannot be imported (``importlib.util.find_spec``; a module set
    to ``None`` in ``sys.modules`` counts as missing, as ``import`` treats it). ``install`` is
    a moewire extra ("transformers", "eval": :func:`moewire.extras.install_command`) or the
    pip arguments that install the package."""
    import importlib.util

    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        command = (install_command(install) if install in PACKAGES
                   else f"{sys.executable} -m pip install {install}")
        raise EvalError(argument, f"{needed_by} needs {package}, which this Python lacks; run: "
                        f"{command}")


def _check_dependencies(config: dict[str, Any], path: Path, ranks: Ranks) -> None:
    """The packages the load needs: accelerate for several ranks (transformers'
    ``DistributedConfig`` loading) and for a pre-quantized checkpoint (transformers 5.23's
    quantizers, e.g. ``quantizers/quantizer_finegrained_fp8.py``, ``validate_environment``,
    refuse to load one without it)."""
    if ranks.world > 1:
        _require("accelerate", "torchrun", "transformers' distributed loading "
                 "(DistributedConfig)", "accelerate")
    quantized = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        _require("accelerate", "checkpoint", f"{path} is pre-quantized (quant_method "
                 f"{method!r}), and transformers' loading of it", "accelerate")


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
    ranks: Ranks = Ranks(),
) -> Checked:
    """Check every argument and file of :func:`moewire.eval.evaluate`; load nothing.

    Order: the numbers, the pairs and recipes, the kernel, the device, the packages the
    load needs, the checkpoint's files, the ranks (under torchrun), the formats' blocks,
    the build's shape rules, the recipes against the model's quantizer names (its experts
    modules built on the meta device). The caller checks the output directory last
    (:func:`check_out_dir` creates it), so that a refused run leaves no directory behind.

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
    dev = _check_device(device, ranks)
    path = Path(checkpoint)
    _require("transformers", "checkpoint", "moewire eval", "transformers")
    config = _check_config(path)
    _check_dependencies(config, path, ranks)
    if ranks.world > 1:
        _check_ranks(config, ranks)
    checked = Checked(path, config, dev, pairs, per_layer, tuple(map(str, recipes)),
                      any((path / f).is_file() for f in _TOKENIZER_FILES))
    hidden = checked.number("hidden_size")
    _check_formats(pairs, "--pairs", hidden)
    if per_layer is not None:
        _check_formats([per_layer], "--per-layer", hidden)
    _check_kernel_shape(checked, kernel, mma_type)
    if recipes:
        _check_recipe_names(recipes, _quantizer_names(checked))
    positions = checked.number("max_position_embeddings")
    if positions and seq_len > positions:
        raise EvalError("--seq-len", f"{seq_len} tokens per window is more than the model's "
                        f"max_position_embeddings {positions}; use --seq-len {positions} or less")
    return checked
