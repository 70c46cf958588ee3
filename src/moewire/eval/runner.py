"""``moewire eval``: what a wire format pair does to a whole transformers MoE model.

For a local checkpoint (loaded offline, ``HF_HUB_OFFLINE=1``) with
``experts_implementation="moewire"`` (:mod:`moewire.integrations.transformers`), every pair
runs the same token windows and is compared with the same model on a BF16 wire (the
``bf16:bf16`` pair through the same Mega-MoE contract, exact: KL 0 bit for bit):

- perplexity ``exp(mean_t -log p(x_{t+1}))``;
- ``KL_t = sum_v p0_t(v) (log p0_t(v) - log p_t(v))`` (float64), its mean and 99th
  percentile over positions;
- top-1 agreement ``mean_t [argmax p_t == argmax p0_t]``;
- per layer, the relative L2 ``||y - y0|| / ||y0||`` of the experts' output;
- bytes per routed token (dispatch + combine, ``WireFormat.wire_bits``) and the estimated
  wire time of one layer (``moewire.study.comm.comm_time``: the study's time model).

Quantizers are calibrated on the first window before each pair is measured.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["EvalError", "PairResult", "choose_layers", "evaluate", "mixed_recipe_yaml",
           "pair_entries", "parse_pair", "table"]

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
BASELINE = ("bf16", "bf16")


class EvalError(ValueError):
    """A refused evaluation: the message names the argument, the cause and the fix."""


@dataclass
class PairResult:
    """One dispatch x combine pair (or recipe) measured against the BF16 wire."""

    name: str
    dispatch: str
    combine: str
    perplexity: float
    kl_mean: float
    kl_p99: float
    top1_agreement: float
    bytes_per_token: float
    wire_us: float
    layer_rel_l2: dict[str, float] = field(default_factory=dict)


def parse_pair(text: str) -> tuple[str, str]:
    """``"fp8:nvfp4"`` -> ``("fp8", "nvfp4")`` (dispatch, combine), formats checked."""
    from moewire import formats

    parts = text.split(":")
    if len(parts) != 2:
        raise EvalError(f"--pairs: {text!r} is not DISPATCH:COMBINE (e.g. fp8:nvfp4)")
    for name in parts:
        try:
            formats.get(name)
        except (KeyError, ValueError) as exc:
            raise EvalError(f"--pairs: {text!r}: unknown format {name!r} ({exc})") from None
    return parts[0], parts[1]


def _entry(pattern: str, fmt: str) -> dict[str, Any]:
    from moewire import formats

    wire = formats.get(fmt)
    if wire.modelopt_spelling is None:
        cfg: dict[str, Any] = {"format": fmt}
    else:
        cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in wire.modelopt_cfg().items()}
        if isinstance(cfg.get("block_sizes"), dict):
            cfg["block_sizes"] = {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg["block_sizes"].items()
            }
    return {"quantizer_name": pattern, "cfg": cfg}


def pair_entries(dispatch: str, combine: str, layers: Sequence[int] | None = None) -> list[dict]:
    """ModelOpt ``quant_cfg`` entries for a pair, on every layer or only on ``layers``.

    A layer's pattern is ``*layers.N.*experts.<quantizer>``: it matches transformers'
    ``model.layers.N.mlp.experts``, vLLM's ``...ffn.experts``/``...block_sparse_moe.experts``
    and SGLang's names alike, and never layer ``N0``..``N9``.
    """
    scopes = ["*"] if layers is None else [f"*layers.{n}.*experts." for n in layers]
    return [
        _entry(f"{scope}{kind}_quantizer", fmt)
        for scope in scopes
        for kind, fmt in (("dispatch", dispatch), ("combine", combine))
    ]


def mixed_recipe_yaml(low: tuple[str, str], layers: Sequence[int], high: tuple[str, str],
                      description: str) -> str:
    """A recipe YAML: ``high`` on every layer, then ``low`` (the 4-bit pair) on ``layers``
    (later entries win, as in ModelOpt)."""
    import yaml

    entries = pair_entries(*high) + (pair_entries(*low, layers) if layers else [])
    return yaml.safe_dump({"description": description, "quant_cfg": entries}, sort_keys=False)


def _check_dir(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise EvalError(
            f"checkpoint: {path} is not a directory; pass a local checkpoint directory "
            "(config.json and safetensors, as save_pretrained writes them)"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise EvalError(f"checkpoint: {path} has no config.json; pass a transformers checkpoint")
    config = json.loads(config_file.read_text())
    from moewire.integrations.transformers import ARCHITECTURES

    known = {a.model_type: a for a in ARCHITECTURES}
    model_type = config.get("model_type")
    text_config = config.get("text_config") or {}
    is_moe = any(k in config or k in text_config for k in _MOE_KEYS)
    if model_type not in known:
        if not is_moe:
            raise EvalError(
                f"checkpoint: {path} is a {model_type!r} model without routed experts (none "
                f"of {', '.join(_MOE_KEYS)} in config.json); moewire eval measures MoE models"
            )
        raise EvalError(
            f"checkpoint: {path}: unknown architecture {model_type!r}; moewire knows the "
            f"experts of {', '.join(sorted(known))}"
        )
    if known[model_type].refused:
        raise EvalError(f"checkpoint: {path}: {known[model_type].refused}")
    return config


def _check_kernel(kernel: str, mma_type: str | None) -> None:
    """Refuse an unknown kernel or build, and the real SM90 kernel where it cannot run."""
    from moewire.integrations import deepgemm_sm90
    from moewire.integrations.transformers import KERNELS

    if kernel not in KERNELS:
        raise EvalError(f"--kernel: {kernel!r} is not one of {', '.join(KERNELS)}")
    if mma_type is not None and mma_type not in KERNELS[kernel]:
        raise EvalError(
            f"--mma: kernel {kernel!r} has the builds {', '.join(KERNELS[kernel])}, not "
            f"{mma_type!r}"
        )
    if kernel == "deepgemm-sm90":
        ok, why = deepgemm_sm90.available()
        if not ok:
            raise EvalError(
                f"--kernel deepgemm-sm90: DeepGEMM's real SM90 fp8_mega_moe cannot run here "
                f"({why}); run on a Hopper GPU with the package on PYTHONPATH "
                "(docs/real-kernel.md), or use --kernel stand-in"
            )


def _tokens(path: Path, text: str, vocab: int) -> torch.Tensor:
    """Token ids of ``text``: the checkpoint's tokenizer, or bytes modulo the vocabulary
    when it has none (random test checkpoints)."""
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return torch.tensor(tokenizer(text)["input_ids"])
    return torch.tensor(list(text.encode())) % vocab


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _estimate_bytes(path: Path, config: dict, tokens: int) -> int:
    """Weights (the checkpoint's files), the experts' Mega-MoE copy (at most the weights
    again), the baseline and one pair's FP32 logits, and the activations of one window."""
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", 0))
    hidden = int(config.get("hidden_size") or 0)
    return 2 * weights + 3 * tokens * vocab * 4 + 16 * tokens * hidden * 2


class _Outputs:
    """Forward hooks recording each experts module's output, FP32 on the CPU."""

    def __init__(self, modules: list[tuple[str, nn.Module]]) -> None:
        self.values: dict[str, list[torch.Tensor]] = {}
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in modules]

    def _hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            self.values.setdefault(name, []).append(output.detach().float().cpu())
        return hook

    def close(self) -> dict[str, torch.Tensor]:
        for h in self._handles:
            h.remove()
        return {n: torch.cat(v) for n, v in self.values.items()}


