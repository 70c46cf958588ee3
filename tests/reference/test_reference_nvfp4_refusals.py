"""Every refusal of the stand-in NVFP4 kernel, its buffer and its staging: a clear error
naming the function and argument, and a refused call changes nothing."""

from __future__ import annotations

import pytest
import torch
from nvfp4_cases import build

from moewire.reference import deep_gemm, prepare_megamoe_nvfp4_inputs
from moewire.reference.nvfp4.mega_moe import NVFP4SymmBuffer

E, K, H, INTER = 8, 3, 256, 256
BUFFER_ARGS = {"group": None, "num_experts": E, "num_max_tokens_per_rank": 8, "num_topk": K,
               "hidden": H, "intermediate_hidden": INTER}

BUFFER_CASES = [
    ("group-not-a-group", {"group": "world"}, TypeError, "group must be"),
    ("experts-zero", {"num_experts": 0}, ValueError, "num_experts must be"),
    ("tokens-bool", {"num_max_tokens_per_rank": True}, ValueError, "num_max_tokens_per_rank"),
    ("topk-too-large", {"num_topk": 9}, ValueError, "exceeds num_experts"),
    ("topk-over-warp", {"num_experts": 64, "num_topk": 32, "num_shared_experts": 1},
     ValueError, "fit one warp"),
    ("hidden-not-128", {"hidden": 192}, ValueError, "hidden=192 must be a multiple of 128"),
    ("inter-not-128", {"intermediate_hidden": 64}, ValueError, "intermediate_hidden=64"),
    ("shared-negative", {"num_shared_experts": -1}, ValueError, "num_shared_experts"),
    ("shared-dtype", {"shared_dtype": torch.float16}, ValueError, "shared_dtype must be"),
    ("base-wrong-type", {"base": object()}, ValueError, "base must be a live NVFP4SymmBuffer"),
]


@pytest.mark.parametrize("change,exc,match", [c[1:] for c in BUFFER_CASES],
                         ids=[c[0] for c in BUFFER_CASES])
def test_buffer_refusals(change, exc, match):
    with pytest.raises(exc, match=f"NVFP4SymmBuffer: .*{match}"):
        NVFP4SymmBuffer(**{**BUFFER_ARGS, **change}, device="cpu")


def test_buffer_base_too_small_and_reuse():
    small = NVFP4SymmBuffer(**BUFFER_ARGS, device="cpu")
    with pytest.raises(ValueError, match="needs .* bytes but base holds"):
        NVFP4SymmBuffer(**{**BUFFER_ARGS, "num_max_tokens_per_rank": 800}, base=small)
    reused = NVFP4SymmBuffer(**{**BUFFER_ARGS, "num_topk": 2}, base=small)
    assert reused.buffer.data_ptr() == small.buffer.data_ptr()
    small.destroy()
    with pytest.raises(ValueError, match="not destroyed"):
        NVFP4SymmBuffer(**BUFFER_ARGS, base=small)


def _staging_args(case, t=5):
    buf = case.buf
    return {
        "hidden_states": case.x[:t], "topk_weights": case.topk_weights[:t],
        "topk_ids": case.topk_idx[:t], "x": buf.x[:t], "x_sf": buf.x_sf[:t],
        "x_scales": buf.x_scales[:t], "topk_idx_out": buf.topk_idx[:t],
        "topk_weights_out": buf.topk_weights[:t], "shared_x": buf.shared_l1_acts[:t],
        "shared_x_sf": buf.shared_l1_acts_sf, "shared_block_m": 8,
        "w2_global_scale": case.weights.l2_global_scale, "l2_alpha": case.l2_alpha,
    }


class _EPLB:
    logical_to_physical_map = torch.zeros(1)


