"""Expert parallelism over real gloo process groups (2 and 4 spawned ranks).

Each rank owns ``E / R`` experts, stages its own tokens (counts differ per rank, one rank
has none), and the rows of its tokens come back into its own combine region. Checked per
rank: the re-sum of the combine rows equals ``y`` bit for bit, rows of masked slots stay
stale (a NaN poison survives), and ``y`` matches a one-rank run of the same tokens with all
experts (the rows are the same math; only the FP32 accumulation order of a matmul may
differ with the batch an expert sees, so agreement is asserted to one BF16 ulp per token).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import reference_oracle as O
import torch
import torch.distributed as dist
from reference_cases import SMALL, cached_weights, routing, run_kernel, tokens

from moewire.reference import MegaMoEExperts, deep_gemm, make_weights, stage_mega_moe_inputs
from spawn_ranks import run_torch_ranks

TIMEOUT_S = 240
CONFIGS = {
    2: [
        {"flavour": "vllm-0.32", "shared": 0, "mma": "fp8xfp4", "tokens": [21, 0]},
        {"flavour": "vllm-0.32", "shared": 1, "mma": "fp8xfp4", "tokens": [17, 30]},
        {"flavour": "vllm-0.33", "shared": 0, "mma": "bf16xbf16", "tokens": [12, 9]},
    ],
    4: [
        {"flavour": "vllm-0.33", "shared": 1, "mma": "fp8xfp4", "tokens": [13, 0, 26, 5]},
        {"flavour": "deepgemm-sm90", "shared": 0, "mma": "fp8xfp4", "tokens": [0, 11, 4, 19]},
    ],
}


def _poison(buf) -> None:
    base = O.combine_base(buf)
    nbytes = buf.num_slots * buf.num_max_tokens_per_rank * buf.hidden * 2
    buf.buffer[base : base + nbytes].view(torch.int16).fill_(0x7FC1)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    results = []
    e_local = SMALL["num_experts"] // world
    for n, cfg in enumerate(CONFIGS[world]):
        t = cfg["tokens"][rank]
        with deep_gemm.use_flavour(cfg["flavour"]):
            buf = deep_gemm.get_symm_buffer_for_mega_moe(
                dist.group.WORLD, SMALL["num_experts"], 40, SMALL["num_topk"], SMALL["hidden"],
                SMALL["intermediate"], num_shared_experts=cfg["shared"], mma_type=cfg["mma"],
                device="cpu",
            )
        weights = make_weights(
            SMALL["num_experts"], SMALL["hidden"], SMALL["intermediate"],
            experts=range(rank * e_local, (rank + 1) * e_local), mma_type=cfg["mma"],
            num_shared_experts=cfg["shared"], seed=n,
        )
        x = tokens(t, SMALL["hidden"], seed=100 * n + rank)
        ids, w = routing(t, SMALL["num_experts"], SMALL["num_topk"], seed=100 * n + rank)
        _poison(buf)
        stage_mega_moe_inputs(x, ids, w, buf)
        y = run_kernel(buf, weights, t)
        rows = O.combine_rows(buf)
        stale_ok = all(
            np.array_equal(~np.isnan(rows[s, :t]).any(axis=1), ids[:, s].numpy() >= 0)
            for s in range(SMALL["num_topk"])
        )
        results.append({
            "x": x, "ids": ids, "w": w, "y": y,
            "resum_equal": np.array_equal(
                O.resum(buf, ids.numpy(), t), O.np_bytes(y).view(np.uint16)
            ),
            "stale_ok": stale_ok,
            "nan_in_y": bool(torch.isnan(y).any()),
        })
    if world == 2:
        # The experts module over the group: its own experts, the shared buffer, same rows.
        layer = MegaMoEExperts(
            SMALL["num_experts"], SMALL["num_topk"], SMALL["hidden"], SMALL["intermediate"], 24,
            group=dist.group.WORLD, device="cpu", seed=5,
        )
        t = [7, 15][rank]
        ids, w = routing(t, SMALL["num_experts"], SMALL["num_topk"], seed=300 + rank)
        y = layer(tokens(t, SMALL["hidden"], seed=300 + rank), w, ids)
        buf = layer.get_symm_buffer()
        results.append({
            "layer_ok": layer.local_experts == tuple(range(rank * e_local, (rank + 1) * e_local))
            and buf.num_ranks == 2 and buf.rank == rank
            and np.array_equal(O.resum(buf, ids.numpy(), t), O.np_bytes(y).view(np.uint16)),
        })
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(world: int, tmp_path) -> list:
    return run_torch_ranks(_worker, world, tmp_path, TIMEOUT_S)


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_expert_parallel_rows_resum_and_match_one_rank(world, tmp_path):
    per_rank = _spawn(world, tmp_path)
    if world == 2:
        assert all(results.pop()["layer_ok"] for results in per_rank)
    for n, cfg in enumerate(CONFIGS[world]):
        with deep_gemm.use_flavour(cfg["flavour"]):
            buf = deep_gemm.get_symm_buffer_for_mega_moe(
                None, SMALL["num_experts"], 40, SMALL["num_topk"], SMALL["hidden"],
                SMALL["intermediate"], num_shared_experts=cfg["shared"], mma_type=cfg["mma"],
                device="cpu",
            )
        weights = cached_weights(
            SMALL["num_experts"], SMALL["hidden"], SMALL["intermediate"], mma_type=cfg["mma"],
            num_shared_experts=cfg["shared"], seed=n,
        )
        for rank in range(world):
            got = per_rank[rank][n]
            label = f"{cfg} rank {rank}"
            assert got["resum_equal"] and got["stale_ok"] and not got["nan_in_y"], label
            t = cfg["tokens"][rank]
            assert got["y"].shape == (t, SMALL["hidden"])
            if t == 0:
                continue
            stage_mega_moe_inputs(got["x"], got["ids"], got["w"], buf)
            ref = O.bf16_values(run_kernel(buf, weights, t))
            err = np.linalg.norm(O.bf16_values(got["y"]) - ref, axis=1)
            assert (err <= 2.0**-8 * np.linalg.norm(ref, axis=1)).all(), label
