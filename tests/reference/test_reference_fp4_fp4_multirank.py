"""The stand-in NVFP4 x NVFP4 kernel over a real 2-rank gloo group.

Each rank owns ``E / 2`` experts (and their alphas), stages its own tokens (one rank has
none in the first config), and the router-weighted rows of its tokens come back into its
own combine region. Checked per rank: the oracle's combine of its rows equals its ``y`` bit
for bit, rows of masked slots stay stale (a NaN poison survives), and ``y`` matches a
one-rank run of the same tokens with all experts (same math; the FP32 accumulation order
of a matmul may differ with the batch an expert sees, so within one BF16 ulp per token).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from fp4_fp4_cases import SMALL, buffer, cached_weights, run
from fp4_fp4_oracle import combine, combine_rows
from reference_cases import routing, tokens
from reference_oracle import bf16_values, np_bytes

from moewire.reference.fp4_fp4.staging import prepare_megamoe_nvfp4_inputs
from moewire.reference.fp4_fp4.weights import make_fp4_fp4_weights
from spawn_ranks import run_torch_ranks

TIMEOUT_S = 240
CONFIGS = [
    {"shared": False, "rsf": 1.0, "tokens": [13, 0]},
    {"shared": True, "rsf": 2.5, "tokens": [9, 11]},
]


def _stage(buf, x, ids, w):
    t = x.shape[0]
    prepare_megamoe_nvfp4_inputs(x, w, ids, buf.x[:t], buf.x_sf[:t], buf.topk_idx[:t],
                                 buf.topk_weights[:t])


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    e_local = SMALL["num_experts"] // world
    results = []
    for n, cfg in enumerate(CONFIGS):
        t = cfg["tokens"][rank]
        buf = buffer(dist.group.WORLD, shared=cfg["shared"], tmax=20)
        weights = make_fp4_fp4_weights(
            SMALL["num_experts"], SMALL["hidden"], SMALL["intermediate"],
            experts=range(rank * e_local, (rank + 1) * e_local),
            num_shared_experts=int(cfg["shared"]), seed=5,
        )
        x = tokens(t, SMALL["hidden"], seed=100 * n + rank)
        ids, w = routing(t, SMALL["num_experts"], SMALL["num_topk"], seed=100 * n + rank)
        buf.combine_rows().view(torch.int16).fill_(0x7FC1)
        _stage(buf, x, ids, w)
        y = run(buf, weights, x, routed_scaling_factor=cfg["rsf"])
        rows = combine_rows(buf)
        stale_ok = all(
            np.array_equal(~np.isnan(rows[s, :t]).any(axis=1), ids[:, s].numpy() >= 0)
            for s in range(SMALL["num_topk"])
        )
        results.append({
            "x": x, "ids": ids, "w": w, "y": y, "stale_ok": stale_ok,
            "combine_equal": np.array_equal(
                combine(rows, ids.numpy(), t, cfg["shared"], cfg["rsf"]),
                np_bytes(y).view(np.uint16),
            ),
            "ranks": (buf.num_ranks, buf.rank, buf.num_experts_per_rank),
        })
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_rows_combine_and_match_one_rank(tmp_path):
    per_rank = run_torch_ranks(_worker, 2, tmp_path, TIMEOUT_S)
    for n, cfg in enumerate(CONFIGS):
        buf = buffer(shared=cfg["shared"], tmax=20)
        weights = cached_weights(SMALL["num_experts"], SMALL["hidden"], SMALL["intermediate"],
                                 num_shared_experts=int(cfg["shared"]), seed=5, device="cpu")
        for rank in range(2):
            got = per_rank[rank][n]
            label = f"{cfg} rank {rank}"
            assert got["ranks"] == (2, rank, SMALL["num_experts"] // 2), label
            assert got["combine_equal"] and got["stale_ok"], label
            if cfg["tokens"][rank] == 0:
                continue
            _stage(buf, got["x"], got["ids"], got["w"])
            ref = bf16_values(run(buf, weights, got["x"], routed_scaling_factor=cfg["rsf"]))
            err = np.linalg.norm(bf16_values(got["y"]) - ref, axis=1)
            assert (err <= 2.0**-7 * np.linalg.norm(ref, axis=1)).all(), label
            assert np.mean(bf16_values(got["y"]) == ref) > 0.99, label
