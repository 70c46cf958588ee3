"""The ``moewire`` command: ``moewire study`` (the main job), ``moewire eval`` (a whole model),
``moewire checkpoint`` (a tiny random model to try it on), ``moewire formats`` and
``moewire builds``.

Exit codes: 0 on success, 2 on a bad argument (argparse's convention; one line that names
the argument and the fix, the usage block only for ``--help``), 130 when interrupted
(Ctrl-C: one line, no traceback, as a shell reports SIGINT), 1 on any other failure.

``study`` and ``eval`` share one vocabulary: ``--kernel stand-in`` or ``deepgemm-sm90``
(``reference``, the study's former name, still works with a deprecation notice), format
names in any case (``FP8:NVFP4`` is ``fp8:nvfp4``), and a ``--budget`` that must be above 0
(a bound no quantized pair can meet is refused before any work).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def _rank0() -> bool:
    """Whether this process speaks for the run: rank 0 under ``torchrun``, or not under it
    (a ``RANK`` that is not a number counts as rank 0, so that someone says it)."""
    rank = os.environ.get("RANK", "0")
    return not rank.isdigit() or int(rank) == 0


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument said in one line (``moewire eval: error: argument
    --budget: ...; see moewire eval --help``) instead of the usage block and the line, and
    said once under ``torchrun`` (every rank parses the same arguments)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n"
                  if _rank0() else None)


def _kernel(text: str) -> str:
    """An argparse type: a ``--kernel`` name in any case; ``reference`` (the study's former
    name of the stand-in) with a deprecation notice."""
    from moewire.study.settings import KERNEL_ALIASES, KERNELS

    name = text.strip().lower()
    if name in KERNEL_ALIASES:
        if _rank0():
            print(f"moewire: warning: --kernel {name} is deprecated; it is now called "
                  f"--kernel {KERNEL_ALIASES[name]}", file=sys.stderr)
        return KERNEL_ALIASES[name]
    if name not in KERNELS:
        raise argparse.ArgumentTypeError(f"unknown kernel {text!r}; pick one of "
                                         f"{', '.join(KERNELS)}")
    return name


_kernel.__name__ = "kernel"


def _bounded(kind: type, minimum: float, *, strict: bool = False):
    """An argparse type: ``kind(text)`` (``int`` or ``float``) at least ``minimum``, or
    above it with ``strict``; a float must also be finite. Its name and messages say the
    bound (``must be >= 1, got 0``)."""
    op = ">" if strict else ">="
    noun = "an integer" if kind is int else "a number"
    bound = f"{op} {minimum:g}" if kind is float else f"{op} {minimum}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun} {bound}, got {text!r}") from None
        within = value > minimum if strict else value >= minimum
        if kind is int:
            if not within:
                raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        elif not within or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    parse.__name__ = f"{noun.split()[1]} {bound}"
    return parse


def _int_at_least(minimum: int):
    return _bounded(int, minimum)


def _float_at_least(minimum: float):
    return _bounded(float, minimum)


def _float_above(minimum: float):
    return _bounded(float, minimum, strict=True)


def _fraction(text: str) -> float:
    """An argparse type: a relative error in (0, 1] (``0.05`` is 5%)."""
    value = _float_above(0.0)(text)
    if value > 1.0:
        raise argparse.ArgumentTypeError(
            f"is a fraction (a relative L2 error: 0.05 is 5%), at most 1, got {text}; for "
            f"{text}% pass {value / 100:g}")
    return value


_fraction.__name__ = "fraction in (0, 1]"


def _study_parser(sub) -> argparse.ArgumentParser:
    from moewire.study.comm import DEFAULT_EP_SIZE, INTERCONNECTS
    from moewire.study.presets import PRESETS
    from moewire.study.settings import (
        DEFAULT_COMBINE,
        DEFAULT_DISPATCH,
        DEFAULT_ROUTER_IMBALANCE,
        KERNELS,
        MMA_TYPES,
        StudyConfig,
    )

    d = StudyConfig()
    p = sub.add_parser(
        "study",
        help="sweep dispatch x combine wire formats on one MoE layer",
        description=(
            "Build one MoE layer on the stand-in Mega-MoE kernel, quantize it with every "
            "dispatch x combine pair (bf16 = no quantizer, the baseline), calibrate, "
            "evaluate on held-out batches and report the layer-output error against the "
            "unquantized layer with the bytes on the wire and the estimated dispatch and "
            "combine time on an interconnect. Writes results.json, error_heatmap.png and "
            "frontier.png (error against time and against bytes) to --out."
        ),
    )
    p.add_argument("--model", choices=list(PRESETS), default=d.model,
                   help=f"layer shapes (default {d.model}: " + PRESETS[d.model].description + ")")
    p.add_argument("--experts", type=_int_at_least(1), default=None,
                   help="routed experts, overriding the preset's")
    p.add_argument("--tokens", type=_int_at_least(1), default=d.tokens,
                   help=f"tokens per batch over all ranks (default {d.tokens})")
    p.add_argument("--ranks", type=_int_at_least(1), default=d.ranks,
                   help="expert-parallel ranks the error sweep simulates in one process "
                   "(default 1); it changes no error, only the reported share of copies that "
                   "leave their rank. The time estimate's EP group is --ep-size; when both "
                   "are given they must agree (docs/study.md)")
    p.add_argument("--dispatch", default=None,
                   help="comma-separated dispatch formats (default "
                   + ",".join(DEFAULT_DISPATCH) + "); bf16 is always included")
    p.add_argument("--combine", default=None,
                   help="comma-separated combine formats (default "
                   + ",".join(DEFAULT_COMBINE) + "); bf16 is always included")
    p.add_argument("--calib-batches", type=_int_at_least(1), default=d.calib_batches,
                   help=f"calibration batches (default {d.calib_batches})")
    p.add_argument("--eval-batches", type=_int_at_least(1), default=d.eval_batches,
                   help=f"held-out evaluation batches (default {d.eval_batches})")
    p.add_argument("--weights", default=None, metavar="PATH.safetensors",
                   help="real expert weights (DeepSeek naming, see docs/study.md); "
                   "needs --layer")
    p.add_argument("--layer", type=_int_at_least(0), default=None, metavar="L",
                   help="layer index to read from --weights")
    p.add_argument("--activations", default=None, metavar="PATH",
                   help="captured hidden states [N, H] (.pt or .safetensors)")
    p.add_argument("--mma", choices=MMA_TYPES, default=d.mma,
                   help="stand-in kernel MMA type (default fp8xfp4, as DeepSeek-V4 serves; "
                   "nvfp4: the NVFP4 Mega-MoE of vLLM 0.33/0.34, unweighted combine rows)")
    p.add_argument("--kernel", type=_kernel, default=d.kernel,
                   metavar="{" + ",".join(KERNELS) + "}",
                   help="stand-in: moewire's stand-in kernel (default; any device); "
                   "deepgemm-sm90: DeepGEMM's real SM90 Mega-MoE kernel (needs a Hopper GPU, "
                   "the package and --device cuda; docs/real-kernel.md)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=d.device)
    p.add_argument("--router-imbalance", type=_float_at_least(1.0), default=None,
                   metavar="X",
                   help="the synthetic router's hottest expert gets X times the mean expected "
                   f"load (default {DEFAULT_ROUTER_IMBALANCE}, as DeepSeek's balanced routing, "
                   "at most E/k; 1 = uniform); ignored with a --weights router")
    t = p.add_argument_group(
        "time estimate", "dispatch and combine time per format on an interconnect, from "
        "published DeepEP figures (docs/study.md, 'Reading the time estimate')")
    t.add_argument("--interconnect", choices=list(INTERCONNECTS), default=None,
                   help=f"interconnect profile (default {d.interconnect}): "
                   + "; ".join(f"{k}: {v.description}" for k, v in INTERCONNECTS.items()))
    t.add_argument("--ep-size", type=_int_at_least(1), default=None, metavar="N",
                   help=f"expert-parallel ranks of the time estimate (default {DEFAULT_EP_SIZE}; "
                   "rdma-cx7: 16, where its figures start; or the largest divisor of the "
                   "expert and token counts below it). Not --ranks, which the error sweep "
                   "simulates")
    t.add_argument("--ep-tokens", type=_int_at_least(1), default=None, metavar="T",
                   help="tokens each rank dispatches per step (default --tokens / --ranks)")
    t.add_argument("--link-gbps", type=_float_above(0.0), default=None, metavar="GB/s",
                   help="override the profile's bandwidth per GPU (GB/s > 0, every EP size)")
    t.add_argument("--link-latency-us", type=_float_at_least(0.0), default=None, metavar="US",
                   help="override the profile's latency per dispatch or combine (us)")
    t.add_argument("--from", dest="from_json", default=None, metavar="results.json",
                   help="re-apply the time estimate (the flags of this group) to a finished "
                   "sweep's results.json, without running the sweep again (the error does not "
                   "depend on them); writes into --out if given, else into a new directory "
                   "beside the file's (DIR-<interconnect>-ep<N>), never over the file")
    v = p.add_argument_group(
        "verdict", "the cheapest pair within an error budget, by estimated time and by bytes, "
        "printed under the table (docs/study.md, 'The verdict')")
    budget = v.add_mutually_exclusive_group()
    budget.add_argument("--budget", type=_fraction, default=None, metavar="REL_L2",
                        help="largest acceptable relative L2 error of the layer output, a "
                        "fraction in (0, 1], e.g. 0.01 for 1%%")
    budget.add_argument("--budget-sqnr", type=_float_above(0.0), default=None,
                        metavar="DB", help="smallest acceptable SQNR (dB), e.g. 40")
    p.add_argument("--seed", type=_int_at_least(0), default=d.seed)
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"output directory (default ./{d.out}/; with --from, a new one beside "
                   "the file's); one that holds an earlier run's files is refused")
    p.add_argument("--force", action="store_true",
                   help="remove an earlier run's files from --out first (only the files a "
                   "moewire run wrote)")
    p.set_defaults(_sweep_defaults={dest: p.get_default(dest) for dest in _SWEEP_FLAGS})
    return p


#: The flags of the error sweep (argparse dest -> flag), which --from cannot change.
_SWEEP_FLAGS = {
    "model": "--model", "experts": "--experts", "tokens": "--tokens", "ranks": "--ranks",
    "dispatch": "--dispatch", "combine": "--combine", "calib_batches": "--calib-batches",
    "eval_batches": "--eval-batches", "weights": "--weights", "layer": "--layer",
    "activations": "--activations", "mma": "--mma", "kernel": "--kernel",
    "device": "--device", "router_imbalance": "--router-imbalance", "seed": "--seed",
}


def _config_from_args(args: argparse.Namespace):
    from moewire.study.settings import StudyConfig, with_formats

    cfg = StudyConfig(
        model=args.model, experts=args.experts, tokens=args.tokens, ranks=args.ranks,
        calib_batches=args.calib_batches, eval_batches=args.eval_batches,
        weights=args.weights, layer=args.layer, activations=args.activations,
        mma=args.mma, device=args.device, seed=args.seed, out=args.out or StudyConfig.out,
        router_imbalance=args.router_imbalance,
        kernel=args.kernel, interconnect=args.interconnect or StudyConfig.interconnect,
        ep_size=args.ep_size,
        ep_tokens=args.ep_tokens, link_gbps=args.link_gbps,
        link_latency_us=args.link_latency_us,
    )
    return with_formats(cfg, args.dispatch, args.combine)


def _line_hooks():
    """Progress for logs (no terminal): one line per stage, per built chunk of experts and
    per finished pair, each saying what is done of what total."""
    from moewire.study.runner import Progress

    return Progress(
        phase=lambda label: print(label, flush=True),
        build=lambda done, total: print(f"  built {done}/{total} experts", flush=True),
        pair_done=lambda done, total, label: print(f"[{done}/{total} pairs done] {label}",
                                                   flush=True),
    )


def _rich_bar(console):
    """A rich progress display with the time so far and the estimated time to go.

    The description is a plain-text column (``markup=False``): a label such as
    ``fp8:nvfp4 [layer 3]`` is shown as written, and the bar renders the same whatever
    markup setting a line printed above it used (a markup string column is drawn with
    the printing call's setting, so a ``markup=False`` log line made it show the literal
    ``[progress.description]``)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as RichProgress

    return RichProgress(TextColumn("{task.description}", markup=False), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                        console=console, transient=True)