STAGING_CASES = [
    ("hidden-1d", lambda a: {"hidden_states": a["hidden_states"][0]}, TypeError, "2-D"),
    ("hidden-int", lambda a: {"hidden_states": a["hidden_states"].int()}, TypeError, "floating"),
    ("hidden-not-128", lambda a: {"hidden_states": a["hidden_states"][:, :192]}, ValueError,
     "multiple of 128"),
    ("topk-shape", lambda a: {"topk_weights": a["topk_weights"][:, :2]}, ValueError, "[T, k]"),
    ("topk-ids-float", lambda a: {"topk_ids": a["topk_ids"].float()}, TypeError, "integer"),
    ("x-dtype", lambda a: {"x": a["x"].view(torch.float8_e4m3fn)}, TypeError, "x must have"),
    ("x-sf-shape", lambda a: {"x_sf": a["x_sf"][:, :2]}, ValueError, "x_sf must have shape"),
    ("x-scales-dtype", lambda a: {"x_scales": a["x_scales"].double()}, TypeError, "x_scales"),
    ("idx-out-dtype", lambda a: {"topk_idx_out": a["topk_idx_out"].int()}, TypeError,
     "topk_idx_out"),
    ("sf-without-fp8", lambda a: {"shared_x": None}, ValueError, "go together"),
    ("block-m-missing", lambda a: {"shared_block_m": None}, ValueError, "go together"),
    ("block-m-zero", lambda a: {"shared_block_m": 0}, ValueError, "shared_block_m must be"),
    ("shared-sf-short", lambda a: {"shared_x_sf": a["shared_x_sf"][:100]}, ValueError,
     "shared_x_sf must be int32"),
    ("shared-x-shape", lambda a: {"shared_x": a["shared_x"][:, :128]}, ValueError,
     "shared_x must have shape"),
    ("alpha-alone", lambda a: {"w2_global_scale": None}, ValueError, "together"),
    ("alpha-dtype", lambda a: {"l2_alpha": a["l2_alpha"].double(), "w2_global_scale":
                               a["w2_global_scale"].double()}, TypeError, "l2_alpha must be"),
    ("global-shape", lambda a: {"w2_global_scale": a["w2_global_scale"][:3]}, ValueError,
     "w2_global_scale"),
    ("act-scale-zero", lambda a: {"l2_activation_scale": 0.0}, ValueError,
     "l2_activation_scale"),
    ("act-scale-inf", lambda a: {"l2_activation_scale": float("inf")}, ValueError,
     "l2_activation_scale"),
    ("eplb-active", lambda a: {"eplb_state": _EPLB()}, NotImplementedError, "EPLB"),
    ("padding-short", lambda a: {"is_padding": torch.zeros(2, dtype=torch.bool)}, ValueError,
     "is_padding"),
]


@pytest.mark.parametrize("change,exc,match", [c[1:] for c in STAGING_CASES],
                         ids=[c[0] for c in STAGING_CASES])
def test_staging_refusals_change_nothing(change, exc, match):
    case = build(shared="mxfp8", seed="refuse-stage", t=5, run_kernel=False)
    buf = case.buf
    case.l2_alpha.fill_(-7.0)
    before = buf.buffer.clone()
    args = _staging_args(case)
    args.update(change(args))
    with pytest.raises(exc, match=rf"prepare_megamoe_nvfp4_inputs: .*{match}"):
        prepare_megamoe_nvfp4_inputs(**args)
    assert torch.equal(buf.buffer, before)
    assert (case.l2_alpha == -7.0).all()


def _kernel_args(case):
    w = case.weights
    return {
        "y": torch.full((case.t, H), 3.0, dtype=torch.bfloat16), "l1_weights": w.l1,
        "l2_weights": w.l2, "sym_buffer": case.buf, "shared_l1_weights": w.shared_l1,
        "shared_l2_weights": w.shared_l2, "l1_alpha": w.l1_global_scale,
        "l2_alpha": case.l2_alpha, "use_x_scales": True,
    }


