"""Every refusal of the reference kernel, buffer and staging: a clear error naming the cause."""

from __future__ import annotations

import pytest
import torch
from reference_cases import build, cached_weights

from moewire.reference import builds, deep_gemm, stage_mega_moe_inputs


def _buffer(**overrides):
    args = {"group": None, "num_experts": 8, "num_max_tokens_per_rank": 16, "num_topk": 2,
            "hidden": 512, "intermediate_hidden": 512, "device": "cpu"}
    args.update(overrides)
    return deep_gemm.get_symm_buffer_for_mega_moe(**args)


@pytest.mark.parametrize(
    "overrides,exc,match",
    [
        ({"hidden": 384}, ValueError, "hidden=384 must be a multiple of 512"),
        ({"intermediate_hidden": 640}, ValueError, "intermediate_hidden=640 must be a multiple"),
        ({"hidden": 192, "mma_type": "bf16xbf16"}, ValueError, "multiple of 128"),
        ({"num_topk": 9}, ValueError, "num_topk=9 exceeds num_experts=8"),
        ({"num_topk": 0}, ValueError, "num_topk must be an int >= 1"),
        ({"num_max_tokens_per_rank": 0}, ValueError, "num_max_tokens_per_rank"),
        ({"mma_type": "mxf4xmxf4"}, ValueError, "unknown mma_type"),
        ({"activation": "gelu"}, ValueError, r"activation must be one of \('swiglu', 'situ'\)"),
        ({"group": "world"}, TypeError, "group must be a torch.distributed.ProcessGroup"),
        ({"num_shared_experts": -1}, ValueError, "num_shared_experts"),
    ],
    ids=["hidden-not-512", "inter-not-512", "bf16-hidden-not-128", "topk-gt-experts",
         "topk-zero", "zero-tokens-capacity", "unknown-mma", "activation", "group-type",
         "negative-shared"],
)
def test_buffer_refusals(overrides, exc, match):
    with pytest.raises(exc, match=match):
        _buffer(**overrides)


@pytest.mark.parametrize("flavour", ["deepgemm-main", "deepgemm-sm90"])
def test_build_without_fusion_refuses_a_fused_shared_expert(flavour):
    with deep_gemm.use_flavour(flavour), pytest.raises(ValueError, match="no fused shared"):
        _buffer(num_shared_experts=1)


@pytest.mark.parametrize("flavour", ["deepgemm-sm90"])
def test_build_without_a_bf16_kernel_refuses_a_bf16_buffer(flavour):
    with deep_gemm.use_flavour(flavour), pytest.raises(ValueError, match="has no mma_type"):
        _buffer(mma_type="bf16xbf16")


@pytest.mark.parametrize("old", ["upstream", "vllm", "sgl"])
def test_old_flavour_names_are_refused_with_the_new_name(old):
    with pytest.raises(ValueError, match="was renamed"):
        deep_gemm.use_flavour(old)


@pytest.mark.parametrize("how", ["setter", "env"])
def test_unknown_flavour(how, monkeypatch):
    if how == "setter":
        with pytest.raises(ValueError, match="unknown reference kernel flavour 'trtllm'"):
            deep_gemm.use_flavour("trtllm")
    else:
        monkeypatch.setattr(builds, "_flavour_setting", None)
        monkeypatch.setenv(deep_gemm.ENV_FLAVOUR, "trtllm")
        with pytest.raises(ValueError, match="MOEWIRE_REFERENCE_FLAVOUR"):
            _buffer()


def _good_call():
    case = build(t=8, seed=1, run=False, num_topk=2)
    y = torch.empty((8, 512), dtype=torch.bfloat16)
    return case, {"y": y, "l1_weights": case.weights.l1, "l2_weights": case.weights.l2,
                  "sym_buffer": case.buf}