def _bar_log(bar):
    """``log(line)`` above a live bar: the line as plain text, never wrapped by rich (a
    terminal narrower than the line folds it, and a copy of it stays one line)."""
    from rich.text import Text

    def log(line: str) -> None:
        bar.console.print(Text(line), soft_wrap=True, highlight=False)

    return log


def _rich_hooks(bar):
    """Progress for a terminal: one bar for the build (experts), then one for the pairs."""
    from moewire.study.runner import Progress

    tasks = {}

    def phase(label: str) -> None:
        if "build" not in tasks:
            tasks["build"] = bar.add_task(label, total=None)
        else:
            bar.update(tasks.get("pairs", tasks["build"]), description=label)

    def build(done: int, total: int) -> None:
        bar.update(tasks["build"], completed=done, total=total)

    def pair_start(done: int, total: int, label: str) -> None:
        if "pairs" not in tasks:
            bar.update(tasks["build"], visible=False)
            tasks["pairs"] = bar.add_task(label, total=total)
        bar.update(tasks["pairs"], completed=done, description=label)

    def pair_done(done: int, total: int, label: str) -> None:
        bar.update(tasks["pairs"], completed=done)

    return Progress(phase=phase, build=build, pair_start=pair_start, pair_done=pair_done)


#: What ``moewire study`` imports beyond torch (import name -> pip name); part of the
#: default install, checked anyway so that a trimmed environment fails before the sweep.
_STUDY_MODULES = {"matplotlib": "matplotlib", "rich": "rich", "safetensors": "safetensors"}


