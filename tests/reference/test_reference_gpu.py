"""The same kernel on CUDA (skipped without it): equal to the CPU run, rows re-sum to y."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest
import reference_oracle as O
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from reference_cases import SMALL, build, routing, run_kernel, tokens

from moewire.reference import MegaMoEExperts, deep_gemm, make_weights, stage_mega_moe_inputs

pytestmark = pytest.mark.gpu


def _to(weights, device):
    def move(w):
        if w is None:
            return None
        return tuple(t.to(device) for t in w) if isinstance(w, tuple) else w.to(device)

    return dataclasses.replace(
        weights, **{f: move(getattr(weights, f)) for f in
                    ("l1", "l2", "l1_raw", "l2_raw", "shared_l1", "shared_l2",
                     "shared_l1_raw", "shared_l2_raw")}
    )


@pytest.mark.parametrize(
    "flavour,shared,mma",
    [("deepgemm-main", 0, "fp8xfp4"), ("vllm-0.32", 1, "fp8xfp4"), ("vllm-0.32", 1, "bf16xbf16"),
     ("vllm-0.33", 1, "fp8xfp4"), ("vllm-0.33", 1, "bf16xbf16"), ("deepgemm-sm90", 0, "fp8xfp4")],
    ids=["main", "0.32-shared-fp8", "0.32-shared-bf16", "0.33-shared-fp8", "0.33-shared-bf16",
         "sm90"],
)
def test_cuda_matches_cpu_and_resums_bit_for_bit(flavour, shared, mma):
    cpu = build(flavour=flavour, shared=shared, mma=mma, t=33, seed=21)
    with deep_gemm.use_flavour(flavour):
        buf = deep_gemm.get_symm_buffer_for_mega_moe(
            None, SMALL["num_experts"], 33, SMALL["num_topk"], SMALL["hidden"],
            SMALL["intermediate"], num_shared_experts=shared, mma_type=mma, device="cuda",
        )
    weights = _to(cpu.weights, "cuda")
    stage_mega_moe_inputs(cpu.x.cuda(), cpu.topk_idx.cuda(), cpu.topk_weights.cuda(), buf)
    assert torch.equal(buf.x[:33].cpu().view(torch.uint8), cpu.buf.x[:33].view(torch.uint8))
    y = run_kernel(buf, weights, 33)
    assert y.is_cuda
    np.testing.assert_array_equal(
        O.resum(buf, cpu.topk_idx.numpy(), 33), O.np_bytes(y).view(np.uint16)
    )
    ref = O.bf16_values(cpu.y)
    err = np.linalg.norm(O.bf16_values(y) - ref, axis=1)
    assert (err <= 2.0**-8 * np.linalg.norm(ref, axis=1)).all()


def test_cuda_kernel_refuses_cpu_weights():
    case = build(t=4, run=False, num_topk=2)
    buf = deep_gemm.get_symm_buffer_for_mega_moe(None, 8, 4, 2, 512, 512, device="cuda")
    y = torch.empty((4, 512), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=r"l1_weights\[0\] is on cpu but the symm buffer is on"):
        deep_gemm.fp8_fp4_mega_moe(y, case.weights.l1, case.weights.l2, buf)


def test_experts_module_on_cuda_by_default():
    layer = MegaMoEExperts(8, 2, 512, 512, 16, seed=2)
    x = tokens(10, 512, 3).cuda()
    ids, w = routing(10, 8, 2, 3)
    y = layer(x, w.cuda(), ids.cuda())
    assert y.is_cuda and layer.get_symm_buffer().buffer.is_cuda
    np.testing.assert_array_equal(
        O.resum(layer.get_symm_buffer(), ids.numpy(), 10), O.np_bytes(y).view(np.uint16)
    )


def _nccl_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    e_local = SMALL["num_experts"] // world
    t = [19, 0][rank]
    buf = deep_gemm.get_symm_buffer_for_mega_moe(
        dist.group.WORLD, SMALL["num_experts"], 24, SMALL["num_topk"], SMALL["hidden"],
        SMALL["intermediate"], num_shared_experts=1,
    )
    weights = make_weights(
        SMALL["num_experts"], SMALL["hidden"], SMALL["intermediate"],
        experts=range(rank * e_local, (rank + 1) * e_local), num_shared_experts=1, seed=4,
        device="cuda",
    )
    x = tokens(t, SMALL["hidden"], seed=50 + rank)
    ids, w = routing(t, SMALL["num_experts"], SMALL["num_topk"], seed=50 + rank)
    stage_mega_moe_inputs(x.cuda(), ids.cuda(), w.cuda(), buf)
    y = run_kernel(buf, weights, t)
    ok = np.array_equal(O.resum(buf, ids.numpy(), t), O.np_bytes(y).view(np.uint16))
    torch.save({"x": x, "ids": ids, "w": w, "y": y.cpu(), "ok": ok},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_nccl_two_ranks(tmp_path):
    context = mp.start_processes(_nccl_worker, args=(2, str(tmp_path / "init"), str(tmp_path)),
                                 nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 300
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail("2-rank NCCL run did not finish within 300 s")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert got[0]["ok"] and got[1]["ok"] and got[1]["y"].shape == (0, SMALL["hidden"])
    ref = build(t=19, shared=1, seed=50, weights_seed=4, run=False)
    stage_mega_moe_inputs(got[0]["x"], got[0]["ids"], got[0]["w"], ref.buf)
    y_ref = O.bf16_values(run_kernel(ref.buf, ref.weights, 19))
    err = np.linalg.norm(O.bf16_values(got[0]["y"]) - y_ref, axis=1)
    assert (err <= 2.0**-8 * np.linalg.norm(y_ref, axis=1)).all()


def test_one_rank_kernel_replays_in_a_cuda_graph():
    """With cached weights the one-rank path has static shapes and no host sync."""
    case = build(t=16, seed=31, run=False)
    buf = deep_gemm.get_symm_buffer_for_mega_moe(None, 8, 16, 3, 512, 512, device="cuda")
    weights = _to(case.weights, "cuda")
    x, ids, w = case.x.cuda(), case.topk_idx.cuda(), case.topk_weights.cuda()
    stage_mega_moe_inputs(x, ids, w, buf)
    y = torch.empty((16, 512), dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        deep_gemm.fp8_fp4_mega_moe(y, weights.l1, weights.l2, buf)  # fills the weight cache
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        deep_gemm.fp8_fp4_mega_moe(y, weights.l1, weights.l2, buf)
    new_ids, new_w = routing(16, 8, 3, seed=32)
    stage_mega_moe_inputs(tokens(16, 512, 32).cuda(), new_ids.cuda(), new_w.cuda(), buf)
    graph.replay()
    torch.cuda.synchronize()
    replayed = y.clone()
    eager = run_kernel(buf, weights, 16)
    assert torch.equal(replayed, eager)
    bits = O.np_bytes(eager).view(np.uint16)
    np.testing.assert_array_equal(O.resum(buf, new_ids.numpy(), 16), bits)