KERNEL_CASES = [
    ("buffer-type", lambda a: {"sym_buffer": object()}, TypeError, "NVFP4SymmBuffer"),
    ("activation", lambda a: {"activation": "gelu"}, ValueError, "activation must be"),
    ("alpha-inf", lambda a: {"activation_alpha": float("inf")}, ValueError, "activation_alpha"),
    ("beta-str", lambda a: {"activation_beta": "0"}, ValueError, "activation_beta"),
    ("swiglustep-shared", lambda a: {"activation": "swiglustep"}, ValueError, "swiglustep"),
    ("clamp-negative", lambda a: {"activation_clamp": -1.0}, ValueError, "activation_clamp"),
    ("fast-math-int", lambda a: {"fast_math": 1}, TypeError, "fast_math"),
    ("x-scales-str", lambda a: {"use_x_scales": "yes"}, TypeError, "use_x_scales"),
    ("l2-scale-neg", lambda a: {"l2_activation_scale": -1.0}, ValueError, "l2_activation_scale"),
    ("y-1d", lambda a: {"y": a["y"][0]}, TypeError, "y must be a 2-D"),
    ("y-dtype", lambda a: {"y": a["y"].float()}, TypeError, "y must have dtype"),
    ("y-too-many", lambda a: {"y": torch.zeros((400, H), dtype=torch.bfloat16)}, ValueError,
     "num_max_tokens_per_rank=384"),
    ("y-strided", lambda a: {"y": torch.zeros((H, a["y"].shape[0]), dtype=torch.bfloat16).t()},
     ValueError, "contiguous"),
    ("l1-not-pair", lambda a: {"l1_weights": a["l1_weights"][0]}, TypeError, "tuple"),
    ("l1-shape", lambda a: {"l1_weights": (a["l1_weights"][0][:4], a["l1_weights"][1])},
     ValueError, "l1_weights\\[0\\] must have shape"),
    ("l2-sf-dtype", lambda a: {"l2_weights": (a["l2_weights"][0], a["l2_weights"][1].float())},
     TypeError, "l2_weights\\[1\\]"),
    ("l1-alpha-shape", lambda a: {"l1_alpha": a["l1_alpha"][:2]}, ValueError, "l1_alpha"),
    ("stats-dtype", lambda a: {"cumulative_local_expert_recv_stats": torch.zeros(E)},
     TypeError, "cumulative_local_expert_recv_stats"),
    ("shared-one-only", lambda a: {"shared_l2_weights": None}, ValueError, "both"),
    ("shared-missing", lambda a: {"shared_l1_weights": None, "shared_l2_weights": None},
     ValueError, "pass shared_l1_weights"),
    ("shared-bf16-for-fp8", lambda a: {
        "shared_l1_weights": a["shared_l1_weights"][0].bfloat16(),
        "shared_l2_weights": a["shared_l2_weights"][0].bfloat16()}, TypeError, "tuple"),
]


@pytest.mark.parametrize("change,exc,match", [c[1:] for c in KERNEL_CASES],
                         ids=[c[0] for c in KERNEL_CASES])
def test_kernel_refusals_change_nothing(change, exc, match):
    case = build(shared="mxfp8", seed="refuse-kernel", t=6, run_kernel=False)
    before = case.buf.buffer.clone()
    args = _kernel_args(case)
    args.update(change(args))
    y = args["y"]
    y_before = y.clone() if isinstance(y, torch.Tensor) else None
    with pytest.raises(exc, match=f"nvfp4_mega_moe: .*{match}"):
        deep_gemm.nvfp4_mega_moe(**args)
    assert torch.equal(case.buf.buffer, before)
    if y_before is not None:
        assert torch.equal(y, y_before)


def test_kernel_refuses_shared_weights_without_slot():
    case = build(shared="routed", seed="refuse-slot", t=4, run_kernel=False)
    shared = build(shared="mxfp8", seed="refuse-slot", t=4, run_kernel=False).weights
    args = {**_kernel_args(case), "shared_l1_weights": shared.shared_l1,
            "shared_l2_weights": shared.shared_l2}
    with pytest.raises(ValueError, match="nvfp4_mega_moe: shared_l1_weights given but"):
        deep_gemm.nvfp4_mega_moe(**args)


def test_kernel_refuses_bad_expert_ids_and_destroyed_buffer():
    case = build(seed="refuse-ids", t=4, run_kernel=False)
    case.buf.topk_idx[1, 0] = E
    with pytest.raises(ValueError, match=r"nvfp4_mega_moe: sym_buffer.topk_idx\[:4\] holds"):
        deep_gemm.nvfp4_mega_moe(**{**_kernel_args(case)})
    case.buf.destroy()
    with pytest.raises(ValueError, match="nvfp4_mega_moe: sym_buffer was destroyed"):
        deep_gemm.nvfp4_mega_moe(**_kernel_args(case))