def _missing_study_modules() -> list[str]:
    import importlib.util

    return [pip for module, pip in _STUDY_MODULES.items()
            if importlib.util.find_spec(module) is None]


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning during a study as one clean line (no category, no source line)."""
    print(f"moewire study: warning: {message}", file=sys.stderr, flush=True)


def _budget(args: argparse.Namespace):
    from moewire.study.verdict import Budget

    if args.budget is not None:
        return Budget("rel_l2", args.budget)
    if args.budget_sqnr is not None:
        return Budget("sqnr_db", args.budget_sqnr)
    return None


def _claim(out: Path, force: bool):
    """The study's ``moewire.outputs.OutputDir`` of ``out``, before any work: an earlier
    run's files are refused, or with ``--force`` removed (said on stderr)."""
    from moewire.outputs import prepare_output_dir
    from moewire.study.errors import StudyArgumentError
    from moewire.study.report import FILES

    return prepare_output_dir(out, "study", FILES, force,
                              lambda line: print(f"moewire {line}", file=sys.stderr),
                              StudyArgumentError)


def _sweep(args: argparse.Namespace, tty: bool):
    """Run the error sweep; returns the document and the claimed output directory."""
    import warnings

    from moewire.study.runner import preflight, run_study
    from moewire.study.settings import check_out_dir

    cfg = preflight(_config_from_args(args))
    out = _claim(check_out_dir(cfg.out), args.force)
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        if not tty:
            return run_study(cfg, _line_hooks()), out
        from rich.console import Console

        bar = _rich_bar(Console())
        with bar:
            return run_study(cfg, _rich_hooks(bar)), out


