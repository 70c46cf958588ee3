"""Calibrate and serve in one vLLM launch: ``--worker-cls`` for moewire.

vLLM appends a ``--worker-extension-cls`` to the worker's bases and refuses one that
defines a method the worker has, so an extension cannot run anything inside
``compile_or_warm_up_model``. A worker class can: :class:`MoewireWorker` subclasses the
platform's worker (``CPUWorker`` on a CPU platform, the GPU ``Worker`` elsewhere) and, in
``compile_or_warm_up_model`` (``vllm/v1/worker/gpu_worker.py``), before warm-up and
CUDA-graph capture:

- ``MOEWIRE_RECIPE`` unset: nothing (the worker is the platform's).
- ``MOEWIRE_SCALES`` set: the experts are quantized with the scales loaded (by the plugin at
  model load, else here); nothing is calibrated.
- otherwise: quantize (if the plugin has not), then run calibration forwards on real
  tokens through the worker's own ``execute_model`` (a ``SchedulerOutput`` per step, as
  ModelOpt's ``examples/vllm_serve`` does), max-reduce every amax over the EP group and
  the DP group, write ``MOEWIRE_SAVE_SCALES`` when set, log a summary line, and only then
  hand over to the platform's warm-up and graph capture, which record the calibrated
  quantizers.

The calibration set (``MOEWIRE_CALIB_DATA``): unset -> the text file shipped with moewire
(``moewire/data/calibration.txt``, one sample per line, tokenized with the model's
tokenizer); a path to a ``.txt`` file (one sample per non-empty line) or a ``.json`` file
(a list of token-id lists); or an inline JSON list of token-id lists (``[[1, 2, 3], [4, 5]]``).
``MOEWIRE_CALIB_MAX_SEQS`` (default 64) caps the sequences and ``MOEWIRE_CALIB_SEQ_LEN``
(default 512) their length.

The steps are built from vLLM's scheduler types field by field (:func:`scheduler_output`),
for the constructor shapes of vLLM 0.32, 0.33, 0.34 and main; a shape it does not know is
refused when the worker is built, before the weights load.

One module for one idea, the one-launch worker: the worker class, its calibration set and
the scheduler steps it builds are one sequence inside ``compile_or_warm_up_model``, so they
stay in one file although it passes 600 lines.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.resources
import inspect
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moewire.integrations._host import rank_path
from moewire.integrations.vllm import (
    ENV_RECIPE,
    ENV_SCALES,
    MoewireWorkerExtension,
    quantize_vllm_model,
    vllm_version,
)
from moewire.integrations.vllm.groups import data_parallel, ep_rank

__all__ = [
    "DEFAULT_CALIB_FILE",
    "ENV_CALIB_DATA",
    "ENV_CALIB_MAX_SEQS",
    "ENV_CALIB_SEQ_LEN",
    "ENV_SAVE_SCALES",
    "KNOWN_SCHEDULER_SHAPES",
    "CalibrationPlan",
    "MoewireWorker",
    "SchedulerTypes",
    "calibration_plan",
    "calibration_token_ids",
    "calibrate_in_worker",
    "check_scheduler_types",
    "dp_shards",
    "pack_steps",
    "scheduler_output",
    "scheduler_types",
]

# A child of vLLM's logger: its handler puts these lines in the server log.
logger = logging.getLogger("vllm.moewire")

ENV_SAVE_SCALES = "MOEWIRE_SAVE_SCALES"
ENV_CALIB_DATA = "MOEWIRE_CALIB_DATA"
ENV_CALIB_MAX_SEQS = "MOEWIRE_CALIB_MAX_SEQS"
ENV_CALIB_SEQ_LEN = "MOEWIRE_CALIB_SEQ_LEN"
#: The calibration text shipped with moewire (package data ``moewire/data``).
DEFAULT_CALIB_FILE = "calibration.txt"
_DEFAULT_MAX_SEQS = 64
_DEFAULT_SEQ_LEN = 512


@dataclass(frozen=True)
class CalibrationPlan:
    """What one launch does before warm-up, read from the environment.

    Attributes:
        recipe: ``MOEWIRE_RECIPE`` (name or path).
        scales: ``MOEWIRE_SCALES`` (load, calibrate nothing) or ``None`` (calibrate).
        save: ``MOEWIRE_SAVE_SCALES`` or ``None``; ``{rank}`` becomes the EP rank.
        data: ``MOEWIRE_CALIB_DATA`` or ``None`` (the packaged text).
        max_seqs: ``MOEWIRE_CALIB_MAX_SEQS``.
        seq_len: ``MOEWIRE_CALIB_SEQ_LEN``.
    """

    recipe: str
    scales: str | None = None
    save: str | None = None
    data: str | None = None
    max_seqs: int = _DEFAULT_MAX_SEQS
    seq_len: int = _DEFAULT_SEQ_LEN

    @property
    def calibrates(self) -> bool:
        return self.scales is None


def _positive_int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"moewire worker: {key}={raw!r} must be a positive integer")
    return value


def _not_a_file(data: str) -> str:
    return (
        f"moewire worker: {ENV_CALIB_DATA}={data!r} is not a file; give a .txt (one sample "
        "per line) or .json (token-id lists) file, or inline token ids [[1, 2]]"
    )


def calibration_plan(env: Mapping[str, str] | None = None) -> CalibrationPlan | None:
    """The plan the environment asks for, or ``None`` without ``MOEWIRE_RECIPE``.

    Raises:
        ValueError: ``MOEWIRE_SAVE_SCALES`` or calibration settings without
            ``MOEWIRE_RECIPE``; ``MOEWIRE_SAVE_SCALES`` together with ``MOEWIRE_SCALES``
            (nothing is calibrated, so nothing new would be saved); a count that is not a
            positive integer; a ``MOEWIRE_CALIB_DATA`` path that is not a file.
    """
    env = os.environ if env is None else env
    recipe = env.get(ENV_RECIPE) or None
    scales = env.get(ENV_SCALES) or None
    save = env.get(ENV_SAVE_SCALES) or None
    data = env.get(ENV_CALIB_DATA) or None
    if recipe is None:
        stray = [k for k in (ENV_SCALES, ENV_SAVE_SCALES, ENV_CALIB_DATA) if env.get(k)]
        if stray:
            raise ValueError(
                f"moewire worker: {', '.join(stray)} set without {ENV_RECIPE}; set "
                f"{ENV_RECIPE}=<recipe name or path> (or unset them to serve unquantized)"
            )
        return None
    if scales is not None and save is not None:
        raise ValueError(
            f"moewire worker: {ENV_SAVE_SCALES} and {ENV_SCALES} are both set; with "
            f"{ENV_SCALES} the launch loads scales and calibrates nothing. Unset "
            f"{ENV_SCALES} to calibrate and save, or {ENV_SAVE_SCALES} to load"
        )
    if data is not None and not data.lstrip().startswith("[") and not Path(data).is_file():
        raise ValueError(_not_a_file(data))
    return CalibrationPlan(
        recipe=recipe, scales=scales, save=save, data=data,
        max_seqs=_positive_int(env, ENV_CALIB_MAX_SEQS, _DEFAULT_MAX_SEQS),
        seq_len=_positive_int(env, ENV_CALIB_SEQ_LEN, _DEFAULT_SEQ_LEN),
    )


def _token_lists(value: Any, where: str) -> list[list[int]]:
    if not isinstance(value, list) or not value or not all(
        isinstance(seq, list) and seq and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in seq
        )
        for seq in value
    ):
        raise ValueError(
            f"moewire worker: {where} must be a non-empty JSON list of non-empty lists of "
            "token ids >= 0, e.g. [[1, 2, 3], [4, 5]]"
        )
    return value


def calibration_token_ids(
    data: str | None, tokenizer: Any, vocab_size: int, max_seqs: int, seq_len: int
) -> list[list[int]]:
    """The calibration sequences as token ids (at most ``max_seqs``, each ``<= seq_len``).

    Args:
        data: ``MOEWIRE_CALIB_DATA`` (see the module docstring) or ``None``.
        tokenizer: the model's tokenizer (``encode(text) -> list[int]``), or ``None``
            (``skip_tokenizer_init``: then only token ids are accepted).
        vocab_size: the model's vocabulary; every id must be below it.
        max_seqs, seq_len: the caps.

    Raises:
        ValueError: a missing or empty file, malformed token ids, ids outside the
            vocabulary, or text with no tokenizer; the message says what to give instead.
    """
    where = ENV_CALIB_DATA
    if data is not None and data.lstrip().startswith("["):
        try:
            seqs = _token_lists(json.loads(data), where)
        except json.JSONDecodeError as exc:
            raise ValueError(f"moewire worker: {where} is not valid JSON ({exc})") from exc
    else:
        if data is None:
            text = (importlib.resources.files("moewire") / "data" / DEFAULT_CALIB_FILE)
            where, path = f"moewire's {DEFAULT_CALIB_FILE}", None
        else:
            path = Path(data)
            if not path.is_file():
                raise ValueError(_not_a_file(data))
            text, where = path, str(path)
        if path is not None and path.suffix == ".json":
            try:
                seqs = _token_lists(json.loads(path.read_text()), where)
            except json.JSONDecodeError as exc:
                raise ValueError(f"moewire worker: {where} is not valid JSON ({exc})") from exc
        else:
            lines = [line.strip() for line in text.read_text(encoding="utf-8").splitlines()]
            lines = [line for line in lines if line]
            if not lines:
                raise ValueError(f"moewire worker: {where} has no non-empty line to calibrate on")
            if tokenizer is None:
                raise ValueError(
                    f"moewire worker: {where} is text but the engine has no tokenizer "
                    f"(skip_tokenizer_init); give token ids in {ENV_CALIB_DATA} instead"
                )
            seqs = [list(tokenizer.encode(line)) for line in lines[:max_seqs]]
    seqs = [seq[:seq_len] for seq in seqs[:max_seqs]]
    bad = [t for seq in seqs for t in seq if t >= vocab_size]
    if bad:
        raise ValueError(
            f"moewire worker: {where} holds token id {bad[0]} but the model's vocabulary has "
            f"{vocab_size} entries; tokenize with this model's tokenizer"
        )
    return seqs


def pack_steps(
    lengths: list[int], max_tokens: int, max_seqs: int, block_sizes: list[int],
    free_blocks: int,
) -> list[list[int]]:
    """Group sequence indices into engine steps, in order.

    A step holds at most ``max_seqs`` sequences, ``max_tokens`` tokens and ``free_blocks``
    KV blocks (a sequence of ``n`` tokens takes ``ceil(n / size)`` blocks in each KV cache
    group; the groups share one block pool). The packing depends only on ``lengths``.

    Raises:
        ValueError: one sequence alone does not fit a step.
    """
    steps: list[list[int]] = []
    current: list[int] = []
    tokens = blocks = 0
    for index, length in enumerate(lengths):
        need = sum(math.ceil(length / size) for size in block_sizes)
        if length > max_tokens or need > free_blocks:
            raise ValueError(
                f"moewire worker: a calibration sequence of {length} tokens does not fit one "
                f"step ({max_tokens} tokens, {free_blocks} free KV blocks); lower "
                f"{ENV_CALIB_SEQ_LEN}"
            )
        if current and (
            len(current) == max_seqs or tokens + length > max_tokens
            or blocks + need > free_blocks
        ):
            steps.append(current)
            current, tokens, blocks = [], 0, 0
        current.append(index)
        tokens += length
        blocks += need
    if current:
        steps.append(current)
    return steps


def dp_shards(seqs: list[list[int]], dp_size: int) -> list[list[list[int]]]:
    """``dp_size`` equal contiguous shards of ``seqs`` (the remainder is left out).

    Raises:
        ValueError: fewer sequences than data-parallel ranks.
    """
    per_rank = len(seqs) // dp_size
    if per_rank == 0:
        raise ValueError(
            f"moewire worker: {len(seqs)} calibration sequences for {dp_size} data-parallel "
            f"ranks; give at least {dp_size} ({ENV_CALIB_DATA}, {ENV_CALIB_MAX_SEQS})"
        )
    return [seqs[r * per_rank:(r + 1) * per_rank] for r in range(dp_size)]


@dataclass(frozen=True)
class SchedulerTypes:
    """The vLLM types a calibration step is built from.

    Attributes:
        scheduler_output: ``vllm.v1.core.sched.output.SchedulerOutput``.
        new_request_data: ``vllm.v1.core.sched.output.NewRequestData``.
        cached_request_data: ``vllm.v1.core.sched.output.CachedRequestData``.
        sampling_params: ``vllm.SamplingParams``.
        version: the vLLM version they come from (named in refusals).
    """

    scheduler_output: type
    new_request_data: type
    cached_request_data: type
    sampling_params: type
    version: str


def scheduler_types() -> SchedulerTypes:
    """The installed vLLM's scheduler types."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    from vllm import SamplingParams

    return SchedulerTypes(
        SchedulerOutput, NewRequestData, CachedRequestData, SamplingParams, vllm_version()
    )


