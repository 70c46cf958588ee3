"""transformers' own Mega-MoE (``experts_implementation="deepgemm_megamoe"``) as a moewire
site, on one rank: transformers' forward and ``MegaMoeEP`` unmodified, the kernel the
stand-in of the kernels-hub DeepGEMM (``prepare(model, kernel="stand-in")``), the checkpoint
a tiny FP4 DeepSeek-V4 loaded on CPU as ``FP8Experts`` (``megamoe.keep_fp8_on_cpu``).

Every output is compared with the layout-free oracle (``_v4_oracle``: rows per slot from the
weights, never from the buffer) bit for bit. The multi-rank runs are in
``test_ep_ranks.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.distributed.expert_parallel")

import _ep  # noqa: E402
import _tiny  # noqa: E402
import _v4_oracle as oracle  # noqa: E402
import torch  # noqa: E402

import moewire  # noqa: E402
from moewire.integrations.transformers import megamoe, sites  # noqa: E402

SITE = sites.SITES[0]
CLAMP = 10.0  # DeepseekV4Config.swiglu_limit, the kernel's activation_clamp
RECIPE = "moe_fp8_dispatch_nvfp4_combine"


def _load_fp4(path, prepare=True, mt=None, implementation="auto"):
    import transformers as tf

    with megamoe.keep_fp8_on_cpu():
        model = tf.AutoModelForCausalLM.from_pretrained(
            path, experts_implementation="deepgemm_megamoe")
    _ep.apply_ep(model, implementation)
    if prepare:
        mt.prepare(model, kernel="stand-in")
    return model


def test_the_checkpoint_loads_as_fp8_experts_in_transformers_layout(v4_checkpoints,
                                                                    moewire_registered):
    """transformers' loader turns DeepSeek-V4-Flash's per-expert FP4 tensors into FP8Experts
    (int8 [E, 2I, H/2], UE8M0 [E, 2I, H/32]) holding the values the BF16 twin holds."""
    import transformers as tf
    from transformers.integrations.finegrained_fp8 import FP8Experts

    fp4, bf16 = v4_checkpoints
    with megamoe.keep_fp8_on_cpu():
        model = tf.AutoModelForCausalLM.from_pretrained(
            fp4, experts_implementation="deepgemm_megamoe")
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, FP8Experts)
    assert experts.gate_up_proj.dtype == torch.int8
    assert tuple(experts.gate_up_proj.shape) == (8, 1024, 256)
    assert experts.gate_up_proj_scale_inv.dtype == torch.float8_e8m0fnu
    l1, _ = oracle.weights(bf16)
    packed = experts.gate_up_proj[3].view(torch.uint8).long()
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)
    assert torch.equal(_tiny.decode(codes) * _tiny.L1_SCALE, l1[3])


def test_without_keep_fp8_on_cpu_transformers_dequantizes(v4_checkpoints):
    """transformers' own CPU fallback (what keep_fp8_on_cpu skips): BF16 experts."""
    import transformers as tf

    pytest.importorskip("accelerate")  # transformers' FP8 quantizer asks for it first
    fallback = tf.AutoModelForCausalLM.from_pretrained(v4_checkpoints[0])
    assert fallback.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16