def _retimed(args: argparse.Namespace):
    """``--from``: the finished sweep with the time estimate re-applied."""
    from moewire.study.errors import StudyArgumentError
    from moewire.study.retime import read_results, retime
    from moewire.study.settings import check_out_dir

    changed = [flag for dest, flag in _SWEEP_FLAGS.items()
               if getattr(args, dest) != args._sweep_defaults[dest]]
    if changed:
        raise StudyArgumentError(
            "--from", f"{', '.join(changed)} change{'s' if len(changed) == 1 else ''} the "
            "error sweep, which --from does not "
            "run again (it re-applies only the time estimate); drop them, or run the sweep "
            "without --from"
        )
    doc = read_results(args.from_json)
    changes = {"ep_size": args.ep_size, "ep_tokens": args.ep_tokens,
               "link_gbps": args.link_gbps, "link_latency_us": args.link_latency_us}
    if args.interconnect is not None:
        changes["interconnect"] = args.interconnect
    doc = retime(doc, **changes)
    source = Path(args.from_json).resolve().parent
    if args.out is None:
        import os

        # A new directory beside the sweep's, named for the new time estimate (relative to
        # the working directory, as the user named the file).
        out = Path(os.path.relpath(source.with_name(
            f"{source.name}-{doc['interconnect']['name']}-ep{doc['routing']['ep']['ep_size']}")))
    else:
        out = Path(args.out)
    if out.resolve() == source:
        raise StudyArgumentError(
            "--out", f"{args.out} is the directory of --from's {Path(args.from_json).name}, "
            "whose results and plots it would overwrite; pass another directory, or leave "
            "--out out (a new directory beside it)"
        )
    return doc, _claim(check_out_dir(out), args.force)