#: The shapes :func:`scheduler_output` was checked against (named in refusals).
KNOWN_SCHEDULER_SHAPES = "vLLM 0.32, 0.33, 0.34 and main"


def _refuse(types: SchedulerTypes, cls: type, what: str) -> RuntimeError:
    return RuntimeError(
        f"moewire worker: vLLM {types.version}'s {cls.__name__} {what}; one-launch "
        f"calibration builds its steps for the scheduler types of {KNOWN_SCHEDULER_SHAPES} "
        "only. Calibrate with the two-RPC path (moewire.integrations.vllm.calibrate) and "
        f"serve with {ENV_SCALES}"
    )


def _build(
    types: SchedulerTypes, cls: type, values: Mapping[str, Any], needed: frozenset[str]
) -> Any:
    """``cls(**kwargs)`` with the fields of ``values`` that ``cls``'s constructor takes.

    A field moewire gives a value to but the constructor lacks is left out (vLLM 0.34
    dropped ``SchedulerOutput.num_common_prefix_blocks``); a field the constructor has and
    moewire does not know keeps its default.

    Raises:
        RuntimeError: a field of ``needed`` is gone (the type no longer means what the
            steps assume), or the constructor requires a field moewire has no value for.
    """
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError) as exc:
        raise _refuse(types, cls, f"has no readable constructor signature ({exc})") from exc
    named = {
        name: p for name, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    gone = sorted(needed - named.keys())
    if gone:
        raise _refuse(types, cls, f"lacks the field(s) {gone} the steps fill")
    unknown = sorted(
        name for name, p in named.items()
        if p.default is inspect.Parameter.empty and name not in values
    )
    if unknown:
        raise _refuse(types, cls, f"requires the field(s) {unknown}, which moewire does not know")
    try:
        return cls(**{name: value for name, value in values.items() if name in named})
    except (TypeError, ValueError) as exc:
        raise _refuse(types, cls, f"refused the steps' fields ({exc})") from exc


_NEEDED_REQUEST = frozenset(
    {"req_id", "prompt_token_ids", "sampling_params", "block_ids", "num_computed_tokens"}
)
_NEEDED_OUTPUT = frozenset(
    {"scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
     "total_num_scheduled_tokens", "finished_req_ids"}
)
_ZERO_FIELD = "new_block_ids_to_zero"


def _no_cached_requests(types: SchedulerTypes) -> Any:
    cls = types.cached_request_data
    make_empty = getattr(cls, "make_empty", None)
    if callable(make_empty):
        return make_empty()  # vLLM's own empty value, right for its fields
    return _build(types, cls, {
        "req_ids": [], "resumed_req_ids": set(), "new_token_ids": [], "all_token_ids": {},
        "new_block_ids": [], "num_computed_tokens": [], "num_output_tokens": [],
    }, frozenset({"req_ids"}))


def scheduler_output(
    batch: list[tuple[str, list[int]]], finished: set[str], block_sizes: list[int], *,
    zero_blocks: bool = False, types: SchedulerTypes | None = None,
) -> Any:
    """One calibration step: ``batch`` as fresh prefill requests, ``finished`` released.

    Built field by field from the constructors' signatures (:func:`_build`), so it takes
    the shapes of vLLM 0.32 to 0.34 and main: ``prefill_token_ids`` (optional and read by
    the V2 model runner in 0.32/0.33, required in 0.34) is the prompt, and
    ``num_common_prefix_blocks`` (required on main, deprecated in 0.32/0.33, gone in 0.34)
    is zero per KV cache group where the type has it.

    Args:
        batch: ``(request id, token ids)`` per request, each a whole prompt.
        finished: the previous step's request ids (their state and blocks are freed).
        block_sizes: the block size of each KV cache group; a request of ``n`` tokens gets
            ``ceil(n / size)`` blocks in each group, numbered from 1 (0 is vLLM's null
            block) in one pool shared by the groups.
        zero_blocks: the KV cache needs fresh blocks zeroed (``needs_kv_cache_zeroing``:
            Mamba or mixed-precision caches): every block of the step is listed in
            ``new_block_ids_to_zero``.
        types: the scheduler types (default: the installed vLLM's).

    Raises:
        RuntimeError: a scheduler type whose shape moewire does not know (a required field
            it has no value for, a field it needs that is gone), or ``zero_blocks`` on a
            ``SchedulerOutput`` without ``new_block_ids_to_zero``.
    """
    types = scheduler_types() if types is None else types
    new_reqs, counts, used = [], {}, []
    next_block = 1  # block 0 is vLLM's null block; the groups share one pool
    for req_id, tokens in batch:
        block_ids, first = [], next_block
        for size in block_sizes:
            count = math.ceil(len(tokens) / size)
            block_ids.append(list(range(next_block, next_block + count)))
            next_block += count
        used.extend(range(first, next_block))
        new_reqs.append(_build(types, types.new_request_data, {
            "req_id": req_id, "prompt_token_ids": tokens, "prefill_token_ids": list(tokens),
            "mm_features": [], "sampling_params": _build(
                types, types.sampling_params, {"max_tokens": 1}, frozenset({"max_tokens"})
            ), "pooling_params": None,
            "block_ids": tuple(block_ids), "num_computed_tokens": 0, "lora_request": None,
        }, _NEEDED_REQUEST))
        counts[req_id] = len(tokens)
    values: dict[str, Any] = {
        "scheduled_new_reqs": new_reqs,
        "scheduled_cached_reqs": _no_cached_requests(types),
        "num_scheduled_tokens": counts,
        "total_num_scheduled_tokens": sum(counts.values()),
        "scheduled_spec_decode_tokens": {},
        "scheduled_encoder_inputs": {},
        "num_common_prefix_blocks": [0] * len(block_sizes),
        "finished_req_ids": finished,
        "free_encoder_mm_hashes": [],
    }
    needed = _NEEDED_OUTPUT
    if zero_blocks:
        # The scheduler lists the blocks it just allocated; every step reuses blocks from 1.
        values[_ZERO_FIELD] = used or None
        needed = needed | {_ZERO_FIELD}
    return _build(types, types.scheduler_output, values, needed)


def check_scheduler_types(types: SchedulerTypes | None = None) -> None:
    """Refuse a vLLM whose scheduler types the steps cannot be built for (a probe step).

    Raises:
        RuntimeError: as :func:`scheduler_output`.
    """
    scheduler_output([("moewire-probe", [0])], set(), [1], types=types)


def _eplb_suppressed(runner: Any) -> contextlib.AbstractContextManager[Any]:
    # vLLM 0.33+'s V2 runner: EPLBController.suppress() keeps warm-up forwards from
    # stepping EPLB or recording expert load; 0.32 and the V1 runner have no such switch.
    suppress = getattr(getattr(runner, "eplb", None), "suppress", None)
    return suppress() if callable(suppress) else contextlib.nullcontext()


def _run_step(worker: Any, output: Any) -> None:
    if worker.execute_model(output) is None:
        worker.sample_tokens(None)


def _tokenizer(worker: Any) -> Any:
    if worker.model_config.skip_tokenizer_init:
        return None
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(worker.model_config)


def calibrate_in_worker(worker: Any, plan: CalibrationPlan) -> str:
    """Quantize (if not yet), calibrate on real tokens, sync EP and DP, save; the summary.

    Runs inside the worker before warm-up. Every step is one ``execute_model`` of fresh
    prefill requests (KV blocks counted from 1, freed by the next step's
    ``finished_req_ids``); each data-parallel rank runs its own equal shard, and all ranks
    run the same number of steps.

    Returns:
        The summary line that was logged.

    Raises:
        ValueError: bad calibration data (see :func:`calibration_token_ids`).
        RuntimeError: pipeline parallelism (steps would need intermediate tensors); scheduler
            types of a shape moewire does not know (:func:`scheduler_output`), refused
            before anything is quantized or run.
    """
    from moewire.megamoe import api

    started = time.perf_counter()
    if worker.vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise RuntimeError(
            "moewire worker: one-launch calibration does not support pipeline parallelism; "
            "calibrate with the two-RPC path (moewire.integrations.vllm.calibrate) or serve "
            f"with {ENV_SCALES}"
        )
    kv_config = worker.model_runner.kv_cache_config
    block_sizes = [g.kv_cache_spec.block_size for g in kv_config.kv_cache_groups]
    zero = bool(getattr(kv_config, "needs_kv_cache_zeroing", False))
    types = scheduler_types()

    def step_output(batch: list[tuple[str, list[int]]], finished: set[str]) -> Any:
        return scheduler_output(batch, finished, block_sizes, zero_blocks=zero, types=types)

    step_output([("moewire-probe", [0])], set())  # an unknown vLLM shape: refused up front
    model = worker.model_runner.get_model()
    if not any(True for _ in api.quantizers(model)):
        quantize_vllm_model(model, plan.recipe)
    model_config = worker.model_config
    seqs = calibration_token_ids(
        plan.data, _tokenizer(worker), model_config.get_vocab_size(), plan.max_seqs,
        min(plan.seq_len, model_config.max_model_len - 1),
    )
    dp_group, dp_size, dp_rank = data_parallel()
    shards = dp_shards(seqs, dp_size)
    seqs = shards[dp_rank]
    scheduler = worker.vllm_config.scheduler_config
    # Packed on the longest sequence at each position over the shards: every DP rank runs
    # the same steps (vLLM coordinates each execute_model across DP).
    steps = pack_steps(
        [max(len(shard[i]) for shard in shards) for i in range(len(seqs))],
        scheduler.max_num_batched_tokens, scheduler.max_num_seqs, block_sizes,
        kv_config.num_blocks - 1,
    )
    total = sum(len(s) for s in seqs)
    logger.info(
        "moewire: calibrating %s on %d sequences (%d tokens) in %d steps before warm-up",
        plan.recipe, len(seqs), total, len(steps),
    )

    # moewire's one calibration: collect, then max-reduce over EP and DP, then load. As
    # vLLM's own warm-up (0.33+), the forwards record no expert load for EPLB.
    with _eplb_suppressed(worker.model_runner), api.calibrating(
        model, extra_groups=(dp_group,)
    ):
        finished: set[str] = set()
        for number, step in enumerate(steps, 1):
            batch = [(f"moewire-calib-{dp_rank}-{i}", seqs[i]) for i in step]
            _run_step(worker, step_output(batch, finished))
            finished = {req_id for req_id, _ in batch}
            logger.info("moewire: calibration step %d/%d (%d sequences)", number, len(steps),
                        len(batch))
        _run_step(worker, step_output([], finished))
    saved = ""
    if plan.save is not None:
        saved = f"; saved {api.save_scales(model, rank_path(plan.save, ep_rank()))}"
    active = [q for _, _, q in api.quantizers(model) if q.mode != "disabled"]
    amaxes = [float(q.static_amax) for q in active if q.static_amax is not None]
    line = (
        f"moewire: calibrated {len(active)} quantizers on {total} tokens in "
        f"{time.perf_counter() - started:.1f}s (EP+DP max-reduced over {dp_size} DP ranks), "
        f"amax range [{min(amaxes, default=0.0):.4g}, {max(amaxes, default=0.0):.4g}]{saved}"
    )
    logger.info(line)
    return line


def _load_instead(worker: Any, plan: CalibrationPlan) -> str:
    from moewire.megamoe import api

    model = worker.model_runner.get_model()
    if not any(True for _ in api.quantizers(model)):
        quantize_vllm_model(model, plan.recipe, plan.scales)
    line = f"moewire: serving {plan.recipe} with scales from {plan.scales}; nothing calibrated"
    logger.info(line)
    return line


#: The worker class of each vLLM platform (``current_platform.device_type``); any other
#: device type (``cuda``, ROCm's too) uses vLLM's GPU worker.
PLATFORM_WORKERS = {
    "cpu": "vllm.v1.worker.cpu_worker.CPUWorker",
    "xpu": "vllm.v1.worker.xpu_worker.XPUWorker",
}
GPU_WORKER = "vllm.v1.worker.gpu_worker.Worker"


def _platform_worker() -> type:
    from vllm.platforms import current_platform

    path = PLATFORM_WORKERS.get(current_platform.device_type, GPU_WORKER)
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


class _OneLaunch:
    """``compile_or_warm_up_model``: moewire's calibration (or scale load) first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Refuse a bad environment, or a vLLM whose scheduler types the calibration steps
        # cannot be built for, before the weights load.
        plan = calibration_plan()
        if plan is not None and plan.calibrates:
            check_scheduler_types()
        super().__init__(*args, **kwargs)

    def compile_or_warm_up_model(self) -> Any:
        plan = calibration_plan()
        if plan is not None:
            if plan.calibrates:
                calibrate_in_worker(self, plan)
            else:
                _load_instead(self, plan)
        return super().compile_or_warm_up_model()  # type: ignore[misc]


#: ``--worker-cls moewire.integrations.vllm.worker.MoewireWorker``: the platform's worker
#: (:data:`PLATFORM_WORKERS`)
#: with one-launch calibration, plus the two calibration RPCs of
#: :class:`~moewire.integrations.vllm.MoewireWorkerExtension`.
MoewireWorker = type(
    "MoewireWorker", (_OneLaunch, _platform_worker(), MoewireWorkerExtension),
    {"__module__": __name__},
)
