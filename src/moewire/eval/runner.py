"""``moewire eval``: what a wire format pair does to a whole transformers MoE model.

For a local checkpoint (its files only: ``local_files_only=True``) with
``experts_implementation="moewire"`` (:mod:`moewire.integrations.transformers`), every run
(a pair, a recipe, a pair on one layer) is compared with the same model on a BF16 wire:

- perplexity ``exp(mean_t -log p(x_{t+1}))``;
- ``KL_t = sum_v p0_t(v) (log p0_t(v) - log p_t(v))`` (float64), its mean and 99th
  percentile over positions;
- top-1 agreement ``mean_t [argmax p_t == argmax p0_t]``;
- per layer, the relative L2 ``||y - y0|| / ||y0||`` of the experts' output;
- bytes per routed token (dispatch + combine, ``WireFormat.wire_bits``, averaged over the
  layers for a recipe) and the estimated wire time of one layer
  (``moewire.study.comm.comm_time``: the study's time model);
- with ``tasks``, lm-evaluation-harness's accuracy and its stderr (:mod:`moewire.eval.tasks`).

How it runs (one model, in lockstep):

1. Every check before the model loads (:func:`moewire.eval.checks.preflight`,
   :func:`moewire.eval.plan.plan`).
2. The experts modules are converted once; each run's quantizers are made and calibrated on
   the first window (``moewire.quantize(..., forward_loop)``) and kept. The baseline's are
   disabled: the converted module then runs the kernel's own output, bit for bit what the
   ``bf16:bf16`` pair gives (its re-sum of BF16 rows equals the kernel's sum, which the
   layout check asserts), at no extra cost.
3. Window by window, the baseline runs, then every other run on the same tokens with its
   quantizers swapped in; the metrics of the window are added on the model's device
   (:class:`moewire.eval.metrics.Totals`, :class:`moewire.eval.session.Session`) and the
   window's logits are dropped. Memory does
   not grow with ``max_tokens`` (8 bytes per token and run for the exact KL percentile).
4. With ``per_layer`` and ``budget``, the mixed recipe is measured as one more run and
   backed off layer by layer until it is within the budget (:mod:`moewire.eval.recipe`).
5. The tasks (lm-eval), run by run.

Nothing finished is lost: ``out_dir`` is claimed before the model loads
(:func:`moewire.outputs.prepare_output_dir`: an earlier run's files are refused, or removed
with ``force``), and ``results.json`` is written atomically as soon as the metrics are
measured, again after the mixed recipe, after each run's tasks, and at the end
(``"complete": true``). A task that fails ends the run with one line
(:class:`TasksFailed`, also ``results.json``'s ``"error"``) after the metrics are on disk;
a ``KeyboardInterrupt`` leaves the complete files and the ``INTERRUPTED`` marker
(:func:`moewire.outputs.mark_interrupted`), then propagates.

``results.json`` (schema :data:`SCHEMA`, as the study's): ``schema``, ``versions``
(moewire, torch, transformers, python), ``checkpoint`` (absolute path), ``config_sha256``
(of its ``config.json`` bytes), ``text`` (``source``, ``sha256`` of its UTF-8 bytes,
``chars``), ``settings`` (the :class:`~moewire.eval.settings.EvalConfig`, without the text)
and, per run, the metrics.

The Hub is never forced offline: the checkpoint is read from its directory alone, and a
task's dataset is fetched when the environment allows it (``HF_HUB_OFFLINE`` /
``HF_DATASETS_OFFLINE`` unset) or read from the datasets cache when it does not
(:func:`moewire.eval.tasks.check_tasks` resolves every dataset before the model loads).

Across ranks (``torchrun --nproc-per-node N -m moewire eval PATH``): the model is loaded
with transformers' ``DistributedConfig(tp_size=N, ep_size=N, ep_implementation="moewire")``
(:mod:`moewire.integrations.transformers.ep`): each rank holds ``E / N`` experts and its
share of the attention, and every rank runs every window (``MegaMoeEP`` slices the shared
batch itself), calibrates with amaxes reduced over the EP group, and computes the same
metrics from the same logits, which are checked to be the same on every rank bit for bit
after the windows (:meth:`moewire.eval.metrics.Totals.differing_runs`). Rank 0 alone logs
and writes the files. The numbers differ from a one-rank run of the same model only where
tensor parallelism adds partial BF16 sums (attention's row-parallel output projection) in
another order; with ``tensor_parallel=False`` (the dense layers whole on every rank) they
equal it bit for bit (docs/eval.md, "Across ranks").
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moewire.eval.checks import Checked, EvalError, Ranks
from moewire.eval.plan import Plan, Windows, _agree_on_refusal, make_plan
from moewire.eval.recipe import (
    WireCost,
    fit_mixed,
    mixed_entries,
    mixed_recipe_yaml,
    pair_entries,
    recipe_formats,
    wire_cost,
)
from moewire.eval.session import Run, Session, frames_released
from moewire.eval.settings import BASELINE, DEFAULT_PAIRS, EvalConfig, ProgressFn, config_from
from moewire.outputs import OutputDir, mark_interrupted, prepare_output_dir
from moewire.study.verdict import Budget, cheapest_within

__all__ = ["BASELINE", "DEFAULT_PAIRS", "SCHEMA", "EvalConfig", "PairResult", "TasksFailed",
           "evaluate"]

#: The ``schema`` of the ``results.json`` an eval writes.
SCHEMA = 1
#: Every file an eval may write into ``out_dir`` (``moewire.outputs``: an earlier run's).
FILES = frozenset({"results.json", "kl.png", "mixed_recipe.yaml"})
_EMBEDDED_TEXT = "moewire/data/calibration.txt (embedded)"


class TasksFailed(EvalError):
    """lm-eval failed on a run after the metrics were measured (and written, with
    ``out_dir``): ``"--tasks: <run>: <cause>; <where the results are>"``."""


@dataclass
class PairResult:
    """One run (a pair, a recipe, the mixed recipe) measured against the BF16 wire.

    Attributes:
        name: ``"fp8:nvfp4"``, a recipe's name or path, ``"mixed (...)"``.
        dispatch, combine: the formats of every layer, or ``"mixed"``.
        perplexity, kl_mean, kl_p99, top1_agreement: the metrics (module docstring).
        bytes_per_token: dispatch + combine bytes of one routed token, mean over layers.
        wire_us: one layer's estimated dispatch + combine time, mean over layers.
        layer_rel_l2: experts module name -> relative L2 of its output.
        tokens_per_second: tokens over this run's forward and metrics time.
        tasks: lm-eval scores, ``{task: {metric: {"value", "stderr"}}}``.
    """

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
    tokens_per_second: float = 0.0
    tasks: dict[str, Any] = field(default_factory=dict)


def _replicated_plan(checked: Checked) -> dict[str, str]:
    """Every rule of the model's tensor-parallel plan as ``"replicate"`` (transformers 5.23
    ``distributed/tensor_parallel.py``: a layer left whole on every rank). An override can
    only change rules (``_resolve_parallel_plans`` merges it into the model's plan, and an
    empty one is no plan), so every rule is named; the plan is read from the model built on
    the meta device."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(checked.path, local_files_only=True)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    return dict.fromkeys(skeleton.tp_plan, "replicate")