def _run_study(args: argparse.Namespace) -> int:
    missing = _missing_study_modules()
    if missing:
        print(f"moewire study: error: it needs {', '.join(missing)}, which this Python lacks; "
              f"run: {sys.executable} -m pip install {' '.join(missing)}", file=sys.stderr)
        return 1
    from moewire.study import report
    from moewire.study.verdict import judge, verdict_lines

    tty = sys.stdout.isatty()
    doc, out = _retimed(args) if args.from_json is not None else _sweep(args, tty)
    judge(doc, _budget(args))
    paths = report.write_all(doc, out.path, out)
    width = 100
    if tty:
        from rich.console import Console

        console = Console()
        width = console.width
        console.print(report.headline(doc))
        console.print(report.rich_table(doc, width=width))
    else:
        print(report.headline(doc))
        print(report.plain_table(doc))
    for line in verdict_lines(doc):
        print(line)
    routing, ranks = doc["routing"], doc["settings"]["ranks"]
    target = routing.get("target_max_over_mean")
    target_text = "" if target is None else f" (router set to {target:g}x expected)"
    ranks_text = ("" if ranks == 1 else f"; {100 * routing['remote_fraction']:.1f}% of copies "
                  f"leave their rank at --ranks {ranks}")
    print(f"routing: hottest expert gets {routing['expert_load_max_over_mean']:.2f}x the mean "
          f"load{target_text}{ranks_text}")
    print(report.time_note(doc, width))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _eval_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "eval",
        help="perplexity, KL, top-1 agreement and task accuracy of wire format pairs on a "
        "local MoE checkpoint",
        description=(
            "Run a local transformers MoE checkpoint (offline) through the Mega-MoE contract "
            "(experts_implementation='moewire') and compare each dispatch:combine pair with "
            "the same model on a BF16 wire, window by window (docs/eval.md). Every argument "
            "and file is checked before the model loads. Across ranks: torchrun "
            "--nproc-per-node N -m moewire eval PATH ... shards the model by expert "
            "parallelism over the N ranks; rank 0 prints and writes the results."
        ),
    )
    p.add_argument("checkpoint", help="local checkpoint directory (config.json, safetensors)")
    p.add_argument("--pairs", nargs="*", default=None, metavar="DISPATCH:COMBINE",
                   help="format pairs (default fp8:fp8 fp8:nvfp4 nvfp4:nvfp4)")
    p.add_argument("--recipe", action="append", default=[],
                   help="a recipe name or YAML path to measure as well (repeatable)")
    p.add_argument("--text", type=Path, default=None,
                   help="UTF-8 text file to evaluate on (default: the embedded calibration text)")
    p.add_argument("--max-tokens", type=_int_at_least(2), default=1024,
                   help="tokens evaluated (default 1024)")
    p.add_argument("--seq-len", type=_int_at_least(2), default=128,
                   help="tokens per window (default 128)")
    p.add_argument("--kernel", type=_kernel, default="stand-in",
                   metavar="{stand-in,deepgemm-sm90}",
                   help="the Mega-MoE kernel (default stand-in; deepgemm-sm90: DeepGEMM's real "
                        "SM90 fp8_mega_moe on a Hopper GPU, FP8 128x128 block-scaled weights)")
    from moewire.reference.catalogue import mma_types

    p.add_argument("--mma", choices=mma_types(user="transformers"), default=None,
                   help="the kernel's build (default: bf16xbf16 for the stand-in, the weights "
                        "stay BF16; fp4xfp4: DeepGEMM 2.8.0's NVFP4 x NVFP4 kernel, weights "
                        "and tokens NVFP4, H and I multiples of 512; fp8xfp8 for "
                        "deepgemm-sm90)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--budget", type=_float_above(0.0), default=None, metavar="KL",
                   help="mean-KL budget (> 0; every quantized pair has some KL): name the "
                   "cheapest pair within it")
    p.add_argument("--per-layer", metavar="DISPATCH:COMBINE", default=None,
                   help="quantize one layer at a time with this pair; with --budget, measure "
                        "and write mixed_recipe.yaml")
    t = p.add_argument_group("task accuracy", "lm-evaluation-harness's tasks on each run "
                             "(from the clone: pip install -e '.[eval]'; docs/eval.md)")
    t.add_argument("--tasks", default=None, metavar="NAME[,NAME]",
                   help="comma-separated lm-eval task names (e.g. gsm8k,arc_easy)")
    t.add_argument("--tasks-path", type=Path, default=None, metavar="DIR",
                   help="a directory of your own task YAML files (lm-eval's --include_path)")
    t.add_argument("--task-limit", type=_int_at_least(1), default=None, metavar="N",
                   help="at most N documents per task (lm-eval's --limit)")
    p.add_argument("--out", type=Path, default=Path("moewire-eval"),
                   help="output directory (default ./moewire-eval); one that holds an earlier "
                   "run's files is refused")
    p.add_argument("--force", action="store_true",
                   help="remove an earlier run's files from --out first (only the files a "
                   "moewire run wrote)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="on a CUDA device (one rank): capture each run's window forward once in "
                        "a CUDA graph and replay it for every window, the eager run's numbers "
                        "bit for bit (default on; --no-cuda-graph runs every window eagerly)")
    p.add_argument("--no-tensor-parallel", action="store_true",
                   help="under torchrun: keep the dense layers (attention, embeddings, shared "
                        "experts) whole on every rank instead of the model's tensor-parallel "
                        "plan: more memory, and the numbers equal a one-rank run bit for bit")
    p.add_argument("--ep-size", default=None, metavar="N",
                   help="refused: the EP size of an eval is torchrun's --nproc-per-node (the "
                        "wire-time column assumes EP 8, as moewire study's default --ep-size)")
    return p


