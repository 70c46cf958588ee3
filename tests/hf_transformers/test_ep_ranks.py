"""transformers' expert parallelism over 2 and 4 gloo ranks (spawned processes, a timeout):
``MegaMoeEP`` running transformers' ``deepgemm_megamoe`` (the FP4 DeepSeek-V4, the
stand-in as its kernel) and moewire's ``"moewire"`` (the BF16 twin, ``fp8xfp4``), loaded by
``from_pretrained(..., distributed_config=DistributedConfig(...))`` as ``torchrun`` would.

A batch of 7 tokens leaves padding rows (expert id -1, weight 0) on the last ranks. On every
rank the experts' output equals the layout-free oracle bit for bit, unquantized and
quantized; calibration ends with the same amaxes on every rank, equal to the oracle's over
the whole batch (each rank saw only its slice: the reduction over the EP group made the
rest); one scales file is written, with vLLM's names; and an EP implementation that hands
the experts local ids is refused.

transformers' data parallelism is FSDP (``fsdp_size``, ``dp_replicate_size``), and with it
transformers 5.23's ``deepgemm_megamoe`` fails on its own (``setup_megamoe_weights`` replaces
parameters FSDP manages: the kernel then gets the untransformed UE8M0 scales, seen with 4
ranks, ``tp_size=ep_size=fsdp_size=2``); the DP groups calibration reduces over are tested
without ranks in ``test_megamoe_site.py``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import pytest

pytest.importorskip("transformers.distributed.expert_parallel")
pytest.importorskip("accelerate")  # transformers' distributed loading needs it

from spawn_ranks import run_ranks  # noqa: E402

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 300
T = 7
RECIPE = "moe_fp8_dispatch_nvfp4_combine"


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    try:
        _run(rank, world, init_file, Path(out_dir))
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _run(rank: int, world: int, init_file: str, out: Path) -> None:
    sys.path.insert(0, str(HERE))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import _v4_oracle as oracle
    import torch
    import torch.distributed as dist
    import transformers as tf
    from transformers.distributed import DistributedConfig
    from transformers.integrations.deepgemm import destroy_megamoe_buffers

    import moewire
    import moewire.integrations.transformers as mt
    from moewire.integrations.transformers import megamoe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    args = json.loads((out / "args.json").read_text())
    fp4, bf16 = Path(args["fp4"]), Path(args["bf16"])
    mt.register()

    def load(path, implementation, ep_implementation="auto"):
        # MegaMoeEP needs every rank of the EP group to hold the batch: tp_size == ep_size.
        cfg = DistributedConfig(tp_size=world, ep_size=world, ep_implementation=ep_implementation)
        with megamoe.keep_fp8_on_cpu():
            return tf.AutoModelForCausalLM.from_pretrained(
                path, experts_implementation=implementation, distributed_config=cfg)

    site = mt.prepare(load(fp4, "deepgemm_megamoe"), kernel="stand-in")
    twin = mt.prepare(load(bf16, "moewire", "moewire"), "fp8xfp4")
    l1, l2 = oracle.weights(bf16)
    x = oracle.tokens(T, 512, seed=10)
    idx, w = oracle.routing(T, 8, 2, seed=20)
    plain = oracle.predict(x, idx, w, l1, l2, 10.0)[0]
    result = {}
    for name, model in (("site", site), ("twin", twin)):
        experts = model.model.layers[0].mlp.experts
        with torch.no_grad():
            result[f"{name}_plain"] = torch.equal(experts(x, idx, w), plain)
            moewire.quantize(model, RECIPE, lambda m, e=experts: e(x, idx, w))
            quantized = experts(x, idx, w)
        dispatch = float(experts.dispatch_quantizer.static_amax)
        combine = float(experts.combine_quantizer.static_amax)
        result[f"{name}_amax"] = [dispatch, combine]
        want = oracle.predict(x, idx, w, l1, l2, 10.0, dispatch, combine)[0]
        result[f"{name}_quantized"] = torch.equal(quantized, want)
        result[f"{name}_moved"] = not torch.equal(quantized, plain)
    result["oracle_amax"] = list(oracle.calibrated_amaxes(x, idx, w, l1, l2, 10.0))
    ids = torch.arange(3, 12)[None]
    with torch.no_grad():
        a, b = site(ids).logits, twin(ids).logits
    result["logits_equal"] = torch.equal(a, b)
    result["logits_sum"] = float(a.double().sum())
    written = mt.save_scales(site, out / "scales.json", "vllm")
    result["scales_path"] = str(written)
    if world == 2:
        # AutoEP picks AllReduceEP for "moewire": local ids without the EP group.
        refused = mt.prepare(load(bf16, "moewire"), "fp8xfp4")
        experts = refused.model.layers[0].mlp.experts
        messages = []
        for grad in (False, True):
            try:
                if grad:
                    twin.model.layers[0].mlp.experts(x.clone().requires_grad_(), idx, w)
                else:
                    with torch.no_grad():
                        experts(x, idx, w)
            except RuntimeError as exc:
                messages.append(str(exc))
        result["refusals"] = messages
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    destroy_megamoe_buffers()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "4-ranks"])
def test_expert_parallel_ranks_match_the_oracle(world, v4_checkpoints, tmp_path):
    fp4, bf16 = v4_checkpoints
    (tmp_path / "args.json").write_text(json.dumps({"fp4": str(fp4), "bf16": str(bf16)}))
    results = run_ranks(_worker, world, tmp_path, TIMEOUT_S)
    for r in results:
        for name in ("site", "twin"):
            assert r[f"{name}_plain"] and r[f"{name}_quantized"] and r[f"{name}_moved"], r
        assert r["logits_equal"], r
    # Calibration: the same amaxes on every rank, the oracle's over the whole batch.
    want = results[0]["oracle_amax"]
    assert {tuple(r[f"{n}_amax"]) for r in results for n in ("site", "twin")} == {tuple(want)}
    assert len({r["logits_sum"] for r in results}) == 1
    scales = json.loads((tmp_path / "scales.json").read_text())["quantizers"]
    assert sorted(scales) == ["model.layers.0.ffn.experts.combine_quantizer",
                              "model.layers.0.ffn.experts.dispatch_quantizer"]
    assert scales["model.layers.0.ffn.experts.combine_quantizer"]["amax"] == [want[1]]
    assert {r["scales_path"] for r in results} == {str(tmp_path / "scales.json")}
    if world == 2:
        for r in results:
            no_group, grad = r["refusals"]
            assert "called without process_group" in no_group
            assert "ep_implementation='moewire'" in no_group
            assert "inference only" in grad
