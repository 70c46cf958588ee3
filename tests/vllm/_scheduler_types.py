"""Stand-ins of vLLM's scheduler types in the releases the installed vLLM (0.32) is not.

The one-launch worker builds each calibration step as vLLM's scheduler would
(``moewire.integrations.vllm.worker.scheduler_output``); these dataclasses have the
constructor shapes (field names, order, which have defaults) of
``vllm/v1/core/sched/output.py`` as read from:

- vLLM 0.33.0 and 0.34.0: the wheels on the package registry
  (``pip download --no-deps vllm==0.33.0``), file ``vllm/v1/core/sched/output.py``;
- vLLM main: ``vllm-project/vllm`` at commit ``a9b169409e5f3a8fa67b462c064c4080e93b82b7``,
  the newest version of that file the source index holds (it predates the 0.32 release's
  fields: ``num_common_prefix_blocks`` is still required, ``prompt_is_token_ids`` and
  ``replay_start`` are absent).

Written from reading, not copied: only the constructors (and ``make_empty``, which the
worker uses when a type has it) are modelled; vLLM's methods and reprs are not. Field types
are left loose (``Any``) where vLLM's own are connector or multimodal classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moewire.integrations.vllm.worker import SchedulerTypes

__all__ = ["SHAPES", "SamplingParams"]


@dataclass
class SamplingParams:
    """``vllm.SamplingParams`` as the worker uses it: every field has a default.

    vLLM 0.32, 0.33 and 0.34 (``vllm/sampling_params.py``, a ``msgspec.Struct``) each have
    43 fields, none required, ``max_tokens`` defaulting to 16; the worker sets only
    ``max_tokens``. The two modelled here are the ones the V2 runner reads first.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0


# -- vLLM 0.33.0 --------------------------------------------------------------------------


@dataclass
class NewRequestData033:
    """vLLM 0.33.0 ``NewRequestData``: ``prefill_token_ids`` optional (V2 runner only)."""

    req_id: str
    prompt_token_ids: list[int] | None
    mm_features: list[Any]
    sampling_params: Any
    pooling_params: Any
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: Any
    prompt_embeds: Any = None
    prompt_is_token_ids: list[bool] | None = None
    prefill_token_ids: list[int] | None = None
    replay_start: int = 0