def _eval_progress(bar):
    """``progress(stage, done, total)`` drawn as one rich bar per stage."""
    tasks: dict[str, int] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done, total=total)

    return progress


def _eval_log(write):
    """The eval's log lines through ``write``, less the runner's own line on Ctrl-C
    (``eval: interrupted; ...``): the command says that once, as it exits with 130."""

    def log(line: str) -> None:
        if not line.startswith("eval: interrupted;"):
            write(line)

    return log


def _run_eval(args: argparse.Namespace) -> int:
    from moewire.eval import EvalConfig, EvalError, evaluate, parse_pair, table
    from moewire.eval.checks import Ranks, read_text

    if args.ep_size is not None:
        raise EvalError("--ep-size", "moewire eval runs the model on the ranks torchrun "
                        "starts, and its EP size is their number: launch with torchrun "
                        f"--nproc-per-node {args.ep_size} -m moewire eval ... (the time model "
                        "of the wire-time column is moewire study's --ep-size)")
    first = Ranks.from_env().rank == 0
    if args.pairs is not None and not args.pairs:
        raise EvalError("--pairs", "the flag is given without a pair; pass one or more (e.g. "
                        "--pairs fp8:nvfp4 nvfp4:nvfp4), or leave --pairs out for the default "
                        "three")
    # Format names in any case, as moewire study's --dispatch and --combine.
    pairs = [parse_pair(text.lower()) for text in (args.pairs or ["fp8:fp8", "fp8:nvfp4",
                                                                   "nvfp4:nvfp4"])]
    per_layer = parse_pair(args.per_layer.lower(), "--per-layer") if args.per_layer else None
    tasks = [] if args.tasks is None else [t.strip() for t in args.tasks.split(",")
                                           if t.strip()]
    if args.tasks is not None and not tasks:
        raise EvalError("--tasks", f"{args.tasks!r} names no task; pass lm-eval task names, "
                        "e.g. --tasks gsm8k,arc_easy")
    text = read_text(args.text) if args.text is not None else None
    text_source = str(args.text.resolve()) if args.text is not None else None
    config = EvalConfig(pairs=pairs, recipes=args.recipe, text=text,
                        max_tokens=args.max_tokens, seq_len=args.seq_len, mma_type=args.mma,
                        kernel=args.kernel, device=args.device, budget=args.budget,
                        per_layer=per_layer, out_dir=args.out, tasks=tasks,
                        tasks_path=args.tasks_path, task_limit=args.task_limit,
                        tensor_parallel=not args.no_tensor_parallel, force=args.force,
                        text_source=text_source, cuda_graph=args.cuda_graph)
    if sys.stderr.isatty() and first:
        from rich.console import Console

        bar = _rich_bar(Console(stderr=True))
        with bar:
            report = evaluate(args.checkpoint, config, log=_eval_log(_bar_log(bar)),
                              progress=_eval_progress(bar))
    else:
        report = evaluate(args.checkpoint, config, log=_eval_log(
            lambda line: print(line, file=sys.stderr, flush=True)))
    if not first:  # rank 0 prints and writes; every rank computed the same numbers
        return 0
    print(table(report))
    if "budget" in report:
        verdict = report["budget"]["verdict"]
        print(f"budget KL {args.budget:g}: "
              + (verdict or "no pair within budget; keep the BF16 wire"))
    mixed = report.get("per_layer", {})
    if mixed.get("recipe"):
        print(f"mixed recipe: {mixed['pair'][0]}:{mixed['pair'][1]} on layers "
              f"{mixed['layers']}, {mixed['elsewhere'][0]}:{mixed['elsewhere'][1]} elsewhere, "
              f"measured KL {mixed['kl_mean']:.3e}, {mixed['bytes_per_token']:.0f} bytes per "
              "routed token")
    written = [args.out / "results.json", args.out / "kl.png"]
    if mixed.get("recipe"):
        written.append(Path(mixed["recipe"]))
    print("wrote " + ", ".join(map(str, written)))
    return 0


