"""transformers' own Mega-MoE (``experts_implementation="deepgemm_megamoe"``) on one process
without an EP plan: a plain ``from_pretrained`` (transformers 5.23 applies no EP plan for
``ep_size=1``), ``prepare(model, kernel="stand-in")``, and the forward runs.

transformers' forward needs a ``process_group`` that only ``MegaMoeEP`` passes; ``prepare``
gives each such module a one-rank group, starting a process group of world size 1 when none
runs (``megamoe.one_rank_group``). The outputs are the layout-free oracle's (``_v4_oracle``)
and those of the same model under transformers' EP plan of one rank, bit for bit, unquantized
and calibrated.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.distributed.expert_parallel")

import _ep  # noqa: E402
import _tiny  # noqa: E402
import _v4_oracle as oracle  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import moewire  # noqa: E402
from moewire.integrations.transformers import megamoe  # noqa: E402

CLAMP = 10.0  # DeepseekV4Config.swiglu_limit, the kernel's activation_clamp
RECIPE = "moe_fp8_dispatch_nvfp4_combine"


def _load(path):
    import transformers as tf

    with megamoe.keep_fp8_on_cpu():
        return tf.AutoModelForCausalLM.from_pretrained(
            path, experts_implementation="deepgemm_megamoe")


def _ids():
    return torch.randint(0, _tiny.VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))


def _run(model):
    """The logits unquantized and calibrated with RECIPE, and the experts' first and last
    calls ``((x, idx, w), y)``."""
    calls = []
    experts = model.model.layers[0].mlp.experts
    hook = experts.register_forward_hook(lambda m, args, out: calls.append((args, out)))
    ids = _ids()
    with torch.no_grad():
        base = model(ids).logits
        moewire.quantize(model, RECIPE, lambda m: m(ids))
        quantized = model(ids).logits
    hook.remove()
    return base, quantized, calls[0], calls[-1]


@pytest.fixture
def own_world():
    """No process group before the test; the one ``prepare`` starts is destroyed after it."""
    from transformers.integrations.deepgemm import destroy_megamoe_buffers

    assert not dist.is_initialized()
    try:
        yield
    finally:
        destroy_megamoe_buffers()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_one_process_without_an_ep_plan_runs_as_the_ep_plan_of_one_rank(
        v4_checkpoints, moewire_registered, own_world):
    """prepare starts a process group of one rank, the forward gets its one-rank group, and
    every output equals the oracle's and the EP-plan-of-one model's bit for bit."""
    mt = moewire_registered
    fp4, bf16 = v4_checkpoints
    model = _load(fp4)
    experts = model.model.layers[0].mlp.experts
    assert not getattr(experts, "_is_hooked", False)
    mt.prepare(model, kernel="stand-in")
    assert dist.is_initialized() and dist.get_world_size() == 1
    group = experts.__dict__[megamoe.ONE_RANK]
    assert group.size() == 1 and dist.get_backend(group) == "gloo"
    base, quantized, ((x, idx, w), y), ((xq, idxq, wq), yq) = _run(model)
    assert experts.__dict__[megamoe.CALL_GROUP] is group

    l1, l2 = oracle.weights(bf16)
    dispatch = float(experts.dispatch_quantizer.static_amax)
    combine = float(experts.combine_quantizer.static_amax)
    assert (dispatch, combine) == oracle.calibrated_amaxes(x, idx, w.float(), l1, l2, CLAMP)
    assert torch.equal(y, oracle.predict(x, idx, w.float(), l1, l2, CLAMP)[0])
    want = oracle.predict(xq, idxq, wq.float(), l1, l2, CLAMP, dispatch, combine)[0]
    assert torch.equal(yq, want)
    assert not torch.equal(quantized, base)

    planned = _load(fp4)
    _ep.apply_ep(planned, "auto")
    mt.prepare(planned, kernel="stand-in")
    assert megamoe.ONE_RANK not in planned.model.layers[0].mlp.experts.__dict__
    base_ep, quantized_ep, _, _ = _run(planned)
    assert torch.equal(base, base_ep) and torch.equal(quantized, quantized_ep)


def test_a_running_world_of_one_rank_is_used_not_replaced(v4_checkpoints, moewire_registered,
                                                         one_rank):
    """Under the caller's process group of world size 1 prepare makes a gloo group of rank 0
    over it, and the forward equals the oracle's."""
    fp4, bf16 = v4_checkpoints
    world = dist.group.WORLD
    model = _load(fp4)
    moewire_registered.prepare(model, kernel="stand-in")
    assert dist.group.WORLD is world
    experts = model.model.layers[0].mlp.experts
    assert experts.__dict__[megamoe.ONE_RANK].size() == 1
    x = oracle.tokens(7, 512, seed=4)
    idx, w = oracle.routing(7, 8, 2, seed=5)
    l1, l2 = oracle.weights(bf16)
    with torch.no_grad():
        assert torch.equal(experts(x, idx, w), oracle.predict(x, idx, w, l1, l2, CLAMP)[0])


def test_several_ranks_without_an_ep_plan_are_refused_with_the_config(
        v4_checkpoints, moewire_registered, one_rank, monkeypatch):
    """A model of several ranks loaded without DistributedConfig: no one-rank group can stand
    for the EP group; the message gives the DistributedConfig that applies the plan."""
    model = _load(v4_checkpoints[0])
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(RuntimeError, match=r"^model\.layers\.0\.mlp\.experts: .* runs on 2 ranks "
                       r"without expert parallelism.*DistributedConfig\(tp_size=2, ep_size=2\)"):
        moewire_registered.prepare(model, kernel="stand-in")


def test_the_distributed_config_of_one_rank_runs_as_a_plain_load(v4_checkpoints,
                                                                  moewire_registered, own_world):
    """``DistributedConfig(tp_size=1, ep_size=1)``, the multi-rank recipe at N = 1, applies no
    plan; after prepare it runs, with the logits of a plain load."""
    import transformers as tf
    from transformers.distributed import DistributedConfig

    with megamoe.keep_fp8_on_cpu():
        configured = tf.AutoModelForCausalLM.from_pretrained(
            v4_checkpoints[0], experts_implementation="deepgemm_megamoe",
            distributed_config=DistributedConfig(tp_size=1, ep_size=1))
    plain = _load(v4_checkpoints[0])
    for model in (configured, plain):
        moewire_registered.prepare(model, kernel="stand-in")
    with torch.no_grad():
        assert torch.equal(configured(_ids()).logits, plain(_ids()).logits)