def _bad(name):
    """Each returns (kwargs edit, expected error type, message fragment)."""
    meta = torch.device("meta")
    table = {
        "T-gt-Tmax": (lambda c, kw: kw.update(y=torch.empty((385, 512), dtype=torch.bfloat16)),
                      ValueError, "num_max_tokens_per_rank=384"),
        "y-dtype": (lambda c, kw: kw.update(y=kw["y"].float()), TypeError, "y must have dtype"),
        "y-hidden": (lambda c, kw: kw.update(y=torch.empty((8, 256), dtype=torch.bfloat16)),
                     ValueError, "y must have shape"),
        "y-strided": (lambda c, kw: kw.update(
            y=torch.empty((512, 8), dtype=torch.bfloat16).t()), ValueError, "contiguous"),
        "y-device": (lambda c, kw: kw.update(y=kw["y"].to(meta)), ValueError, "y is on meta"),
        "l1-not-pair": (lambda c, kw: kw.update(l1_weights=kw["l1_weights"][0]), TypeError,
                        "l1_weights must be a"),
        "l1-shape": (lambda c, kw: kw.update(l1_weights=(kw["l1_weights"][0][:, :512],
                                                         kw["l1_weights"][1])),
                     ValueError, r"l1_weights\[0\] must have shape \(8, 1024, 256\)"),
        "l1-dtype": (lambda c, kw: kw.update(l1_weights=(kw["l1_weights"][0].float(),
                                                         kw["l1_weights"][1])),
                     TypeError, r"l1_weights\[0\] must have dtype"),
        "l2-scale-dtype": (lambda c, kw: kw.update(l2_weights=(kw["l2_weights"][0],
                                                               kw["l2_weights"][1].float())),
                           TypeError, r"l2_weights\[1\] must have dtype"),
        "l2-experts": (lambda c, kw: kw.update(l2_weights=tuple(t[:4] for t in kw["l2_weights"])),
                       ValueError, r"l2_weights\[0\] must have shape \(8,"),
        "l2-device": (lambda c, kw: kw.update(l2_weights=tuple(t.to(meta) for t in
                                                               kw["l2_weights"])),
                      ValueError, r"l2_weights\[0\] is on meta"),
        "shared-without-slot": (lambda c, kw: kw.update(
            shared_l1_weights=kw["l1_weights"], shared_l2_weights=kw["l2_weights"]),
            ValueError, "no shared slot"),
        "one-shared": (lambda c, kw: kw.update(shared_l1_weights=kw["l1_weights"]),
                       ValueError, "both shared_l1_weights and shared_l2_weights"),
        "recipe": (lambda c, kw: kw.update(recipe=(1, 128, 128)), ValueError, "recipe"),
        "activation": (lambda c, kw: kw.update(activation="gelu"), ValueError, "activation"),
        "clamp": (lambda c, kw: kw.update(activation_clamp=-1.0), ValueError,
                  "activation_clamp"),
        "situ-on-swiglu-buffer": (lambda c, kw: kw.update(activation="situ"), ValueError,
                                  "sym_buffer was built for activation='swiglu'"),
        "swiglu-alpha": (lambda c, kw: kw.update(activation_alpha=1.702), ValueError,
                         "GPT-OSS style"),
        "buffer-type": (lambda c, kw: kw.update(sym_buffer=c.buf.buffer), TypeError,
                        "sym_buffer must be a SymmBuffer"),
        "expert-id-range": (lambda c, kw: c.buf.topk_idx[0].fill_(8), ValueError,
                            r"expert ids outside \[-1, 8\)"),
        "destroyed": (lambda c, kw: c.buf.destroy(), ValueError, "destroyed"),
    }
    return table[name]


BAD = ["T-gt-Tmax", "y-dtype", "y-hidden", "y-strided", "y-device", "l1-not-pair", "l1-shape",
       "l1-dtype", "l2-scale-dtype", "l2-experts", "l2-device", "shared-without-slot",
       "one-shared", "recipe", "activation", "clamp", "situ-on-swiglu-buffer", "swiglu-alpha",
       "buffer-type", "expert-id-range", "destroyed"]