def _forward(model: nn.Module, windows: list[torch.Tensor], modules) -> tuple[Any, Any]:
    outputs = _Outputs(modules)
    logits = []
    try:
        with torch.no_grad():
            for w in windows:
                logits.append(model(w.unsqueeze(0)).logits[0].float().cpu())
    finally:
        layers = outputs.close()
    return torch.cat(logits), layers


def _metrics(logits: torch.Tensor, base: torch.Tensor, targets: torch.Tensor):
    """``(perplexity, mean KL, p99 KL, top-1 agreement)``; float64, 256 positions at a time
    (a small KL is a difference of nearly equal log-probabilities)."""
    kls, nlls = [], []
    for start in range(0, logits.shape[0], 256):
        rows = slice(start, start + 256)
        logp = logits[rows].double().log_softmax(-1)
        logp0 = base[rows].double().log_softmax(-1)
        kls.append((logp0.exp() * (logp0 - logp)).sum(-1).clamp(min=0.0))
        nlls.append(-logp.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1))
    kl, nll = torch.cat(kls), torch.cat(nlls)
    agree = (logits.argmax(-1) == base.argmax(-1)).double().mean()
    return math.exp(nll.mean().item()), kl.mean().item(), torch.quantile(kl, 0.99).item(), \
        agree.item()


