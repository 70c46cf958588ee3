"""``moewire eval``: what a wire format pair does to a whole transformers MoE model.

For a local checkpoint (loaded offline, ``HF_HUB_OFFLINE=1``) with
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

1. Every check before the model loads (:func:`moewire.eval.checks.preflight`).
2. The experts modules are converted once; each run's quantizers are made and calibrated on
   the first window (``moewire.quantize(..., forward_loop)``) and kept. The baseline's are
   disabled: the converted module then runs the kernel's own output, bit for bit what the
   ``bf16:bf16`` pair gives (its re-sum of BF16 rows equals the kernel's sum, which the
   layout check asserts), at no extra cost.
3. Window by window, the baseline runs, then every other run on the same tokens with its
   quantizers swapped in; the metrics of the window are added on the model's device
   (:class:`moewire.eval.metrics.Totals`) and the window's logits are dropped. Memory does
   not grow with ``max_tokens`` (8 bytes per token and run for the exact KL percentile).
4. With ``per_layer`` and ``budget``, the mixed recipe is measured as one more run and
   backed off layer by layer until it is within the budget (:mod:`moewire.eval.recipe`).

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

import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moewire.eval.checks import Checked, EvalError, Ranks, check_out_dir, preflight
from moewire.eval.metrics import Reference, Totals, rows_per_chunk
from moewire.eval.recipe import (
    WireCost,
    fit_mixed,
    mixed_entries,
    mixed_recipe_yaml,
    pair_entries,
    recipe_formats,
    wire_cost,
)

__all__ = ["BASELINE", "PairResult", "evaluate"]

BASELINE = ("bf16", "bf16")
DEFAULT_PAIRS = (("fp8", "fp8"), ("fp8", "nvfp4"), ("nvfp4", "nvfp4"))
#: ``progress(stage, done, total)``: what the runner reports as it goes.
ProgressFn = Callable[[str, int, int], None]


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


@dataclass
class _Run:
    """One run: its recipe (``None``: the baseline), its cost, its calibrated quantizers
    (one ``(dispatch, combine)`` per experts module) and its time in the lockstep loop."""

    name: str
    recipe: Any
    cost: WireCost
    quantizers: list[tuple[nn.Module, nn.Module]] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class _Windows:
    """The token windows: ``inputs[i]`` ``[T_i]`` and ``targets[i]`` ``[T_i]`` on the
    model's device, and each window's first token in the evaluation."""

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    offsets: list[int]

    @property
    def tokens(self) -> int:
        return sum(int(w.numel()) for w in self.inputs)


class _Session:
    """The model with its experts modules converted once, swapping each run's quantizers in.

    Forward hooks on the experts modules compare each run's outputs with the baseline's of
    the same window (kept only for that window). :meth:`close` unquantizes the model.
    """

    def __init__(self, model: nn.Module, modules: list[tuple[str, nn.Module]],
                 first: torch.Tensor, device: torch.device) -> None:
        import moewire

        self.model, self.modules, self.device = model, modules, device
        self._first = first
        self._run: int | None = None
        self._totals: Totals | None = None
        self._reference: dict[int, torch.Tensor] = {}
        # Converts every experts module; each run then brings its own quantizers.
        moewire.quantize(model, {"quant_cfg": pair_entries(*BASELINE)})
        self._handles = [m.register_forward_hook(self._hook(i))
                         for i, (_, m) in enumerate(modules)]

    def _hook(self, layer: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if self._run is None or self._totals is None:
                return
            if self._run == 0:
                # The block may add to the experts' output in place afterwards: a copy.
                self._reference[layer] = output.detach().clone()
                self._totals.add_reference_layer(layer, output)
            else:
                self._totals.add_layer(self._run, layer, output, self._reference[layer])
        return hook

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(inputs[None], use_cache=False).logits[0]

    def calibrate(self, run: _Run) -> None:
        """Make ``run``'s quantizers, calibrated on the first window, and keep them."""
        import moewire
        from moewire.quantizer import WireQuantizer

        if run.recipe is None:
            run.quantizers = [
                tuple(WireQuantizer(enable=False, name=f"{name}.{kind}_quantizer")
                      .to(self.device) for kind in ("dispatch", "combine"))
                for name, _ in self.modules]
            return
        moewire.quantize(self.model, run.recipe, lambda m: self.forward(self._first),
                         keep_scales=False)
        run.quantizers = [(m.dispatch_quantizer, m.combine_quantizer) for _, m in self.modules]

    def install(self, run: _Run) -> None:
        for (_, module), (dispatch, combine) in zip(self.modules, run.quantizers, strict=True):
            module.dispatch_quantizer = dispatch
            module.combine_quantizer = combine

    def measure(self, runs: list[_Run], windows: _Windows,
                progress: ProgressFn, stage: str) -> Totals:
        """Every run over every window in lockstep, the baseline (``runs[0]``) first."""
        totals = Totals(len(runs), [n for n, _ in self.modules], windows.tokens, self.device)
        self._totals = totals
        progress(stage, 0, len(windows.inputs))
        try:
            for w, (inputs, targets, offset) in enumerate(
                    zip(windows.inputs, windows.targets, windows.offsets, strict=True)):
                ref = None
                for i, run in enumerate(runs):
                    started = time.perf_counter()
                    self.install(run)
                    self._run = i
                    logits = self.forward(inputs)
                    self._run = None
                    ref = ref if ref is not None else Reference.of(logits)
                    totals.add_logits(i, logits, ref, targets, offset)
                    del logits
                    _synchronize(self.device)
                    run.seconds += time.perf_counter() - started
                self._reference.clear()
                progress(stage, w + 1, len(windows.inputs))
        finally:
            self._run, self._totals = None, None
            self._reference.clear()
        _check_ranks_agree(totals, [r.name for r in runs])
        return totals

    def close(self) -> None:
        import moewire

        for handle in self._handles:
            handle.remove()
        moewire.unquantize(self.model)