@pytest.mark.parametrize("name", BAD, ids=BAD)
def test_kernel_refusals(name):
    case, kwargs = _good_call()
    edit, exc, match = _bad(name)
    edit(case, kwargs)
    with pytest.raises(exc, match=match) as info:
        deep_gemm.fp8_fp4_mega_moe(**kwargs)
    assert str(info.value).startswith("fp8_fp4_mega_moe: ")


def test_kernel_refuses_a_buffer_of_the_other_mma_type():
    case, kwargs = _good_call()
    with pytest.raises(ValueError, match="call fp8_fp4_mega_moe instead"):
        deep_gemm.bf16_mega_moe(kwargs["y"], kwargs["l1_weights"][0], kwargs["l2_weights"][0],
                                case.buf)


def test_kernel_refuses_missing_shared_weights():
    case = build(t=4, shared=1, run=False, num_topk=2)
    y = torch.empty((4, 512), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_shared_experts=1; pass shared_l1_weights"):
        deep_gemm.fp8_fp4_mega_moe(y, case.weights.l1, case.weights.l2, case.buf)


def test_kernel_refuses_shared_weights_of_the_wrong_width():
    case = build(t=4, shared=1, run=False, num_topk=2)
    y = torch.empty((4, 512), dtype=torch.bfloat16)
    wide = cached_weights(8, 512, 512, num_shared_experts=2, seed=0)
    with pytest.raises(ValueError, match=r"shared_l1_weights\[0\] must have shape \(1024, 512\)"):
        deep_gemm.fp8_fp4_mega_moe(y, case.weights.l1, case.weights.l2, case.buf,
                                   shared_l1_weights=wide.shared_l1,
                                   shared_l2_weights=wide.shared_l2)


@pytest.mark.parametrize(
    "edit,exc,match",
    [
        (lambda x, i, w: (x[:, :256], i, w), ValueError, r"hidden_states must be \[T, 512\]"),
        (lambda x, i, w: (x, i.float(), w), TypeError, "topk_ids must be an integer"),
        (lambda x, i, w: (x, i, w.long()), TypeError, "topk_weights must be floating"),
        (lambda x, i, w: (x, i[:, :1], w), ValueError, r"topk_ids must be \[T, k\]"),
        (lambda x, i, w: (x.to("meta"), i, w), ValueError, "hidden_states is on meta"),
        (lambda x, i, w: (x.long(), i, w), TypeError, "hidden_states must be floating"),
    ],
    ids=["hidden-width", "ids-float", "weights-int", "ids-shape", "device", "hidden-int"],
)
def test_staging_refusals(edit, exc, match):
    case = build(t=6, run=False, num_topk=2)
    x, ids, w = edit(case.x, case.topk_idx, case.topk_weights)
    with pytest.raises(exc, match=match):
        stage_mega_moe_inputs(x, ids, w, case.buf)


def test_staging_refuses_short_padding_and_too_many_tokens():
    case = build(t=6, run=False, num_topk=2)
    with pytest.raises(ValueError, match="is_padding must be 1-D with at least T=6"):
        stage_mega_moe_inputs(case.x, case.topk_idx, case.topk_weights, case.buf,
                              torch.zeros(3, dtype=torch.bool))
    big = torch.zeros((400, 512), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_max_tokens_per_rank=384"):
        stage_mega_moe_inputs(big, torch.zeros((400, 2), dtype=torch.long),
                              torch.zeros((400, 2)), case.buf)


@pytest.mark.parametrize(
    "l1,l2,match",
    [
        (torch.zeros(8, 12, 512), torch.zeros(8, 512, 512), "needs a multiple of 16"),
        (torch.zeros(512), torch.zeros(8, 512, 512), "2-D or 3-D"),
        ((torch.zeros(8, 32, 256, dtype=torch.int8), torch.zeros(8, 32, 4, dtype=torch.int32)),
         torch.zeros(8, 512, 16), "both"),
    ],
    ids=["rows-not-16", "1-d", "mixed-structure"],
)
def test_transform_refusals(l1, l2, match):
    with pytest.raises((ValueError, TypeError), match=match):
        deep_gemm.transform_weights_for_mega_moe(l1, l2)