def _load(checked: Checked, seq_len: int, mma_type: str | None, kernel: str,
          world: int = 1, tensor_parallel: bool = True) -> nn.Module:
    import transformers

    import moewire.integrations.transformers as mt

    mt.register()
    if world > 1:
        from transformers.distributed import DistributedConfig

        # MegaMoeEP needs every rank of the EP group to hold the same batch: tp_size ==
        # ep_size. transformers places each rank on its device (Ranks, checks.py).
        model = transformers.AutoModelForCausalLM.from_pretrained(
            checked.path, experts_implementation=mt.IMPLEMENTATION, dtype=torch.bfloat16,
            local_files_only=True, distributed_config=DistributedConfig(
                tp_size=world, ep_size=world, ep_implementation=mt.ep.IMPLEMENTATION,
                tp_plan=None if tensor_parallel else _replicated_plan(checked)))
    else:
        # With accelerate, the weights go straight to the GPU (no copy in host memory).
        direct = (checked.device.type == "cuda"
                  and importlib.util.find_spec("accelerate") is not None)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            checked.path, experts_implementation=mt.IMPLEMENTATION, dtype=torch.bfloat16,
            local_files_only=True, device_map=str(checked.device) if direct else None,
        ).to(checked.device)
    model.eval()
    mt.prepare(model, mma_type, max_num_tokens=seq_len, kernel=kernel)
    return model