def _checkpoint_parser(sub) -> argparse.ArgumentParser:
    kinds = ("qwen3-moe", "deepseek-v3", "deepseek-v4-fp4", "deepseek-v4")
    p = sub.add_parser(
        "checkpoint",
        help="write a tiny random MoE checkpoint to try moewire eval on (docs/eval.md)",
        description=(
            "Write a tiny random transformers MoE checkpoint (BF16, a fixed seed) into DIR, "
            "which must be new or empty: qwen3-moe (docs/eval.md's example: 4 layers, 16 "
            "experts top-4, H = I = 256), deepseek-v3 (H = I = 512, for --mma fp4xfp4), "
            "deepseek-v4-fp4 (FP4 experts in DeepSeek-V4-Flash's layout, for transformers' "
            "deepgemm_megamoe) or deepseek-v4 (its BF16 twin). Its numbers mean nothing "
            "about a real model."),
    )
    p.add_argument("kind", choices=kinds)
    p.add_argument("dir", type=Path)
    p.add_argument("--tokenizer", action="store_true",
                   help="save a byte-level tokenizer beside it (token i is byte i), which "
                   "moewire eval --tasks needs")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    return p


def _run_checkpoint(args: argparse.Namespace) -> int:
    from moewire.checkpoints import make

    try:
        path = make(args.kind, args.dir, tokenizer=args.tokenizer, seed=args.seed)
    except ValueError as exc:
        print(f"{exc}".replace("moewire checkpoint: ", "moewire checkpoint: error: ", 1),
              file=sys.stderr)
        return 2
    print(f"wrote {path} ({args.kind}{', byte-level tokenizer' if args.tokenizer else ''})")
    return 0


def _run_formats(args: argparse.Namespace) -> int:
    from moewire import formats

    hidden = args.hidden
    header = ("format", "elem bits", "block", "scale bits", "row bits", f"bits/elem @H={hidden}",
              "needs amax", "row-local")
    rows = []
    for name in formats.names():
        f = formats.get(name)
        block = "-" if f.block_size is None else str(f.block_size)
        if f.block_size is not None and hidden % f.block_size:
            per_elem = "n/a"
        else:
            per_elem = f"{f.wire_bits(hidden) / hidden:.4g}"
        rows.append((name, f"{f.element_bits:g}", block, str(f.scale_bits),
                     str(f.row_scale_bits), per_elem, "yes" if f.needs_amax else "no",
                     "yes" if f.row_local else "no"))
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title="moewire wire formats")
        for h in header:
            table.add_column(h, justify="left" if h == "format" else "right")
        for row in rows:
            table.add_row(*row)
        Console().print(table)
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    return 0