def test_quantized_forward_is_what_the_layout_free_oracle_predicts(
        v4_checkpoints, moewire_registered, one_rank):
    """A tiny DeepSeek-V4 loaded with experts_implementation="deepgemm_megamoe", quantized
    with moe_fp8_dispatch_nvfp4_combine and a forward loop, runs transformers' own forward:
    every experts call of the unquantized and the quantized model equals the oracle (rows per
    slot from the weights, FP8 dispatch and NVFP4 combine of ModelOpt 0.47, the re-sum in
    ascending order) bit for bit, the calibrated amaxes are the oracle's, and the logits move."""
    fp4, bf16 = v4_checkpoints
    model = _load_fp4(fp4, mt=moewire_registered)
    l1, l2 = oracle.weights(bf16)
    experts = model.model.layers[0].mlp.experts
    calls = []
    experts.register_forward_hook(lambda m, args, out: calls.append((args, out)))
    ids = torch.randint(0, _tiny.VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(ids).logits
        moewire.quantize(model, RECIPE, lambda m: m(ids))
        quantized = model(ids).logits
    (x, idx, w), y = calls[0]
    (xq, idxq, wq), yq = calls[-1]
    want_dispatch, want_combine = oracle.calibrated_amaxes(x, idx, w.float(), l1, l2, CLAMP)
    dispatch = float(experts.dispatch_quantizer.static_amax)
    combine = float(experts.combine_quantizer.static_amax)
    assert (dispatch, combine) == (want_dispatch, want_combine)
    assert torch.equal(y, oracle.predict(x, idx, w.float(), l1, l2, CLAMP)[0])
    predicted = oracle.predict(xq, idxq, wq.float(), l1, l2, CLAMP, dispatch, combine)[0]
    assert torch.equal(yq, predicted)
    assert not torch.equal(yq, oracle.predict(xq, idxq, wq.float(), l1, l2, CLAMP)[0])
    assert not torch.equal(quantized, base)
    moewire.unquantize(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base)


def test_crafted_batch_matches_the_oracle_and_the_moewire_twin(v4_checkpoints,
                                                               moewire_registered, one_rank):
    """Tokens in [0.5, 1] (every FP32 sum exact by construction) through MegaMoeEP: the FP4
    model under transformers' kernel stand-in and its BF16 twin under "moewire" (fp8xfp4)
    both give the oracle's output, unquantized and with a constant-amax recipe."""
    import transformers as tf

    mt = moewire_registered
    fp4, bf16 = v4_checkpoints
    site_model = _load_fp4(fp4, mt=mt)
    twin = tf.AutoModelForCausalLM.from_pretrained(bf16, experts_implementation="moewire")
    _ep.apply_ep(twin, "moewire")
    mt.prepare(twin, "fp8xfp4")
    l1, l2 = oracle.weights(bf16)
    x = oracle.tokens(9, 512, seed=1)
    idx, w = oracle.routing(9, 8, 2, seed=2)
    recipe = {"quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "fp8", "constant_amax": 1.5}},
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "nvfp4",
                                                         "constant_amax": 100.0}}]}
    plain = oracle.predict(x, idx, w, l1, l2, CLAMP)[0]
    quantized = oracle.predict(x, idx, w, l1, l2, CLAMP, 1.5, 100.0)[0]
    for model in (site_model, twin):
        experts = model.model.layers[0].mlp.experts
        with torch.no_grad():
            assert torch.equal(experts(x, idx, w), plain)
            moewire.quantize(model, recipe)
            assert torch.equal(experts(x, idx, w), quantized)


def test_trampoline_is_in_the_interface_and_unregister_restores_it(moewire_registered):
    """register() puts moewire's trampoline of the forward in FP8ExpertsInterface (through
    transformers' own register) and an adapter on FP8Experts; unregister() puts back the
    forward itself."""
    from transformers.integrations import deepgemm, finegrained_fp8

    from moewire.megamoe.registry import registered_classes

    mapping = finegrained_fp8.FP8ExpertsInterface._global_mapping
    original = deepgemm.deepgemm_fp8_fp4_megamoe_experts_forward
    assert mapping["deepgemm_megamoe"].__wrapped__ is original
    assert finegrained_fp8.FP8Experts in registered_classes()
    assert sites.recognise(SITE) is None
    moewire_registered.unregister()
    assert mapping["deepgemm_megamoe"] is original
    assert finegrained_fp8.FP8Experts not in registered_classes()
    moewire_registered.register()


def test_stand_in_is_an_explicit_opt_in_undone_by_unregister(v4_checkpoints,
                                                              moewire_registered, one_rank):
    """Without kernel="stand-in" transformers' own loader and SM100 assertion run (and fail on
    CPU with the opt-in named); with it, _DEEPGEMM is the stand-in bundle (the kernels-hub
    build's facts: flavour deepgemm-main) and the assertion passes only while it is loaded;
    unregister() puts both back."""
    from transformers.integrations import deepgemm

    from moewire.megamoe.flavours import detect

    mt = moewire_registered
    original_check = deepgemm._assert_sm100_requirements
    model = _load_fp4(v4_checkpoints[0], prepare=False)
    with pytest.raises(RuntimeError, match=r"cannot load here .*kernel='stand-in'"):
        mt.prepare(model)
    assert deepgemm._DEEPGEMM is None and deepgemm._assert_sm100_requirements is original_check
    mt.prepare(model, kernel="stand-in")
    assert megamoe.stand_in_installed(SITE)
    assert detect(deepgemm._DEEPGEMM).name == SITE.build
    with pytest.raises(NotImplementedError, match="Mega-MoE entry points only"):
        deepgemm._DEEPGEMM.fp8_fp4_matmul()
    weights, ue8m0 = torch.zeros(1, dtype=torch.int8), torch.ones(1).to(torch.float8_e8m0fnu)
    deepgemm._assert_sm100_requirements(weights, ue8m0)
    with pytest.raises(NotImplementedError, match="FP32"):
        deepgemm._assert_sm100_requirements(weights, torch.zeros(1))
    stand_in = deepgemm._DEEPGEMM
    deepgemm._DEEPGEMM = object()  # another DeepGEMM loaded: transformers' own check runs
    try:
        with pytest.raises((RuntimeError, AssertionError, NotImplementedError)):
            deepgemm._assert_sm100_requirements(weights, ue8m0)
    finally:
        deepgemm._DEEPGEMM = stand_in
    mt.unregister()
    assert deepgemm._DEEPGEMM is None and deepgemm._assert_sm100_requirements is original_check
    mt.register()


