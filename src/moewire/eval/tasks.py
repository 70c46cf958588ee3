"""Task accuracy through lm-evaluation-harness (``lm-eval`` 0.4.13, moewire's ``eval`` extra:
``pip install -e '.[eval]'`` in the clone).

Each run's quantizers are installed on the one model, which is handed to lm-eval's own
transformers class (``lm_eval.models.huggingface.HFLM(pretrained=model, tokenizer=...)``,
read in lm-eval 0.4.13 ``lm_eval/models/huggingface.py``: an initialised model is used as
it is), and ``lm_eval.simple_evaluate`` runs the tasks on it. Every metric is reported with
the standard error lm-eval computes for it (``"<metric>_stderr,<filter>"`` of its results).

One setting differs from lm-eval's default: its log-softmax runs in FP32
(``softmax_dtype=torch.float32``), not in the model's BF16, where a log-likelihood near -11
is rounded to 1/16 and two choices closer than that tie (lm-eval's ``--model_args
softmax_dtype=float32`` gives the same).

Task names and their datasets are checked before the model loads (:func:`check_tasks`):
lm-eval indexes its task files (``lm_eval.tasks.TaskManager``); with ``include_path``
(lm-eval's ``--include_path``, a directory of task YAML files) that directory is indexed
alone first, and lm-eval's own tasks only when a name is not found there. Then each task is
built once, which loads its dataset (lm-eval 0.4.13 ``lm_eval/api/task.py``,
``ConfigurableTask.download``: ``datasets.load_dataset(dataset_path, dataset_name,
**dataset_kwargs)``): a local file (``dataset_path: json`` with ``data_files``), the datasets
cache, or the Hub when downloads are allowed. moewire never turns them off itself: set
``HF_HUB_OFFLINE=1`` (or ``HF_DATASETS_OFFLINE=1``) to read the cache alone. A dataset that
cannot be loaded is refused by name, with the command that fetches it.

lm-eval seeds Python's, numpy's and torch's global generators with its default seeds, so
every run sees the same documents and few-shot examples; the generators' states are put
back afterwards (:func:`_generators_kept`).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moewire.eval.checks import EvalError, _require
from moewire.extras import install_command

__all__ = ["check_tasks", "run_tasks", "scores"]

#: lm-eval's results keys that are not metrics.
_NOT_METRICS = {"name", "alias", "sample_len", "samples", " ", "sample_count"}


def check_tasks(names: Sequence[str], include_path: str | None, has_tokenizer: bool,
                checkpoint: Path) -> Any:
    """lm-eval is installed, the checkpoint has a tokenizer, every task is known and its
    datasets load (from a local file, the datasets cache or, downloads allowed, the Hub).

    Returns:
        The ``lm_eval.tasks.TaskManager`` that knows them.

    Raises:
        EvalError: naming ``--tasks`` or ``--tasks-path`` and the fix.
    """
    if not has_tokenizer:
        raise EvalError("--tasks", f"lm-eval's tasks are text, and {checkpoint} has no "
                        "tokenizer (tokenizer.json); save the model's tokenizer into it")
    if importlib.util.find_spec("lm_eval") is None:
        raise EvalError("--tasks", "needs lm-evaluation-harness, which this Python lacks; run: "
                        f"{install_command('eval')}")
    _require("accelerate", "--tasks", "lm-eval's transformers model "
             "(lm_eval.models.huggingface imports it)", "eval")
    if include_path is not None and not Path(include_path).is_dir():
        raise EvalError("--tasks-path", f"{include_path} is not a directory; pass the "
                        "directory of your task YAML files")
    from lm_eval.tasks import TaskManager

    with _quiet():
        manager = None
        if include_path is not None:
            manager = TaskManager(include_path=str(include_path), include_defaults=False)
        if manager is None or any(n not in manager.all_tasks for n in names):
            manager = TaskManager(include_path=None if include_path is None
                                  else str(include_path))
    for name in names:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise EvalError("--tasks", f"lm-eval has no task {name!r}; {hint}`lm-eval ls tasks` "
                            "lists them, or pass your own task's directory with --tasks-path")
    for name in names:
        _load_datasets(name, manager)
    return manager


def _load_datasets(task: str, manager: Any) -> None:
    """Build ``task`` (a task or a group) once, which loads its datasets into the datasets
    cache; a failure is refused naming the dataset that failed and how to fetch it."""
    from unittest import mock

    import datasets

    asked: list[tuple[Any, Any]] = []
    real = datasets.load_dataset

    def recorded(*args: Any, **kwargs: Any) -> Any:
        asked.append((kwargs.get("path", args[0] if args else None), kwargs.get("name")))
        return real(*args, **kwargs)

    try:
        with _quiet(), mock.patch.object(datasets, "load_dataset", recorded):
            manager.load_task_or_group([task])
    except Exception as exc:
        raise EvalError("--tasks", _dataset_refusal(task, asked[-1] if asked else None, exc)
                        ) from None


def _offline() -> bool:
    """Whether the datasets library reads its cache alone (``HF_HUB_OFFLINE`` or
    ``HF_DATASETS_OFFLINE``, read by ``datasets.config`` when it is imported)."""
    import datasets.config

    return bool(datasets.config.HF_HUB_OFFLINE)


def _dataset_refusal(task: str, dataset: tuple[Any, Any] | None, exc: Exception) -> str:
    """The one-line refusal of a task whose dataset (``(path, name)``) failed to load."""
    cause = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    if dataset is None:
        return (f"task {task!r} cannot be built ({cause}); repair its YAML, or pass another "
                "task")
    path, name = dataset
    shown = repr(path) + (f" (config {name!r})" if name else "")
    fetch = ("python -c \"import datasets; datasets.load_dataset("
             + ", ".join(repr(a) for a in (path, name) if a) + ')\"')
    if _offline():
        return (f"task {task!r} reads the dataset {shown}, which is not in the datasets cache, "
                "and downloads are off (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set); fetch "
                f"it once on a machine with network: {fetch}, or unset HF_HUB_OFFLINE and "
                "HF_DATASETS_OFFLINE to let moewire eval download it, or pass a local task "
                "with --tasks-path")
    return (f"task {task!r} cannot load the dataset {shown} ({cause}); check the network and "
            f"the dataset's name, fetch it with {fetch}, or pass a local task with --tasks-path")


class _quiet:
    """lm-eval logs a line per task setting it fills in; keep its loggers to warnings of
    substance (ERROR) while it runs, and put their levels back."""

    def __enter__(self) -> None:
        self._levels = {name: logging.getLogger(name).level for name in ("lm_eval", "lm-eval")}
        for name in self._levels:
            logging.getLogger(name).setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _generators_kept(device: torch.device) -> Iterator[None]:
    """Python's, numpy's and torch's (CPU and ``device``) generator states, put back on exit."""
    import numpy as np

    state, np_state = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(state)
        np.random.set_state(np_state)