def _check_ranks_agree(totals: Totals, names: list[str]) -> None:
    """Under several ranks, fail unless every rank holds the same sums (module docstring)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    differ = totals.differing_runs()
    if differ:
        raise RuntimeError(
            f"eval: the metrics of {[names[i] for i in differ]} differ between the "
            f"{dist.get_world_size()} ranks, which must run the same windows through the same "
            "model; launch every rank with the same arguments and files (torchrun "
            "--nproc-per-node N -m moewire eval ...)")


def _join(ranks: Ranks, device: torch.device) -> bool:
    """Join the process group torchrun set up (``env://``), gloo on the CPU and NCCL on
    CUDA, unless the caller has; returns whether this call created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != ranks.world:
            raise EvalError("torchrun", f"the process group has {dist.get_world_size()} ranks "
                            f"and WORLD_SIZE is {ranks.world}; launch with torchrun alone")
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return True


def _agree_on_refusal(error: EvalError | None) -> None:
    """Every rank learns the first rank's refusal (by rank) and raises it; the checks of
    one rank (its memory, rank 0's output directory) refuse the run on every rank."""
    import torch.distributed as dist

    mine = None if error is None else (error.argument, error.cause)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    first = next((e for e in every if e is not None), None)
    if first is not None:
        raise EvalError(*first)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tokenizer(checked: Checked) -> Any:
    if not checked.has_tokenizer:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(checked.path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise EvalError("checkpoint", f"its tokenizer cannot be loaded ({exc}); repair the "
                        "tokenizer files or remove them (the text is then read as bytes)"
                        ) from None


def _tokens(tokenizer: Any, text: str, vocab: int) -> torch.Tensor:
    """Token ids of ``text``: the checkpoint's tokenizer, or bytes modulo the vocabulary
    when it has none (random test checkpoints)."""
    if tokenizer is not None:
        return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    return torch.tensor(list(text.encode()), dtype=torch.long) % vocab


def _windows(ids: torch.Tensor, seq_len: int, device: torch.device) -> _Windows:
    """Windows of ``seq_len`` inputs, each with its next tokens; the tokens past the last
    full window (or a text shorter than one window) are one shorter window, so every token
    counts."""
    offsets = list(range(0, ids.numel() - 1, seq_len))
    chunks = [ids[i : i + seq_len + 1] for i in offsets]
    return _Windows([c[:-1].to(device) for c in chunks], [c[1:].to(device) for c in chunks],
                    offsets)


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _estimate_bytes(checked: Checked, seq_len: int, tokens: int, runs: int,
                    world: int = 1) -> int:
    """Weights (the checkpoint's files; a rank's share of ``world`` ranks, which shard the
    experts and the attention) and the experts' Mega-MoE copy (at most the weights again);
    one window's logits (the baseline's and a run's, FP32 at most), their float64 chunks,
    the baseline's experts outputs and the activations; the per-token KLs of every run (8
    bytes each). Nothing else grows with the tokens."""
    weights = sum(f.stat().st_size for f in checked.path.iterdir()
                  if f.suffix in (".safetensors", ".bin")) // world
    vocab, hidden = checked.number("vocab_size"), checked.number("hidden_size")
    layers = checked.number("num_hidden_layers")
    logits = 2 * seq_len * vocab * 4
    chunks = 4 * min(seq_len, rows_per_chunk(vocab)) * vocab * 8
    outputs = (layers + 16) * seq_len * hidden * 4
    return 2 * weights + logits + chunks + outputs + runs * tokens * 8


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
    pairs: Sequence[tuple[str, str]] = DEFAULT_PAIRS,
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
    time_ep_size: int = 8,
    tensor_parallel: bool = True,
    tasks: Sequence[str] = (),
    tasks_path: str | os.PathLike | None = None,
    task_limit: int | None = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Measure each pair (and recipe) against the same model on a BF16 wire.

    Args:
        checkpoint: a local checkpoint directory.
        pairs: ``(dispatch, combine)`` format names.
        recipes: recipe names or YAML paths, measured as well.
        text: the evaluation text (default: the embedded calibration text).
        max_tokens: tokens evaluated (in windows of ``seq_len``).
        seq_len: tokens per window.
        mma_type: the kernel's build (``moewire.integrations.transformers.KERNELS``;
            default its first: ``"bf16xbf16"`` for the stand-in).
        kernel: ``"stand-in"`` or ``"deepgemm-sm90"`` (DeepGEMM's real SM90
            ``fp8_mega_moe`` with FP8 128x128 block-scaled weights, on a Hopper GPU).
        device: ``"cpu"``, ``"cuda"`` (default: CUDA when available).
        budget: mean-KL budget: the verdict names the cheapest pair within it.
        per_layer: a pair quantized one layer at a time; with ``budget``, a mixed recipe
            (that pair on the layers the budget allows, the cheapest in-budget pair or BF16
            elsewhere), measured within the budget, is written to
            ``out_dir/mixed_recipe.yaml``.
        out_dir: where ``results.json``, the plot and the recipe go (rank 0 writes them).
        interconnect, time_ep_size: the time model's interconnect and EP size (the wire-time
            column), not the ranks that run the model: under ``torchrun`` those are its
            ``WORLD_SIZE``.
        tensor_parallel: under several ranks, shard the dense layers (attention, embeddings,
            shared experts) by the model's tensor-parallel plan (the default, least memory);
            ``False`` keeps them whole on every rank, and the numbers then equal a one-rank
            run bit for bit (module docstring).
        tasks: lm-evaluation-harness task names, run on every run but the per-layer ones.
        tasks_path: a directory of task YAML files (lm-eval's ``--include_path``).
        task_limit: at most this many documents per task (lm-eval's ``--limit``).
        log: where the progress lines go (rank 0's only).
        progress: ``progress(stage, done, total)``, called with ``done == 0`` as a stage
            (``"calibration"``, ``"window"``, ``"mixed recipe window"``, ``"tasks"``) starts
            and after each step (default: a few log lines per stage with the time to go).

    Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank calls it with the same arguments: the
    model is sharded by expert parallelism over the ranks (module docstring), every rank
    returns the same metrics, and rank 0 alone logs and writes the files.

    Returns:
        The results dict (as ``results.json``).

    Raises:
        EvalError: any argument or file that is wrong, before the model loads (the message
            names it and the fix), or a run that does not fit in memory; under several
            ranks, a refusal of any rank, on every rank.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ranks = Ranks.from_env()
    if ranks.rank != 0:
        log, progress = (lambda s: None), (lambda stage, done, total: None)
    plan = _plan(checkpoint, pairs, recipes=recipes, text=text, max_tokens=max_tokens,
                 seq_len=seq_len, mma_type=mma_type, kernel=kernel, device=device,
                 budget=budget, per_layer=per_layer, out_dir=out_dir,
                 interconnect=interconnect, time_ep_size=time_ep_size,
                 tensor_parallel=tensor_parallel, tasks=tasks, tasks_path=tasks_path,
                 task_limit=task_limit, log=log, ranks=ranks)
    try:
        return _run_plan(plan, log, progress or _line_progress(log))
    finally:
        if plan.joined:
            import torch.distributed as dist

            dist.destroy_process_group()


@dataclass
class _Plan:
    """Everything :func:`evaluate` checked and read before the model loads."""

    checked: Checked
    tokenizer: Any
    windows: _Windows
    out: Path | None
    seq_len: int
    mma_type: str | None
    kernel: str
    budget: float | None
    per_layer: tuple[str, str] | None
    interconnect: str
    time_ep_size: int
    tasks: tuple[str, ...]
    task_manager: Any
    task_limit: int | None
    tensor_parallel: bool
    ranks: Ranks
    joined: bool


def _plan(checkpoint, pairs, *, recipes, text, max_tokens, seq_len, mma_type, kernel, device,
          budget, per_layer, out_dir, interconnect, time_ep_size, tensor_parallel, tasks,
          tasks_path, task_limit, log, ranks) -> _Plan:
    """Every check of :func:`evaluate`, then the tokens and the windows; the output
    directory is created last, once nothing else can refuse.

    Under several ranks the checks up to the windows are the same on every rank (the same
    arguments and files); then the ranks join the process group, and the checks of one rank
    (the memory of its device, rank 0's output directory) refuse on every rank."""
    from moewire.study.comm import INTERCONNECTS

    checked = preflight(checkpoint, pairs, recipes=recipes, per_layer=per_layer,
                        max_tokens=max_tokens, seq_len=seq_len, kernel=kernel,
                        mma_type=mma_type, device=device, budget=budget, ranks=ranks)
    if not tensor_parallel and ranks.world == 1:
        raise EvalError("--no-tensor-parallel", "one rank has no tensor parallelism to turn "
                        "off; drop the flag, or launch several ranks with torchrun "
                        "--nproc-per-node N -m moewire eval ...")
    if tasks and ranks.world > 1:
        raise EvalError("--tasks", f"lm-eval's tasks run on one rank, not under torchrun's "
                        f"{ranks.world} ranks; measure the tasks in a one-rank run (python -m "
                        "moewire eval ... --tasks ...), or drop --tasks here")
    if interconnect not in INTERCONNECTS:
        raise EvalError("interconnect", f"{interconnect!r} is not one of "
                        f"{', '.join(INTERCONNECTS)}")
    tasks = tuple(tasks)
    manager = None
    if tasks:
        from moewire.eval.tasks import check_tasks

        manager = check_tasks(tasks, None if tasks_path is None else str(tasks_path),
                              checked.has_tokenizer, checked.path)
    if text is None:
        import moewire

        text = (Path(moewire.__file__).parent / "data" / "calibration.txt").read_text()
    tokenizer = _tokenizer(checked)
    ids = _tokens(tokenizer, text, checked.number("vocab_size"))[: max_tokens + 1]
    if ids.numel() < 2:
        raise EvalError("--text", f"the text gives {ids.numel()} token(s), and a window needs "
                        "at least 2 (its inputs and the next token); pass a longer text")
    dev = checked.device
    windows = _windows(ids, seq_len, dev)
    runs = 1 + len(checked.pairs) + len(checked.recipes)
    extra = checked.number("num_hidden_layers") + 1 if per_layer else 0
    need = _estimate_bytes(checked, seq_len, windows.tokens, runs + extra, ranks.world)
    # The ranks of a node share its host memory.
    have = _available_bytes(dev) // (ranks.local_world if dev.type == "cpu" else 1)
    joined = ranks.world > 1 and _join(ranks, dev)
    out, refused = None, None
    try:
        if need > have:
            raise EvalError("memory", f"about {need / 2**30:.2f} GiB needed, "
                            f"{have / 2**30:.2f} GiB free on {dev}"
                            f"{' per rank' if ranks.world > 1 else ''}; lower --seq-len or use "
                            f"{'more ranks' if ranks.world > 1 else 'a larger device'}")
        if out_dir is not None and ranks.rank == 0:
            out = check_out_dir(out_dir)
    except EvalError as exc:
        refused = exc
    if ranks.world > 1:
        try:
            _agree_on_refusal(refused)
        except EvalError:
            if joined:
                import torch.distributed as dist

                dist.destroy_process_group()
            raise
    elif refused is not None:
        raise refused
    on = f"{dev}" if ranks.world == 1 else f"{dev} per rank, {ranks.world} ranks"
    log(f"eval: {checked.path.name}: {windows.tokens} tokens in {len(windows.inputs)} windows, "
        f"{runs} runs (+{'one per layer and the mixed recipe' if per_layer else 'none'}), "
        f"memory needed about {need / 2**30:.2f} GiB of {have / 2**30:.2f} GiB free on {on}")
    if windows.tokens < max_tokens:
        log(f"eval: the text gives {windows.tokens} tokens, fewer than --max-tokens "
            f"{max_tokens}")
    return _Plan(checked, tokenizer, windows, out, seq_len, mma_type, kernel, budget,
                 per_layer, interconnect, time_ep_size, tasks, manager, task_limit,
                 tensor_parallel, ranks, joined)


def _runs(plan: _Plan, names: list[str], cost: Callable) -> tuple[list[_Run], list[_Run]]:
    """The main runs (the baseline, the pairs, the recipes) and the per-layer probes."""
    main = [_Run("bf16:bf16", None, cost([BASELINE] * len(names)))]
    main += [_Run(f"{d}:{c}", {"quant_cfg": pair_entries(d, c)}, cost([(d, c)] * len(names)))
             for d, c in plan.checked.pairs]
    main += [_Run(r, r, cost(recipe_formats(r, names))) for r in plan.checked.recipes]
    low = plan.per_layer
    probes = [] if low is None else [
        _Run(f"{low[0]}:{low[1]}@layer{_layer_index(n)}",
             {"quant_cfg": pair_entries(*low, [_layer_index(n)])},
             cost([low if m == n else BASELINE for m in names]))
        for n in names]
    return main, probes


def _run_plan(plan: _Plan, log: Callable[[str], None], progress: ProgressFn) -> dict[str, Any]:
    """Load the model, calibrate every run, measure them in lockstep, then the mixed recipe
    and the tasks; write the files."""
    import moewire.integrations.transformers as mt
    from moewire.study.comm import INTERCONNECTS, comm_time, uniform_traffic

    dev, windows = plan.checked.device, plan.windows
    started = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    model = _load(plan.checked, plan.seq_len, plan.mma_type, plan.kernel, plan.ranks.world,
                  plan.tensor_parallel)
    modules = mt.experts_modules(model)
    names = [n for n, _ in modules]
    hidden = int(model.config.hidden_size)
    link = INTERCONNECTS[plan.interconnect]
    traffic = uniform_traffic(plan.time_ep_size, 4096, int(model.config.num_experts_per_tok))

    def cost(per_module: list[tuple[str, str]]) -> WireCost:
        return wire_cost(per_module, hidden,
                         lambda d, c: comm_time(link, traffic, d, c, hidden).comm_us)

    main, probes = _runs(plan, names, cost)
    every = main + probes
    report: dict[str, Any] = {
        "checkpoint": str(plan.checked.path), "model_type": plan.checked.config.get("model_type"),
        "tokens": windows.tokens, "windows": len(windows.inputs), "seq_len": plan.seq_len,
        "kernel": plan.kernel, "mma_type": plan.mma_type or next(iter(mt.KERNELS[plan.kernel])),
        "device": str(dev), "ranks": plan.ranks.world,
        "tensor_parallel": plan.tensor_parallel and plan.ranks.world > 1,
        "interconnect": plan.interconnect,
        "time_ep_size": plan.time_ep_size,
    }
    mixed_yaml = None
    loaded = time.perf_counter()
    session = _Session(model, modules, windows.inputs[0], dev)
    try:
        progress("calibration", 0, len(every))
        for i, run in enumerate(every):
            session.calibrate(run)
            progress("calibration", i + 1, len(every))
        calibrated = time.perf_counter()
        totals = session.measure(every, windows, progress, "window")
        measured = time.perf_counter()
        results = [_result(run, totals.result(i), windows.tokens) for i, run in enumerate(main)]
        for r in results:
            log(f"eval: {r.name}: ppl {r.perplexity:.4f}, KL mean {r.kl_mean:.3e}, p99 "
                f"{r.kl_p99:.3e}, top-1 {r.top1_agreement:.4f} ({r.tokens_per_second:.0f} "
                "tokens/s)")
        if plan.budget is not None:
            report["budget"] = _verdict(results, plan.budget, log)
        if plan.per_layer is not None:
            by_layer = {_layer_index(n): totals.result(len(main) + i)
                        for i, n in enumerate(names)}
            report["per_layer"] = {"pair": list(plan.per_layer),
                                   "kl_by_layer": {n: r["kl_mean"] for n, r in by_layer.items()}}
            log(f"eval: {plan.per_layer[0]}:{plan.per_layer[1]} on one layer at a time, KL mean "
                "by layer: " + ", ".join(f"{n}: {r['kl_mean']:.3e}" for n, r in by_layer.items()))
            if plan.budget is not None:
                mixed = _mixed(session, main[0], plan.per_layer, by_layer, results, plan.budget,
                               names, cost, windows, progress, log, report["per_layer"])
                if mixed is not None:
                    main.append(mixed[0])
                    results.append(mixed[1])
                    mixed_yaml = mixed[2]
        if plan.tasks:
            _tasks(session, plan, main, results, progress)
    finally:
        session.close()
    done = time.perf_counter()
    report.update({
        "seconds": {"load": loaded - started, "calibrate": calibrated - loaded,
                    "measure": measured - calibrated, "total": done - started},
        "tokens_per_second": windows.tokens * len(every) / (measured - calibrated),
        "peak_memory_bytes": (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda"
                              else None),
        "pairs": [asdict(r) for r in results],
    })
    if plan.tasks:
        report["tasks"] = list(plan.tasks)
    if plan.out is not None:
        _write(report, plan.out, mixed_yaml, log)
    return report


def _verdict(results: list[PairResult], budget: float,
             log: Callable[[str], None]) -> dict[str, Any]:
    """The cheapest run (fewest bytes per routed token) whose mean KL is within ``budget``."""
    within = [r for r in results[1:] if r.kl_mean <= budget]
    best = min(within, key=lambda r: (r.bytes_per_token, r.kl_mean), default=None)
    log(f"eval: budget KL {budget:g}: " + (
        f"{best.name} ({best.bytes_per_token:.0f} bytes per routed token)" if best
        else "no pair is within budget; keep the BF16 wire"))
    return {"kl": budget, "verdict": best.name if best else None}


def _tasks(session: _Session, plan: _Plan, runs: list[_Run], results: list[PairResult],
           progress: ProgressFn) -> None:
    """lm-eval's tasks on each run, its quantizers installed."""
    from moewire.eval.tasks import run_tasks

    progress("tasks", 0, len(runs))
    for i, (run, result) in enumerate(zip(runs, results, strict=True)):
        session.install(run)
        result.tasks = run_tasks(session.model, plan.tokenizer, plan.task_manager, plan.tasks,
                                 device=plan.checked.device, limit=plan.task_limit)
        progress("tasks", i + 1, len(runs))


def _write(report: dict[str, Any], out: Path, mixed_yaml: str | None,
           log: Callable[[str], None]) -> None:
    from moewire.eval.report import plot

    if mixed_yaml is not None:
        recipe_path = out / "mixed_recipe.yaml"
        recipe_path.write_text(mixed_yaml)
        report["per_layer"]["recipe"] = str(recipe_path)
        log(f"eval: mixed recipe -> {recipe_path}")
    (out / "results.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "kl.png")


def _layer_index(module_name: str) -> int:
    import re

    return int(re.search(r"layers\.(\d+)\.", module_name).group(1))


def _result(run: _Run, metrics: dict[str, Any], tokens: int) -> PairResult:
    return PairResult(run.name, run.cost.dispatch, run.cost.combine, metrics["perplexity"],
                      metrics["kl_mean"], metrics["kl_p99"], metrics["top1_agreement"],
                      run.cost.bytes_per_token, run.cost.wire_us, metrics["layer_rel_l2"],
                      tokens / run.seconds if run.seconds else 0.0)


def _mixed(session: _Session, baseline: _Run, low: tuple[str, str],
           by_layer: dict[int, dict[str, Any]], results: list[PairResult], budget: float,
           names: list[str], cost: Callable, windows: _Windows, progress: ProgressFn,
           log: Callable[[str], None],
           out: dict[str, Any]) -> tuple[_Run, PairResult, str] | None:
    """Choose, measure and back off the mixed recipe (:func:`moewire.eval.recipe.fit_mixed`);
    fills ``out`` and returns the accepted run, its result and its YAML, or ``None``.

    Elsewhere goes the cheapest pair within the budget (a recipe with several formats
    cannot be the rest of a mixed recipe), or BF16; its KL counts against the budget."""
    uniform = [r for r in results[1:] if r.kl_mean <= budget and "mixed" not in
               (r.dispatch, r.combine)]
    safer = min(uniform, key=lambda r: (r.bytes_per_token, r.kl_mean), default=None)
    high = (safer.dispatch, safer.combine) if safer else BASELINE
    spent = safer.kl_mean if safer else 0.0
    sensitivity = {n: r["kl_mean"] for n, r in by_layer.items()}
    measured: dict[tuple[int, ...], tuple[_Run, PairResult]] = {}
    index = {_layer_index(n): n for n in names}

    def measure(layers: list[int]) -> float:
        entries = mixed_entries(low, layers, high)
        chosen = {index[n] for n in layers}
        run = _Run(f"mixed ({low[0]}:{low[1]} on {len(layers)}/{len(names)})",
                   {"quant_cfg": entries},
                   cost([low if n in chosen else high for n in names]))
        base = _Run(baseline.name, None, baseline.cost, baseline.quantizers)
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