def _build_rows() -> list[tuple[str, ...]]:
    """One row per (DeepGEMM build, Mega-MoE kernel) of ``moewire.megamoe.builds.BUILDS``: the
    kernel, whether moewire quantizes it there, and where its combine rows are and how they
    add up (the refused ones say why, in short)."""
    from moewire.megamoe.builds import BUILDS

    rows = []
    for build in BUILDS:
        for kernel, layout in build.kernels.items():
            if kernel in build.refused:
                continue
            order = {"first": "shared row first", "last": "shared row last",
                     None: "no fused shared"}[layout.shared_position]
            if layout.routed_scale:
                order += f", routed sum rounded and x {layout.routed_scale}"
            rows.append((build.name, kernel, "supported", layout.base_rule, order,
                         "unweighted (FMA)" if layout.weighted else "weighted"))
        for kernel, why in build.refused.items():
            rows.append((build.name, kernel, "refused", "-", why.split(";")[0][:70] + "...",
                         "-"))
    return rows


def _run_builds(args: argparse.Namespace) -> int:
    header = ("build", "kernel", "moewire", "combine base", "sum", "rows")
    rows = _build_rows()
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for line in (header, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``moewire`` argument parser (subcommands ``study``, ``eval``, ``checkpoint``,
    ``formats`` and ``builds``; ``--version``)."""
    parser = _Parser(
        prog="moewire",
        description="Simulate low-precision MoE dispatch/combine in fused Mega-MoE kernels.",
    )
    from moewire import __version__

    parser.add_argument("--version", action="version", version=f"moewire {__version__}")
    sub = parser.add_subparsers(dest="command",
                                metavar="{study,eval,checkpoint,formats,builds}")
    _study_parser(sub)
    _eval_parser(sub)
    _checkpoint_parser(sub)
    fp = sub.add_parser("formats", help="print the wire-format table")
    fp.add_argument("--hidden", type=_int_at_least(1), default=4096,
                    help="hidden size for the bits-per-element column (default 4096)")
    sub.add_parser("builds", help="print the DeepGEMM builds and Mega-MoE kernels moewire "
                                  "knows, supported or refused")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``moewire`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:  # argparse's bad usage (2) or --help (0)
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    out = _out_dir(args)
    existed = out is not None and out.exists()
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        if _rank0():
            print(f"moewire {args.command}: interrupted; {_left_behind(out, existed)}",
                  file=sys.stderr)
        return 130


def _out_dir(args: argparse.Namespace) -> Path | None:
    """The output directory a ``study`` or ``eval`` run writes (``None``: none known yet)."""
    if args.command == "eval":
        return Path(args.out)
    if args.command == "study" and args.from_json is None:
        from moewire.study.settings import StudyConfig

        return Path(args.out or StudyConfig.out)
    return None if getattr(args, "out", None) is None else Path(args.out)


def _left_behind(out: Path | None, existed: bool) -> str:
    """What an interrupted run leaves, in words. Its output directory is marked
    (``moewire.outputs.mark_interrupted``: the marker ``INTERRUPTED`` beside the complete
    files it wrote); one that the run created and left empty is removed, so that a later
    run starts clean."""
    if out is None or not out.is_dir():
        return "nothing was written"
    from moewire.outputs import mark_interrupted

    marker = mark_interrupted(out)
    if marker is not None:
        return f"{out} holds only complete files ({marker.name} lists them)"
    if not existed and not any(out.iterdir()):
        out.rmdir()
        return f"nothing was written (the empty {out} is removed)"
    return f"nothing was written into {out}"


def _dispatch(args: argparse.Namespace) -> int:
    """Run the subcommand of ``args``; a refusal is one line on stderr and exit code 2."""
    from moewire.study.errors import StudyArgumentError  # light: no torch

    try:
        if args.command == "formats":
            return _run_formats(args)
        if args.command == "builds":
            return _run_builds(args)
        if args.command == "checkpoint":
            return _run_checkpoint(args)
        if args.command == "eval":
            from moewire.eval import EvalError

            try:
                return _run_eval(args)
            except EvalError as exc:
                # Under torchrun every rank refuses alike; rank 0 says it once.
                if _rank0():
                    print(f"moewire eval: error: {exc}", file=sys.stderr)
                return 2
        return _run_study(args)
    except StudyArgumentError as exc:
        print(f"moewire {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