def scores(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """lm-eval's ``results`` as ``{task: {metric: {"value": v, "stderr": s}}}``.

    A metric key ``"acc,none"`` becomes ``"acc"``; another filter stays in the name
    (``"exact_match,strict-match"``); a stderr lm-eval could not compute (``"N/A"``) is
    ``None``.
    """
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for task, entries in results.items():
        metrics = {}
        for key, value in entries.items():
            if key in _NOT_METRICS or "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            stderr = entries.get(f"{metric}_stderr,{filt}")
            try:
                stderr = float(stderr)
            except (TypeError, ValueError):
                stderr = None
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            metrics[metric if filt == "none" else key] = {"value": number, "stderr": stderr}
        out[task] = metrics
    return out


def run_tasks(model: nn.Module, tokenizer: Any, manager: Any, names: Sequence[str], *,
              device: torch.device, limit: int | None = None,
              batch_size: int = 8) -> dict[str, dict[str, dict[str, float | None]]]:
    """Run lm-eval's ``names`` on ``model`` as it is now (its quantizers installed).

    Args:
        model: the transformers model.
        tokenizer: its tokenizer.
        manager: the ``TaskManager`` of :func:`check_tasks`.
        names: the task names.
        device: the model's device.
        limit: at most this many documents per task (lm-eval's ``--limit``).
        batch_size: lm-eval's batch size.

    Returns:
        :func:`scores` of lm-eval's results.
    """
    from unittest import mock

    from lm_eval import evaluator, simple_evaluate
    from lm_eval.models.huggingface import HFLM

    # lm-eval records the git commit of the working directory by running git, which prints
    # "fatal: not a git repository" outside one; moewire's results do not use it.
    with _quiet(), _generators_kept(device), \
            mock.patch.object(evaluator, "get_git_commit_hash", lambda: None):
        # FP32 log-softmax: in the model's BF16 a log-probability near -11 is rounded to
        # 1/16, coarser than what a wire format changes.
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                  device=str(device), softmax_dtype=torch.float32)
        out = simple_evaluate(model=lm, tasks=list(names), task_manager=manager, limit=limit,
                              log_samples=False)
    # Under torchrun every rank runs lm-eval's requests in step (the model's expert-parallel
    # collectives need each rank), but lm-eval 0.4.13's simple_evaluate returns the results
    # on its rank 0 only (lm_eval/evaluator.py: ``if lm.rank == 0``, else None): rank 0's
    # scores reach every rank, so the ranks' results agree.
    mine = None if out is None else scores(out["results"])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        held = [mine]
        dist.broadcast_object_list(held, src=0)
        mine = held[0]
    if mine is None:
        raise RuntimeError("run_tasks: lm-eval returned no results on this rank and no rank "
                           "0 scores arrived; run the tasks under torchrun's rank 0")
    return mine