def _line_progress(log: Callable[[str], None]) -> ProgressFn:
    """Progress as log lines (no terminal): at most about ten per stage, each with the
    time so far and an estimate of the time to go. A stage starts at its ``done == 0``
    call."""
    started: dict[str, float] = {}
    shown: dict[str, int] = {}

    def progress(stage: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if done == 0:
            started[stage], shown[stage] = now, 0
            return
        begin = started.setdefault(stage, now)
        step = max(1, total // 10)
        if done != total and done - shown.get(stage, 0) < step:
            return
        shown[stage] = done
        elapsed = now - begin
        rest = elapsed / done * (total - done) if done else 0.0
        log(f"eval: {stage} {done}/{total}: {elapsed:.1f} s so far, about {rest:.0f} s to go")

    return progress



def evaluate(
    checkpoint: str | os.PathLike,
    config: EvalConfig | Sequence[tuple[str, str]] | None = None,
    *,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
    progress: ProgressFn | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """Measure each pair (and recipe) against the same model on a BF16 wire.

    ``evaluate(path, EvalConfig(pairs=[("fp8", "nvfp4")], budget=1e-3))``, or the config's
    fields as keyword arguments: ``evaluate(path, [("fp8", "nvfp4")], budget=1e-3)`` builds
    the same config (the second argument is then the pairs). A config is used as given:
    keyword fields beside it are refused, never merged
    (:func:`moewire.eval.settings.config_from`).

    Args:
        checkpoint: a local checkpoint directory.
        config: what to measure (:class:`~moewire.eval.settings.EvalConfig`, whose fields
            say what each does), or the pairs, or ``None``: built from ``fields``.
        log: where the progress lines go (rank 0's only).
        progress: ``progress(stage, done, total)``, called with ``done == 0`` as a stage
            (``"calibration"``, ``"window"``, ``"mixed recipe window"``, ``"tasks"``) starts
            and after each step (default: a few log lines per stage with the time to go).
        **fields: :class:`~moewire.eval.settings.EvalConfig`'s fields, without a config.

    Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank calls it with the same arguments: the
    model is sharded by expert parallelism over the ranks (module docstring), every rank
    returns the same metrics, and rank 0 alone logs and writes the files.

    Returns:
        The results dict (as ``results.json``).

    Raises:
        TypeError: a config and keyword fields together, or a keyword that is no field.
        EvalError: any argument or file that is wrong, before the model loads (the message
            names it and the fix), or a run that does not fit in memory; under several
            ranks, a refusal of any rank, on every rank. ``out_dir`` holding an earlier
            run's files without ``force``.
        TasksFailed: lm-eval failed after the metrics were measured and written.
        KeyboardInterrupt: after the complete files are left and marked (module docstring).
    """
    # An error's traceback must not keep the model, or the windows on its device, alive.
    with frames_released():
        return _evaluate(checkpoint, config, log, progress, fields)


def _evaluate(checkpoint: str | os.PathLike, config: EvalConfig | Sequence[tuple[str, str]] | None,
              log: Callable[[str], None], progress: ProgressFn | None,
              fields: dict[str, Any]) -> dict[str, Any]:
    config = config_from(config, fields)
    ranks = Ranks.from_env()
    if ranks.rank != 0:
        log, progress = (lambda s: None), (lambda stage, done, total: None)
    plan = make_plan(checkpoint, config, log, ranks)
    try:
        out = _claim_out(plan, log)
        try:
            return _run_plan(plan, out, log, progress or _line_progress(log))
        except KeyboardInterrupt:
            if out is not None:
                marker = mark_interrupted(out.path)
                log(f"eval: interrupted; {out.path} holds only complete files"
                    + (f" ({marker.name} lists them)" if marker else " (none was written)"))
            raise
    finally:
        if plan.joined:
            import torch.distributed as dist

            dist.destroy_process_group()


def _claim_out(plan: Plan, log: Callable[[str], None]) -> OutputDir | None:
    """Rank 0's output directory, an earlier run's files refused or (``force``) removed; under
    several ranks a refusal is raised on every rank."""
    out, refused = None, None
    if plan.out is not None:
        try:
            out = prepare_output_dir(plan.out, "eval", FILES, plan.config.force, log, EvalError)
        except EvalError as exc:
            refused = exc
    if plan.ranks.world > 1:
        _agree_on_refusal(refused)
    elif refused is not None:
        raise refused
    return out


def _versions() -> dict[str, str]:
    import transformers

    import moewire

    return {"moewire": moewire.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def _settings(config: EvalConfig) -> dict[str, Any]:
    """The config as JSON values (paths as strings, pairs as lists), without the text
    itself (``text`` records its source and hash)."""
    fields = {k: v for k, v in asdict(config).items() if k not in ("text", "text_source")}
    return json.loads(json.dumps(fields, default=str))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _text_record(config: EvalConfig) -> dict[str, Any]:
    """Which text was evaluated: its source, the SHA-256 of its UTF-8 bytes, its length."""
    if config.text is None:
        import moewire

        text = (Path(moewire.__file__).parent / "data" / "calibration.txt").read_text()
        source = _EMBEDDED_TEXT
    else:
        text, source = config.text, config.text_source or "the text argument"
    return {"source": source, "sha256": _sha256(text.encode("utf-8")), "chars": len(text)}


def _runs(plan: Plan, names: list[str], cost: Callable) -> tuple[list[Run], list[Run]]:
    """The main runs (the baseline, the pairs, the recipes) and the per-layer probes."""
    main = [Run("bf16:bf16", None, cost([BASELINE] * len(names)))]
    main += [Run(f"{d}:{c}", {"quant_cfg": pair_entries(d, c)}, cost([(d, c)] * len(names)))
             for d, c in plan.checked.pairs]
    main += [Run(r, r, cost(recipe_formats(r, names))) for r in plan.checked.recipes]
    low = plan.config.per_layer
    probes = [] if low is None else [
        Run(f"{low[0]}:{low[1]}@layer{_layer_index(n)}",
            {"quant_cfg": pair_entries(*low, [_layer_index(n)])},
            cost([low if m == n else BASELINE for m in names]))
        for n in names]
    return main, probes


def _run_plan(plan: Plan, out: OutputDir | None, log: Callable[[str], None],
              progress: ProgressFn) -> dict[str, Any]:
    """Load the model, calibrate every run, measure them in lockstep, then the mixed recipe
    and the tasks; write ``results.json`` after each (module docstring)."""
    import moewire.integrations.transformers as mt
    from moewire.study.comm import INTERCONNECTS, comm_time, uniform_traffic

    config, dev, windows = plan.config, plan.checked.device, plan.windows
    started = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    model = _load(plan.checked, config.seq_len, config.mma_type, config.kernel, plan.ranks.world,
                  config.tensor_parallel)
    modules = mt.experts_modules(model)
    names = [n for n, _ in modules]
    hidden = int(model.config.hidden_size)
    link = INTERCONNECTS[config.interconnect]
    traffic = uniform_traffic(config.time_ep_size, 4096, int(model.config.num_experts_per_tok))

    def cost(per_module: list[tuple[str, str]]) -> WireCost:
        return wire_cost(per_module, hidden,
                         lambda d, c: comm_time(link, traffic, d, c, hidden).comm_us)

    main, probes = _runs(plan, names, cost)
    every = main + probes
    path = plan.checked.path.resolve()
    report: dict[str, Any] = {
        "schema": SCHEMA, "complete": False, "versions": _versions(),
        "checkpoint": str(path), "config_sha256": _sha256((path / "config.json").read_bytes()),
        "model_type": plan.checked.config.get("model_type"), "text": _text_record(config),
        "settings": _settings(config),
        "tokens": windows.tokens, "windows": len(windows.inputs), "seq_len": config.seq_len,
        "kernel": config.kernel,
        "mma_type": config.mma_type or next(iter(mt.KERNELS[config.kernel])),
        "device": str(dev), "ranks": plan.ranks.world,
        "tensor_parallel": config.tensor_parallel and plan.ranks.world > 1,
        "interconnect": config.interconnect,
        "time_ep_size": config.time_ep_size,
    }
    if plan.tasks:
        report["tasks"] = list(plan.tasks)
    loaded = time.perf_counter()
    report["seconds"] = {"load": loaded - started}
    session = Session(model, modules, windows.inputs[0], dev, config.cuda_graph)
    try:
        progress("calibration", 0, len(every))
        for i, run in enumerate(every):
            session.calibrate(run)
            progress("calibration", i + 1, len(every))
        calibrated = time.perf_counter()
        totals = session.measure(every, windows, progress, "window")
        measured = time.perf_counter()
        report["seconds"].update(calibrate=calibrated - loaded, measure=measured - calibrated,
                                 capture=session.capture_seconds)
        report["cuda_graph"] = {"used": session.cuda_graph,
                                "pool_bytes": session.graph_reserved_bytes,
                                "fallback": session.graph_fallback}
        if session.graph_fallback is not None:
            log(f"eval: CUDA graphs dropped: {session.graph_fallback}")
        report["tokens_per_second"] = windows.tokens * len(every) / (measured - calibrated)
        results = [_result(run, totals.result(i), windows.tokens) for i, run in enumerate(main)]
        for r in results:
            log(f"eval: {r.name}: ppl {r.perplexity:.4f}, KL mean {r.kl_mean:.3e}, p99 "
                f"{r.kl_p99:.3e}, top-1 {r.top1_agreement:.4f} ({r.tokens_per_second:.0f} "
                "tokens/s)")
        if config.budget is not None:
            report["budget"] = _verdict(results, config.budget, log)
        if config.per_layer is not None:
            by_layer = {_layer_index(n): totals.result(len(main) + i)
                        for i, n in enumerate(names)}
            report["per_layer"] = {"pair": list(config.per_layer),
                                   "kl_by_layer": {n: r["kl_mean"] for n, r in by_layer.items()}}
            low = config.per_layer
            log(f"eval: {low[0]}:{low[1]} on one layer at a time, KL mean by layer: "
                + ", ".join(f"{n}: {r['kl_mean']:.3e}" for n, r in by_layer.items()))
            if config.budget is not None:
                _save(out, report, results, dev)
                mixed = _mixed(session, main[0], config.per_layer, by_layer, results,
                               config.budget, names, cost, windows, progress, log,
                               report["per_layer"])
                if mixed is not None:
                    main.append(mixed[0])
                    results.append(mixed[1])
                    if out is not None:
                        recipe_path = out.write("mixed_recipe.yaml", mixed[2])
                        report["per_layer"]["recipe"] = str(recipe_path)
                        log(f"eval: mixed recipe -> {recipe_path}")
        _save(out, report, results, dev, plot=True)
        if plan.tasks:
            try:
                _tasks(session, plan, main, results, progress,
                       lambda: _save(out, report, results, dev))
            except TasksFailed as exc:
                report["error"] = str(exc)
                _save(out, report, results, dev)
                raise
    finally:
        session.close()
    report["seconds"]["total"] = time.perf_counter() - started
    report["complete"] = True
    _save(out, report, results, dev)
    if out is not None:
        out.complete()
    return report


def _save(out: OutputDir | None, report: dict[str, Any], results: list[PairResult],
          dev: torch.device, plot: bool = False) -> None:
    """``report`` with the results so far, written to ``results.json`` (atomically), and with
    ``plot`` the KL plot ``kl.png``."""
    report["peak_memory_bytes"] = (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"
                                   else None)
    report["pairs"] = [asdict(r) for r in results]
    if out is None:
        return
    out.write("results.json", json.dumps(report, indent=1))
    if plot:
        from moewire.eval.report import plot_png

        out.write("kl.png", plot_png(report))


def _verdict(results: list[PairResult], budget: float,
             log: Callable[[str], None]) -> dict[str, Any]:
    """The cheapest run (fewest bytes per routed token) whose mean KL is within ``budget``."""
    best = _cheapest(results[1:], budget)  # the baseline (KL 0) is no candidate
    log(f"eval: budget KL {budget:g}: " + (
        f"{best.name} ({best.bytes_per_token:.0f} bytes per routed token)" if best
        else "no pair is within budget; keep the BF16 wire"))
    return {"kl": budget, "verdict": best.name if best else None}


def _cheapest(results: list[PairResult], budget: float) -> PairResult | None:
    """The verdict's rule (:func:`moewire.study.verdict.cheapest_within`, the study's too):
    the fewest bytes per routed token within the mean-KL budget, then the lower KL. Bytes
    are exact, so no cost tolerance."""
    return cheapest_within(results, Budget("kl_mean", budget), "bytes_per_token", "kl_mean",
                           cost_rtol=0.0)


def _tasks(session: Session, plan: Plan, runs: list[Run], results: list[PairResult],
           progress: ProgressFn, save: Callable[[], None]) -> None:
    """lm-eval's tasks on each run, its quantizers installed; ``save()`` after each run.

    Raises:
        TasksFailed: lm-eval failed on a run (one line: the run, the exception's first line,
            where the metrics are).
    """
    from moewire.eval.tasks import run_tasks

    progress("tasks", 0, len(runs))
    for i, (run, result) in enumerate(zip(runs, results, strict=True)):
        session.install(run)
        try:
            result.tasks = run_tasks(session.model, plan.tokenizer, plan.task_manager,
                                     plan.tasks, device=plan.checked.device,
                                     limit=plan.config.task_limit)
        except Exception as exc:
            cause = (str(exc).strip().splitlines() or [""])[0]
            where = (f"the perplexity, KL and top-1 results are in {plan.out / 'results.json'}"
                     if plan.out is not None else "pass --out to keep the perplexity, KL and "
                     "top-1 results of a run whose tasks fail")
            raise TasksFailed("--tasks", f"lm-eval failed on run {run.name} "
                              f"({type(exc).__name__}: {cause}); {where}") from exc
        save()
        progress("tasks", i + 1, len(runs))


def _layer_index(module_name: str) -> int:
    import re

    return int(re.search(r"layers\.(\d+)\.", module_name).group(1))


def _result(run: Run, metrics: dict[str, Any], tokens: int) -> PairResult:
    return PairResult(run.name, run.cost.dispatch, run.cost.combine, metrics["perplexity"],
                      metrics["kl_mean"], metrics["kl_p99"], metrics["top1_agreement"],
                      run.cost.bytes_per_token, run.cost.wire_us, metrics["layer_rel_l2"],
                      tokens / run.seconds if run.seconds else 0.0)


def _mixed(session: Session, baseline: Run, low: tuple[str, str],
           by_layer: dict[int, dict[str, Any]], results: list[PairResult], budget: float,
           names: list[str], cost: Callable, windows: Windows, progress: ProgressFn,
           log: Callable[[str], None],
           out: dict[str, Any]) -> tuple[Run, PairResult, str] | None:
    """Choose, measure and back off the mixed recipe (:func:`moewire.eval.recipe.fit_mixed`);
    fills ``out`` and returns the accepted run, its result and its YAML, or ``None``.

    Elsewhere goes the cheapest pair within the budget (a recipe with several formats
    cannot be the rest of a mixed recipe), or BF16; its KL counts against the budget."""
    safer = _cheapest([r for r in results[1:] if "mixed" not in (r.dispatch, r.combine)],
                      budget)
    high = (safer.dispatch, safer.combine) if safer else BASELINE
    spent = safer.kl_mean if safer else 0.0
    sensitivity = {n: r["kl_mean"] for n, r in by_layer.items()}
    measured: dict[tuple[int, ...], tuple[Run, PairResult]] = {}
    index = {_layer_index(n): n for n in names}

    def measure(layers: list[int]) -> float:
        entries = mixed_entries(low, layers, high)
        chosen = {index[n] for n in layers}
        run = Run(f"mixed ({low[0]}:{low[1]} on {len(layers)}/{len(names)})",
                  {"quant_cfg": entries},
                  cost([low if n in chosen else high for n in names]))
        base = Run(baseline.name, None, baseline.cost, baseline.quantizers)
        session.calibrate(run)
        totals = session.measure([base, run], windows, progress, "mixed recipe window")
        result = _result(run, totals.result(1), windows.tokens)
        measured[tuple(layers)] = run, result
        log(f"eval: mixed recipe, {low[0]}:{low[1]} on layers {layers}: KL mean "
            f"{result.kl_mean:.3e} measured (budget {budget:g})")
        return result.kl_mean

    layers, attempts = fit_mixed(sensitivity, budget, spent, measure)
    out.update(elsewhere=list(high), layers=layers,
               attempts=[asdict(a) | {"layers": list(a.layers)} for a in attempts])
    if not layers:
        log(f"eval: no mixed recipe: no layer takes {low[0]}:{low[1]} within the budget on "
            f"top of {high[0]}:{high[1]}")
        return None
    run, result = measured[tuple(layers)]
    out.update(kl_mean=result.kl_mean, bytes_per_token=result.bytes_per_token,
               wire_us=result.wire_us)
    return run, result, mixed_recipe_yaml(
        low, layers, high, f"{low[0]}:{low[1]} on layers {layers}, {high[0]}:{high[1]} "
        f"elsewhere (moewire eval: measured KL {result.kl_mean:.3e}, budget {budget:g})")
