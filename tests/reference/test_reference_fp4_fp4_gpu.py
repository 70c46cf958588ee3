"""The stand-in NVFP4 x NVFP4 kernel on CUDA (skipped without it): equal to the CPU run within
the GEMMs' summation order, ``y`` the oracle's combine of its own rows bit for bit, and the
one-rank path captured in a CUDA graph replaying as it runs eagerly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from fp4_fp4_cases import SMALL, buffer, build, run
from fp4_fp4_oracle import combine, combine_rows
from reference_cases import routing, tokens
from reference_oracle import bf16_values, np_bytes

from moewire.reference.fp4_fp4.staging import prepare_megamoe_nvfp4_inputs

pytestmark = pytest.mark.gpu


def _cuda(weights):
    def move(w):
        if w is None:
            return None
        return tuple(t.cuda() for t in w) if isinstance(w, tuple) else w.cuda()

    return dataclasses.replace(weights, **{f.name: move(getattr(weights, f.name))
                                           for f in dataclasses.fields(weights)
                                           if f.name != "experts"})


def _stage(buf, x, ids, w):
    t = x.shape[0]
    prepare_megamoe_nvfp4_inputs(x, w, ids, buf.x[:t], buf.x_sf[:t], buf.topk_idx[:t],
                                 buf.topk_weights[:t])


@pytest.mark.parametrize(
    "kwargs", [{}, {"shared": True, "routed_scaling_factor": 0.7, "a2": True, "clamp": 3.0}],
    ids=["routed", "shared-rsf-a2-clamp"],
)
def test_cuda_matches_cpu_and_combines_its_rows_bit_for_bit(kwargs):
    cpu = build(seed="gpu", t=33, **kwargs)
    buf = buffer(shared=bool(kwargs.get("shared")), device="cuda")
    weights = _cuda(cpu.weights)
    _stage(buf, cpu.x.cuda(), cpu.topk_idx.cuda(), cpu.topk_weights.cuda())
    assert torch.equal(buf.x[:33].cpu(), cpu.buf.x[:33]) and torch.equal(
        buf.x_sf[:33].cpu(), cpu.buf.x_sf[:33])
    a2 = None if cpu.a2_scales is None else cpu.a2_scales.cuda()
    y = run(buf, weights, cpu.x.cuda(), cpu.clamp, a2, cpu.routed_scaling_factor)
    assert y.is_cuda
    shared = weights.shared_l1 is not None
    np.testing.assert_array_equal(
        combine(combine_rows(buf), cpu.topk_idx.numpy(), 33, shared,
                cpu.routed_scaling_factor),
        np_bytes(y).view(np.uint16))
    ref = bf16_values(cpu.y)
    err = np.linalg.norm(bf16_values(y) - ref, axis=1)
    assert (err <= 2.0**-7 * np.linalg.norm(ref, axis=1)).all()
    assert np.mean(bf16_values(y) == ref) > 0.98


def test_one_rank_kernel_replays_in_a_cuda_graph():
    """Static shapes, no host sync: capture one call on static inputs, then replay on new
    tokens written into them; the replay equals an eager call on the same inputs."""
    buf = buffer(device="cuda")
    weights = _cuda(build(seed="graph-weights", t=4).weights)
    t = 24
    x = tokens(t, SMALL["hidden"], seed=1).cuda()
    ids, w = (a.cuda() for a in routing(t, SMALL["num_experts"], SMALL["num_topk"], seed=1))
    y = torch.empty((t, SMALL["hidden"]), dtype=torch.bfloat16, device="cuda")

    def step():
        _stage(buf, x, ids, w)
        run_into(y)

    def run_into(out):
        out.copy_(run(buf, weights, x))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # eager warm-up: the dense weight cache is built here
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (2, 3):
        x.copy_(tokens(t, SMALL["hidden"], seed=seed).cuda())
        new_ids, new_w = routing(t, SMALL["num_experts"], SMALL["num_topk"], seed=seed)
        ids.copy_(new_ids.cuda())
        w.copy_(new_w.cuda())
        graph.replay()
        torch.cuda.synchronize()
        replayed = y.clone()
        step()
        assert torch.equal(replayed.view(torch.int16), y.view(torch.int16))
        assert replayed.float().abs().max() > 0