def test_keep_fp8_on_cpu_restores_the_quantizer():
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    original = FineGrainedFP8HfQuantizer.__dict__["validate_environment"]
    with megamoe.keep_fp8_on_cpu():
        assert FineGrainedFP8HfQuantizer.__dict__["validate_environment"] is not original
    assert FineGrainedFP8HfQuantizer.__dict__["validate_environment"] is original


def _grad(model, mt):
    """A forward with gradients enabled on tokens that require them."""
    experts = model.model.layers[0].mlp.experts
    x = oracle.tokens(4, 512, seed=0).requires_grad_()
    idx, w = oracle.routing(4, 8, 2, seed=0)
    experts(x, idx, w)


def _no_group(model, mt):
    """The forward called directly, without the EP group MegaMoeEP passes."""
    from transformers.integrations.deepgemm import deepgemm_fp8_fp4_megamoe_experts_forward

    x = oracle.tokens(4, 512, seed=0)
    idx, w = oracle.routing(4, 8, 2, seed=0)
    with torch.no_grad():
        deepgemm_fp8_fp4_megamoe_experts_forward(model.model.layers[0].mlp.experts, x, idx, w)


def _fp8_weights(model, mt):
    experts = model.model.layers[0].mlp.experts
    experts._parameters["gate_up_proj"] = torch.nn.Parameter(
        torch.zeros(8, 1024, 512, dtype=torch.float8_e4m3fn), requires_grad=False)
    mt.prepare(model, kernel="stand-in")


def _mma_type(model, mt):
    mt.prepare(model, "fp8xfp4", kernel="stand-in")


def _sm90_kernel(model, mt):
    mt.prepare(model, kernel="deepgemm-sm90")


def _quantize_unloaded(model, mt):
    moewire.quantize(model, RECIPE)


@pytest.mark.parametrize(
    ("act", "prepared", "error", "message"),
    [
        (_grad, True, NotImplementedError, "has no backward"),
        (_no_group, True, ValueError, "requires a `process_group`"),
        (_fp8_weights, False, ValueError, "FP4 \\(int8-packed\\) expert weights, these are "
                                          "torch.float8_e4m3fn"),
        (_mma_type, False, ValueError, "mma_type='fp8xfp4' does not apply"),
        (_sm90_kernel, False, ValueError, "\\(kernel=None\\) or moewire's stand-in"),
        (_quantize_unloaded, False, RuntimeError, "has not loaded its DeepGEMM yet"),
    ],
    ids=["grad-enabled", "no-process-group", "fp8-weights", "mma-type", "other-kernel",
         "quantize-before-prepare"],
)
def test_site_refusals(act, prepared, error, message, v4_checkpoints, moewire_registered,
                       one_rank):
    """The site refuses what transformers' forward or the stand-in build cannot run, each with
    its reason: transformers' own checks (no backward, the EP group) pass through moewire's
    trampoline unchanged."""
    model = _load_fp4(v4_checkpoints[0], prepare=prepared, mt=moewire_registered)
    if prepared:
        with torch.no_grad():
            moewire.quantize(model, RECIPE, lambda m: m(torch.arange(8)[None]))
    with pytest.raises(error, match=message):
        act(model, moewire_registered)


def test_stand_in_refuses_to_replace_a_loaded_kernel(v4_checkpoints, moewire_registered,
                                                     one_rank, monkeypatch):
    from transformers.integrations import deepgemm

    model = _load_fp4(v4_checkpoints[0], prepare=False)
    monkeypatch.setattr(deepgemm, "_DEEPGEMM", object())
    with pytest.raises(RuntimeError, match="does not replace a real kernel by its stand-in"):
        moewire_registered.prepare(model, kernel="stand-in")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"calls": (*SITE.calls, ".fp8_fp4_mega_moe_v2(")}, "never calls fp8_fp4_mega_moe_v2"),
        ({"function": "megamoe_forward_v2"}, "has no function megamoe_forward_v2"),
        ({"group_arg": "ep_group"}, "takes no ep_group"),
        ({"bundle": "_DEEPGEMM_V2"}, "has no _DEEPGEMM_V2"),
        ({"name": "deepgemm_megamoe_v2"}, "does not map 'deepgemm_megamoe_v2'"),
    ],
    ids=["missing-call", "no-forward", "no-group-arg", "no-bundle", "not-mapped"],
)
def test_recognition_names_what_transformers_lacks(change, reason):
    import dataclasses

    assert reason in sites.recognise(dataclasses.replace(SITE, **change))