def evaluate(
    checkpoint: str | os.PathLike,
    pairs: Sequence[tuple[str, str]] = (("fp8", "fp8"), ("fp8", "nvfp4"), ("nvfp4", "nvfp4")),
    *,
    recipes: Sequence[str] = (),
    text: str | None = None,
    max_tokens: int = 1024,
    seq_len: int = 128,
    mma_type: str | None = None,
    kernel: str = "stand-in",
    device: str | None = None,
    budget: float | None = None,
    per_layer: tuple[str, str] | None = None,
    out_dir: str | os.PathLike | None = None,
    interconnect: str = "nvlink-h200",
    ep_size: int = 8,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> dict[str, Any]:
    """Measure each pair (and recipe) against the same model on a BF16 wire.

    Args:
        checkpoint: a local checkpoint directory.
        pairs: ``(dispatch, combine)`` format names.
        recipes: recipe names or YAML paths, measured as well.
        text: the evaluation text (default: the embedded calibration text).
        max_tokens: tokens evaluated (in windows of ``seq_len``).
        mma_type: the kernel's build (``moewire.integrations.transformers.KERNELS``;
            default its first: ``"bf16xbf16"`` for the stand-in).
        kernel: ``"stand-in"`` or ``"deepgemm-sm90"`` (DeepGEMM's real SM90
            ``fp8_mega_moe`` with FP8 128x128 block-scaled weights, on a Hopper GPU).
        device: ``"cpu"``, ``"cuda"`` (default: CUDA when available).
        budget: mean-KL budget: the verdict names the cheapest pair within it.
        per_layer: a pair quantized one layer at a time; with ``budget``, a mixed recipe
            (that pair on the layers the budget allows, the cheapest in-budget pair or BF16
            elsewhere) is written to ``out_dir/mixed_recipe.yaml``.
        out_dir: where ``results.json``, the plot and the recipe go.

    Returns:
        The results dict (as ``results.json``).

    Raises:
        EvalError: a missing directory, a non-MoE model, an unknown architecture, a model
            that does not fit in memory.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    import moewire
    import moewire.integrations.transformers as mt
    from moewire.study.comm import INTERCONNECTS, comm_time, uniform_traffic

    path = Path(checkpoint)
    config = _check_dir(path)
    _check_kernel(kernel, mma_type)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if text is None:
        text = (Path(moewire.__file__).parent / "data" / "calibration.txt").read_text()
    vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    ids = _tokens(path, text, vocab)[: max_tokens + 1]
    n_windows = max(1, (ids.numel() - 1) // seq_len)
    windows = [ids[i * seq_len : (i + 1) * seq_len + 1] for i in range(n_windows)]
    inputs = [w[:-1].to(dev) for w in windows]
    targets = torch.cat([w[1:] for w in windows])
    tokens = sum(w.numel() for w in inputs)
    runs = 1 + len(pairs) + len(recipes)
    need, have = _estimate_bytes(path, config, tokens), _available_bytes(dev)
    log(f"eval: {path.name}: {tokens} tokens in {n_windows} windows, {runs} runs "
        f"(+{per_layer and 'one per layer' or 'none'}), memory needed about {need / 2**30:.2f} "
        f"GiB of {have / 2**30:.2f} GiB free on {dev}")
    if need > have:
        raise EvalError(
            f"memory: about {need / 2**30:.2f} GiB needed, {have / 2**30:.2f} GiB free on "
            f"{dev}; lower --max-tokens or use a larger device"
        )
    mt.register()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, experts_implementation=mt.IMPLEMENTATION, dtype=torch.bfloat16,
        local_files_only=True,
    ).to(dev)
    model.eval()
    mt.prepare(model, mma_type, max_num_tokens=seq_len, kernel=kernel)
    mma_type = mma_type or next(iter(mt.KERNELS[kernel]))
    modules = mt.experts_modules(model)
    hidden, link = int(model.config.hidden_size), INTERCONNECTS[interconnect]
    traffic = uniform_traffic(ep_size, 4096, int(model.config.num_experts_per_tok))

    def wire(dispatch: str, combine: str) -> tuple[float, float]:
        from moewire.study.wire import format_bits

        nbytes = (format_bits(dispatch, hidden) + format_bits(combine, hidden)) / 8
        return nbytes, comm_time(link, traffic, dispatch, combine, hidden).comm_us

    def run(name: str, recipe: Any, dispatch: str, combine: str,
            base: tuple | None = None) -> tuple[PairResult, tuple]:
        started = time.perf_counter()
        moewire.quantize(model, recipe, lambda m: _forward(m, inputs[:1], []))
        try:
            logits, layers = _forward(model, inputs, modules)
        finally:
            moewire.unquantize(model)
        base_logits, base_layers = base if base is not None else (logits, layers)
        ppl, kl, p99, agree = _metrics(logits, base_logits, targets)
        rel = {n: ((layers[n] - base_layers[n]).norm() / base_layers[n].norm()).item()
               for n in layers}
        nbytes, us = wire(dispatch, combine)
        speed = tokens / (time.perf_counter() - started)
        log(f"eval: {name}: ppl {ppl:.4f}, KL mean {kl:.3e}, p99 {p99:.3e}, top-1 "
            f"{agree:.4f} ({speed:.0f} tokens/s)")
        return PairResult(name, dispatch, combine, ppl, kl, p99, agree, nbytes, us, rel), (
            logits, layers)

    started = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    baseline, base = run("bf16:bf16", {"quant_cfg": pair_entries(*BASELINE)}, *BASELINE)
    log(f"eval: the baseline took {time.perf_counter() - started:.1f} s; about "
        f"{(time.perf_counter() - started) * (runs - 1):.0f} s to go")
    results = [baseline]
    for dispatch, combine in pairs:
        results.append(run(f"{dispatch}:{combine}", {"quant_cfg": pair_entries(dispatch, combine)},
                           dispatch, combine, base)[0])
    for recipe in recipes:
        d, c = _recipe_pair(recipe, modules[0][0])
        results.append(run(str(recipe), recipe, d, c, base)[0])
    report: dict[str, Any] = {
        "checkpoint": str(path), "model_type": config.get("model_type"), "tokens": tokens,
        "kernel": kernel, "mma_type": mma_type, "device": str(dev), "interconnect": interconnect,
        "ep_size": ep_size, "seconds": time.perf_counter() - started,
        "tokens_per_second": tokens * len(results) / (time.perf_counter() - started),
        "peak_memory_bytes": (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"
                              else None),
        "pairs": [asdict(r) for r in results],
    }
    if budget is not None:
        within = [r for r in results[1:] if r.kl_mean <= budget]
        best = min(within, key=lambda r: (r.bytes_per_token, r.kl_mean), default=None)
        report["budget"] = {"kl": budget, "verdict": best.name if best else None}
        log(f"eval: budget KL {budget:g}: " + (
            f"{best.name} ({best.bytes_per_token:.0f} bytes per routed token)" if best
            else "no pair is within budget; keep the BF16 wire"))
    if per_layer is not None:
        report["per_layer"] = _per_layer(model, modules, per_layer, run, base, budget,
                                         report.get("budget", {}).get("verdict"), out_dir, log)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(report, indent=1))
        _plot(results, out / "kl.png")
    return report


def choose_layers(sensitivity: dict[int, float], budget: float) -> list[int]:
    """The layers that take the low-precision pair: from the least sensitive up (ties by
    layer index), while their KLs sum within ``budget``; sorted.

    Args:
        sensitivity: layer index -> mean KL with only that layer quantized.
        budget: the mean-KL budget.
    """
    chosen, total = [], 0.0
    for n in sorted(sensitivity, key=lambda layer: (sensitivity[layer], layer)):
        if total + sensitivity[n] > budget:
            break
        chosen.append(n)
        total += sensitivity[n]
    return sorted(chosen)


def _recipe_pair(recipe: str, module_name: str) -> tuple[str, str]:
    """The dispatch and combine formats a recipe gives ``module_name``'s quantizers (BF16
    where it gives none): what the bytes and the wire time of a recipe are counted from."""
    from moewire import recipes
    from moewire.config import parse_cfg

    loaded = recipes.load(recipe)

    def fmt(kind: str) -> str:
        cfg = loaded.match(f"{module_name}.{kind}_quantizer")
        spec = None if cfg is None else parse_cfg(cfg)
        return spec.fmt if spec is not None and spec.enable else "bf16"

    return fmt("dispatch"), fmt("combine")


def _per_layer(model, modules, pair, run, base, budget, verdict, out_dir, log) -> dict[str, Any]:
    import re

    layer_ids = [int(re.search(r"layers\.(\d+)\.", n).group(1)) for n, _ in modules]
    sensitivity = {}
    for n in layer_ids:
        entries = pair_entries(*pair, [n])
        sensitivity[n] = run(f"{pair[0]}:{pair[1]}@layer{n}", {"quant_cfg": entries},
                             *pair, base)[0].kl_mean
    result: dict[str, Any] = {"pair": list(pair), "kl_by_layer": sensitivity}
    if budget is not None:
        chosen = choose_layers(sensitivity, budget)
        high = tuple(verdict.split(":")) if verdict else BASELINE
        yaml_text = mixed_recipe_yaml(pair, sorted(chosen), high,
                                      f"{pair[0]}:{pair[1]} on layers {sorted(chosen)}, "
                                      f"{high[0]}:{high[1]} elsewhere (moewire eval)")
        result.update(layers=sorted(chosen), elsewhere=list(high))
        if out_dir is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            recipe_path = Path(out_dir) / "mixed_recipe.yaml"
            recipe_path.write_text(yaml_text)
            result["recipe"] = str(recipe_path)
            log(f"eval: mixed recipe -> {recipe_path} ({pair[0]}:{pair[1]} on layers "
                f"{sorted(chosen)})")
    return result


def _plot(results: list[PairResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "bytes_per_token", "bytes per routed token"),
                           (axes[1], "wire_us", "estimated wire time per layer (us)")):
        for r in results:
            ax.scatter(getattr(r, key), max(r.kl_mean, 1e-12))
            ax.annotate(r.name, (getattr(r, key), max(r.kl_mean, 1e-12)), fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel("mean KL to the BF16 wire")
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(report: dict[str, Any]) -> str:
    """The results as a plain-text table."""
    head = (f"{'pair':<24}{'ppl':>10}{'KL mean':>11}{'KL p99':>11}{'top-1':>8}"
            f"{'bytes/tok':>11}{'wire us':>9}")
    rows = [head]
    for r in report["pairs"]:
        rows.append(f"{r['name']:<24}{r['perplexity']:>10.4f}{r['kl_mean']:>11.3e}"
                    f"{r['kl_p99']:>11.3e}{r['top1_agreement']:>8.4f}"
                    f"{r['bytes_per_token']:>11.0f}{r['wire_us']:>9.1f}")
    return "\n".join(rows)
