"""What ``moewire eval`` runs: :class:`EvalConfig` (one field per CLI flag), as the study's
``moewire.study.settings.StudyConfig``.

:func:`moewire.eval.evaluate` takes a config, or the same fields as keyword arguments, from
which it builds one (:func:`config_from`); never both. Torch-free, so the CLI builds a
config before torch loads. The values are checked before the model loads
(:func:`moewire.eval.checks.preflight`), not here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BASELINE", "DEFAULT_PAIRS", "EvalConfig", "ProgressFn", "config_from"]

BASELINE = ("bf16", "bf16")
DEFAULT_PAIRS = (("fp8", "fp8"), ("fp8", "nvfp4"), ("nvfp4", "nvfp4"))
#: ``progress(stage, done, total)``: what the runner reports as it goes.
ProgressFn = Callable[[str, int, int], None]


@dataclass(frozen=True)
class EvalConfig:
    """What :func:`moewire.eval.evaluate` measures on a checkpoint.

    Attributes:
        pairs: ``(dispatch, combine)`` format names.
        recipes: recipe names or YAML paths, measured as well.
        text: the evaluation text (default: the embedded calibration text).
        text_source: where ``text`` came from, recorded in ``results.json`` with its SHA-256
            (the CLI passes the ``--text`` path; default ``"the text argument"``).
        max_tokens: tokens evaluated (in windows of ``seq_len``).
        seq_len: tokens per window.
        mma_type: the kernel's build (``moewire.integrations.transformers.KERNELS``;
            default its first: ``"bf16xbf16"`` for the stand-in).
        kernel: ``"stand-in"`` or ``"deepgemm-sm90"`` (DeepGEMM's real SM90
            ``fp8_mega_moe`` with FP8 128x128 block-scaled weights, on a Hopper GPU).
        device: ``"cpu"``, ``"cuda"`` (default: CUDA when available).
        budget: mean-KL budget: the verdict names the cheapest pair within it
            (``moewire.study.verdict.cheapest_within``, the study's rule, with bytes
            compared exactly).
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
            run bit for bit (``moewire.eval.runner``'s docstring).
        tasks: lm-evaluation-harness task names, run on every run but the per-layer ones.
        tasks_path: a directory of task YAML files (lm-eval's ``--include_path``).
        task_limit: at most this many documents per task (lm-eval's ``--limit``).
        force: an ``out_dir`` holding an earlier run's files is refused unless this is set;
            then those files are removed first (and the log says which), so no earlier file
            stays beside this run's (:func:`moewire.outputs.prepare_output_dir`).
        cuda_graph: on a CUDA device (one rank), capture each run's forward over a window
            once and replay it for every window (:mod:`moewire.eval.graphs`): the eager
            forward's kernels on the same data, for the same numbers bit for bit
            (:mod:`moewire.eval.masking` gives the attention the same inputs under capture;
            the GPU tier, ``tests/eval/test_eval_graphs.py``, compares the two). Each run's
            first replay is checked against its eager forward; a difference drops the
            graphs and runs every window eagerly, and the report says why
            (``cuda_graph.fallback``). On by default; ``False`` (``--no-cuda-graph``) runs
            every window eagerly. Ignored on CPU and under several ranks.
    """

    pairs: Sequence[tuple[str, str]] = DEFAULT_PAIRS
    recipes: Sequence[str] = ()
    text: str | None = None
    max_tokens: int = 1024
    seq_len: int = 128
    mma_type: str | None = None
    kernel: str = "stand-in"
    device: str | None = None
    budget: float | None = None
    per_layer: tuple[str, str] | None = None
    out_dir: str | os.PathLike | None = None
    interconnect: str = "nvlink-h200"
    time_ep_size: int = 8
    tensor_parallel: bool = True
    tasks: Sequence[str] = ()
    tasks_path: str | os.PathLike | None = None
    task_limit: int | None = None
    force: bool = False
    cuda_graph: bool = True
    text_source: str | None = None


_FIELDS = tuple(f.name for f in dataclasses.fields(EvalConfig))


def config_from(config: EvalConfig | Sequence[tuple[str, str]] | None,
                fields: dict[str, Any]) -> EvalConfig:
    """The config of an :func:`~moewire.eval.evaluate` call.

    A config is complete: it is used as given, and keyword fields beside it are refused
    rather than merged (no precedence to remember). Without one, the keyword fields build
    it, every other field at its default; the second positional argument may still be the
    pairs, as ``evaluate(path, [("fp8", "nvfp4")], budget=1e-3)`` has always read.

    Raises:
        TypeError: a config and keyword fields together, the pairs given twice, or a name
            that is no field of :class:`EvalConfig`; the message says which and the fix.
    """
    unknown = [name for name in fields if name not in _FIELDS]
    if unknown:
        raise TypeError(f"evaluate: unknown keyword argument(s) {', '.join(unknown)}; "
                        f"EvalConfig's fields are {', '.join(_FIELDS)}")
    if isinstance(config, EvalConfig):
        if fields:
            given = ", ".join(fields)
            raise TypeError(
                f"evaluate: got an EvalConfig and the keyword arguments {given}; pass one of "
                f"them: dataclasses.replace(config, {given.split(', ')[0]}=...) gives a "
                "config with those fields changed")
        return config
    if config is not None:
        if "pairs" in fields:
            raise TypeError("evaluate: got the pairs twice, as the second argument and as "
                            "pairs=; pass them once")
        fields = {**fields, "pairs": config}
    return EvalConfig(**fields)
