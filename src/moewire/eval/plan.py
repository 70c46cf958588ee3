"""Everything ``moewire eval`` checks and reads before the model loads: the checks
(:func:`moewire.eval.checks.preflight` and those that need the text or the device), the
tokens and their windows, the memory estimate, and under several ranks the process group
and a refusal shared by every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moewire.eval.checks import Checked, EvalError, Ranks, check_out_dir, preflight
from moewire.eval.metrics import rows_per_chunk
from moewire.eval.settings import EvalConfig

__all__ = ["Plan", "Windows", "make_plan"]


@dataclass(frozen=True)
class Windows:
    """The token windows: ``inputs[i]`` ``[T_i]`` and ``targets[i]`` ``[T_i]`` on the
    model's device, and each window's first token in the evaluation."""

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    offsets: list[int]

    @property
    def tokens(self) -> int:
        return sum(int(w.numel()) for w in self.inputs)



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


def _windows(ids: torch.Tensor, seq_len: int, device: torch.device) -> Windows:
    """Windows of ``seq_len`` inputs, each with its next tokens; the tokens past the last
    full window (or a text shorter than one window) are one shorter window, so every token
    counts."""
    offsets = list(range(0, ids.numel() - 1, seq_len))
    chunks = [ids[i : i + seq_len + 1] for i in offsets]
    return Windows([c[:-1].to(device) for c in chunks], [c[1:].to(device) for c in chunks],
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


@dataclass
class Plan:
    """Everything :func:`make_plan` checked and read before the model loads."""

    config: EvalConfig
    checked: Checked
    tokenizer: Any
    windows: Windows
    out: Path | None
    tasks: tuple[str, ...]
    task_manager: Any
    ranks: Ranks
    joined: bool


def make_plan(checkpoint: str | os.PathLike, config: EvalConfig, log: Callable[[str], None],
              ranks: Ranks) -> Plan:
    """Every check of :func:`moewire.eval.evaluate`, then the tokens and the windows; the output
    directory is created last, once nothing else can refuse.

    Under several ranks the checks up to the windows are the same on every rank (the same
    arguments and files); then the ranks join the process group, and the checks of one rank
    (the memory of its device, rank 0's output directory) refuse on every rank."""
    from moewire.study.comm import INTERCONNECTS

    checked = preflight(checkpoint, config.pairs, recipes=config.recipes,
                        per_layer=config.per_layer, max_tokens=config.max_tokens,
                        seq_len=config.seq_len, kernel=config.kernel, mma_type=config.mma_type,
                        device=config.device, budget=config.budget, ranks=ranks)
    if not config.tensor_parallel and ranks.world == 1:
        raise EvalError("--no-tensor-parallel", "one rank has no tensor parallelism to turn "
                        "off; drop the flag, or launch several ranks with torchrun "
                        "--nproc-per-node N -m moewire eval ...")
    if config.interconnect not in INTERCONNECTS:
        raise EvalError("interconnect", f"{config.interconnect!r} is not one of "
                        f"{', '.join(INTERCONNECTS)}")
    tasks = tuple(config.tasks)
    manager = None
    if tasks:
        from moewire.eval.tasks import check_tasks

        manager = check_tasks(tasks, None if config.tasks_path is None else str(config.tasks_path),
                              checked.has_tokenizer, checked.path)
    text = config.text
    if text is None:
        import moewire

        text = (Path(moewire.__file__).parent / "data" / "calibration.txt").read_text()
    tokenizer = _tokenizer(checked)
    ids = _tokens(tokenizer, text, checked.number("vocab_size"))[: config.max_tokens + 1]
    if ids.numel() < 2:
        raise EvalError("--text", f"the text gives {ids.numel()} token(s), and a window needs "
                        "at least 2 (its inputs and the next token); pass a longer text")
    dev = checked.device
    windows = _windows(ids, config.seq_len, dev)
    runs = 1 + len(checked.pairs) + len(checked.recipes)
    extra = checked.number("num_hidden_layers") + 1 if config.per_layer else 0
    need = _estimate_bytes(checked, config.seq_len, windows.tokens, runs + extra, ranks.world)
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
        if config.out_dir is not None and ranks.rank == 0:
            out = check_out_dir(config.out_dir)
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
    extra = " plus one per layer and the mixed recipe" if config.per_layer else ""
    log(f"eval: {checked.path.name}: {windows.tokens} tokens in "
        f"{_count(len(windows.inputs), 'window')}, {_count(runs, 'run')}{extra}, "
        f"memory needed about {need / 2**30:.2f} GiB of {have / 2**30:.2f} GiB free on {on}")
    if windows.tokens < config.max_tokens:
        log(f"eval: the text gives {windows.tokens} tokens, fewer than --max-tokens "
            f"{config.max_tokens}")
    return Plan(config, checked, tokenizer, windows, out, tasks, manager, ranks, joined)


def _count(n: int, noun: str) -> str:
    """``1 window``, ``2 windows``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