@dataclass
class CachedRequestData033:
    """vLLM 0.33.0 ``CachedRequestData`` (as 0.32's), with ``make_empty``."""

    req_ids: list[str]
    resumed_req_ids: set[str]
    new_token_ids: list[list[int]]
    all_token_ids: dict[str, list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @classmethod
    def make_empty(cls) -> CachedRequestData033:
        return cls([], set(), [], {}, [], [], [])


@dataclass
class SchedulerOutput033:
    """vLLM 0.33.0 ``SchedulerOutput``: 0.32's plus ``encoder_input_updates`` and
    ``skip_drafts``; ``num_common_prefix_blocks`` optional (deprecated, empty)."""

    scheduled_new_reqs: list[Any]
    scheduled_cached_reqs: Any
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    scheduled_encoder_inputs: dict[str, list[int]]
    finished_req_ids: set[str]
    free_encoder_mm_hashes: list[str]
    encoder_input_updates: dict[str, dict[int, Any]] = field(default_factory=dict)
    scheduled_encoder_input_stats: Any = None
    preempted_req_ids: set[str] | None = None
    has_structured_output_requests: bool = False
    pending_structured_output_tokens: bool = False
    num_invalid_spec_tokens: dict[str, int] | None = None
    kv_connector_metadata: Any = None
    has_sync_kv_loads: bool = False
    aux_output_connector_metadata: Any = None
    ec_connector_metadata: Any = None
    ec_manager_metadata: Any = None
    new_block_ids_to_zero: list[int] | None = None
    kv_cache_block_copies: list[Any] | None = None
    kv_connector_block_state: Any = None
    num_spec_tokens_to_schedule: int = 0
    num_common_prefix_blocks: list[int] = field(default_factory=list)
    skip_drafts: bool = False


# -- vLLM 0.34.0 --------------------------------------------------------------------------


@dataclass
class NewRequestData034:
    """vLLM 0.34.0 ``NewRequestData``: ``prefill_token_ids`` required (the prompt, plus
    generated tokens on resume), placed after ``lora_request``."""

    req_id: str
    prompt_token_ids: list[int] | None
    mm_features: list[Any]
    sampling_params: Any
    pooling_params: Any
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: Any
    prefill_token_ids: list[int]
    prompt_embeds: Any = None
    prompt_is_token_ids: list[bool] | None = None
    replay_start: int = 0


@dataclass
class CachedRequestData034:
    """vLLM 0.34.0 ``CachedRequestData``: ``resumed_req_ids`` and ``all_token_ids`` gone."""

    req_ids: list[str]
    new_token_ids: list[list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @classmethod
    def make_empty(cls) -> CachedRequestData034:
        return cls([], [], [], [], [])


@dataclass
class SchedulerOutput034:
    """vLLM 0.34.0 ``SchedulerOutput``: ``num_common_prefix_blocks`` and
    ``ec_manager_metadata`` gone."""

    scheduled_new_reqs: list[Any]
    scheduled_cached_reqs: Any
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    scheduled_encoder_inputs: dict[str, list[int]]
    finished_req_ids: set[str]
    free_encoder_mm_hashes: list[str]
    encoder_input_updates: dict[str, dict[int, Any]] = field(default_factory=dict)
    scheduled_encoder_input_stats: Any = None
    preempted_req_ids: set[str] | None = None
    has_structured_output_requests: bool = False
    pending_structured_output_tokens: bool = False
    num_invalid_spec_tokens: dict[str, int] | None = None
    kv_connector_metadata: Any = None
    has_sync_kv_loads: bool = False
    aux_output_connector_metadata: Any = None
    ec_connector_metadata: Any = None
    new_block_ids_to_zero: list[int] | None = None
    kv_cache_block_copies: list[Any] | None = None
    kv_connector_block_state: Any = None
    num_spec_tokens_to_schedule: int = 0
    skip_drafts: bool = False


# -- vLLM main (vllm-project/vllm a9b169409e5f) -------------------------------------------


@dataclass
class NewRequestDataMain:
    """vLLM main ``NewRequestData`` (commit a9b1694): no ``prompt_is_token_ids`` or
    ``replay_start``; ``prefill_token_ids`` optional (V2 runner only)."""

    req_id: str
    prompt_token_ids: list[int] | None
    mm_features: list[Any]
    sampling_params: Any
    pooling_params: Any
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: Any
    prompt_embeds: Any = None
    prefill_token_ids: list[int] | None = None


@dataclass
class CachedRequestDataMain:
    """vLLM main ``CachedRequestData`` (commit a9b1694): the fields of 0.32's."""

    req_ids: list[str]
    resumed_req_ids: set[str]
    new_token_ids: list[list[int]]
    all_token_ids: dict[str, list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @classmethod
    def make_empty(cls) -> CachedRequestDataMain:
        return cls([], set(), [], {}, [], [], [])


@dataclass
class SchedulerOutputMain:
    """vLLM main ``SchedulerOutput`` (commit a9b1694): ``num_common_prefix_blocks``
    required (between ``scheduled_encoder_inputs`` and ``finished_req_ids``); no
    ``new_block_ids_to_zero`` (no block zeroing)."""

    scheduled_new_reqs: list[Any]
    scheduled_cached_reqs: Any
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    scheduled_encoder_inputs: dict[str, list[int]]
    num_common_prefix_blocks: list[int]
    finished_req_ids: set[str]
    free_encoder_mm_hashes: list[str]
    preempted_req_ids: set[str] | None = None
    has_structured_output_requests: bool = False
    pending_structured_output_tokens: bool = False
    num_invalid_spec_tokens: dict[str, int] | None = None
    kv_connector_metadata: Any = None
    ec_connector_metadata: Any = None


#: The stand-in shapes by vLLM version, as the worker's builder takes them.
SHAPES = {
    "0.33": SchedulerTypes(
        SchedulerOutput033, NewRequestData033, CachedRequestData033, SamplingParams, "0.33.0"
    ),
    "0.34": SchedulerTypes(
        SchedulerOutput034, NewRequestData034, CachedRequestData034, SamplingParams, "0.34.0"
    ),
    "main": SchedulerTypes(
        SchedulerOutputMain, NewRequestDataMain, CachedRequestDataMain, SamplingParams,
        "main (a9b1694)",
    ),
}
