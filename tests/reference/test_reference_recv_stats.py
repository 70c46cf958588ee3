"""``cumulative_local_expert_recv_stats`` adds up across calls in every stand-in that takes
it (DeepGEMM's ``atomicAdd`` into the caller's tensor, never a store): two calls on a tensor
that starts at 7 leave ``7 + 2 * counts``, where ``counts`` are the rows each local expert
received in one call. A stand-in that stores the counts (or adds them to zeros) leaves
``counts``."""

from __future__ import annotations

import pytest
import torch
from fp4_fp4_cases import SMALL as FP4_SMALL
from fp4_fp4_cases import buffer as fp4_buffer
from fp4_fp4_cases import cached_weights as fp4_weights
from fp4_fp4_cases import run as fp4_run
from nvfp4_cases import build as nvfp4_build
from nvfp4_cases import run as nvfp4_run
from reference_cases import build as fp8_build
from reference_cases import routing, tokens

from moewire.reference import deep_gemm, sm90_fork
from moewire.reference.fp4_fp4.staging import prepare_megamoe_nvfp4_inputs

START = 7


def _fp8xfp4(stats):
    case = fp8_build(t=25, seed=10, run=False)

    def call():
        y = torch.empty((25, case.buf.hidden), dtype=torch.bfloat16)
        deep_gemm.fp8_fp4_mega_moe(y, case.weights.l1, case.weights.l2, case.buf,
                                   cumulative_local_expert_recv_stats=stats)

    return call, case.topk_idx


def _nvfp4(stats):
    case = nvfp4_build(seed="stats-twice", t=19, run_kernel=False)

    def call():
        nvfp4_run(case.buf, case.weights, 19, case.l2_alpha,
                  cumulative_local_expert_recv_stats=stats)

    return call, case.buf.topk_idx[:19].clone()


def _fp4xfp4(stats):
    buf = fp4_buffer()
    weights = fp4_weights(FP4_SMALL["num_experts"], FP4_SMALL["hidden"],
                          FP4_SMALL["intermediate"], num_shared_experts=0, seed=5, device="cpu")
    t = 17
    x = tokens(t, FP4_SMALL["hidden"], seed=9)
    ids, w = routing(t, FP4_SMALL["num_experts"], FP4_SMALL["num_topk"], seed=9)
    prepare_megamoe_nvfp4_inputs(x, w, ids, buf.x[:t], buf.x_sf[:t], buf.topk_idx[:t],
                                 buf.topk_weights[:t])
    return lambda: fp4_run(buf, weights, x, cumulative_local_expert_recv_stats=stats), ids


def _sm90_fork(stats):
    e, k, h, i, t = 8, 3, 128, 128, 13
    buf = sm90_fork.get_symm_buffer_for_sm90_mega_moe(None, e, t, k, h, i, device="cpu")
    ids, w = routing(t, e, k, seed=4)
    buf.topk_idx[:t] = ids
    buf.topk_weights[:t] = w
    fp8 = torch.float8_e4m3fn
    l1 = (torch.zeros((e, 2 * i, h), dtype=fp8), torch.ones((e, 2 * i // 128, h // 128)))
    l2 = (torch.zeros((e, h, i), dtype=fp8), torch.ones((e, h // 128, i // 128)))
    l1, l2 = sm90_fork.transform_weights_for_mega_moe_sm90(l1, l2)
    y = torch.empty((t, h), dtype=torch.bfloat16)
    return lambda: sm90_fork.fp8_mega_moe_sm90(
        y, l1, l2, buf, cumulative_local_expert_recv_stats=stats), ids


STAND_INS = {"fp8xfp4": _fp8xfp4, "nvfp4": _nvfp4, "fp4xfp4": _fp4xfp4, "sm90-fork": _sm90_fork}


@pytest.mark.parametrize("name", list(STAND_INS), ids=list(STAND_INS))
def test_recv_stats_add_up_across_calls(name):
    """Break (per stand-in): store the call's counts instead of adding them."""
    stats = torch.full((8,), START, dtype=torch.int32)
    call, ids = STAND_INS[name](stats)
    counts = torch.bincount(ids[ids >= 0].flatten(), minlength=8).to(torch.int32)
    assert counts.sum() > 0 and (counts != counts[0]).any()
    call()
    assert torch.equal(stats, START + counts)
    call()
    assert torch.equal(stats, START + 2 * counts)
