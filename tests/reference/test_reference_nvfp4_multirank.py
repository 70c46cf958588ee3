"""The stand-in NVFP4 kernel over a real 2-rank gloo group.

Each rank owns ``E / 2`` experts (and their alphas), stages its own tokens (one rank has
none in the first config), and the unweighted rows of its tokens come back into its own
combine region. Checked per rank: the exact FMA re-sum of its rows equals its ``y`` bit
for bit, rows of masked slots stay stale (a NaN poison survives), and ``y`` matches a
one-rank run of the same tokens with all experts (same math; the FP32 accumulation order
of a matmul may differ with the batch an expert sees, so within one BF16 ulp per token).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from nvfp4_cases import SHARED, SMALL, cached_weights, run, stage
from nvfp4_oracle import combine_base, combine_rows, resum
from reference_cases import routing, tokens
from reference_oracle import bf16_values, np_bytes

from moewire.reference import deep_gemm, make_nvfp4_weights
from spawn_ranks import run_torch_ranks

TIMEOUT_S = 240
CONFIGS = [
    {"shared": "routed", "tokens": [13, 0]},
    {"shared": "mxfp8", "tokens": [9, 11]},
]


def _buffer(group, shared: str):
    dtype = SHARED[shared]
    return deep_gemm.NVFP4SymmBuffer(
        group, SMALL["num_experts"], 20, SMALL["num_topk"], SMALL["hidden"],
        SMALL["intermediate"], num_shared_experts=0 if dtype is None else 1,
        shared_dtype=dtype or torch.float8_e4m3fn, device="cpu",
    )


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    e_local = SMALL["num_experts"] // world
    results = []
    for n, cfg in enumerate(CONFIGS):
        t = cfg["tokens"][rank]
        buf = _buffer(dist.group.WORLD, cfg["shared"])
        dtype = SHARED[cfg["shared"]]
        weights = make_nvfp4_weights(
            SMALL["num_experts"], SMALL["hidden"], SMALL["intermediate"],
            experts=range(rank * e_local, (rank + 1) * e_local),
            num_shared_experts=0 if dtype is None else 1,
            shared_dtype=dtype or torch.float8_e4m3fn, seed=1,
        )
        x = tokens(t, SMALL["hidden"], seed=100 * n + rank)
        ids, w = routing(t, SMALL["num_experts"], SMALL["num_topk"], seed=100 * n + rank)
        base = combine_base(buf)
        nbytes = buf.num_slots * buf.num_max_tokens_per_rank * buf.hidden * 2
        buf.buffer[base : base + nbytes].view(torch.int16).fill_(0x7FC1)
        l2_alpha = torch.empty(e_local, dtype=torch.float32)
        stage(buf, x, ids, w, weights, l2_alpha, 1.0, group_size=world)
        y = run(buf, weights, t, l2_alpha)
        rows = combine_rows(buf)
        stale_ok = all(
            np.array_equal(~np.isnan(rows[s, :t]).any(axis=1), ids[:, s].numpy() >= 0)
            for s in range(SMALL["num_topk"])
        )
        results.append({
            "x": x, "ids": ids, "w": w, "y": y, "stale_ok": stale_ok,
            "resum_equal": np.array_equal(
                resum(rows, ids.numpy(), w.numpy(), t, dtype is not None),
                np_bytes(y).view(np.uint16),
            ),
            "ranks": (buf.num_ranks, buf.rank, buf.num_experts_per_rank),
        })
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_rows_resum_and_match_one_rank(tmp_path):
    per_rank = run_torch_ranks(_worker, 2, tmp_path, TIMEOUT_S)
    for n, cfg in enumerate(CONFIGS):
        buf = _buffer(None, cfg["shared"])
        dtype = SHARED[cfg["shared"]]
        weights = cached_weights(
            SMALL["num_experts"], SMALL["hidden"], SMALL["intermediate"],
            num_shared_experts=0 if dtype is None else 1,
            shared_dtype=dtype or torch.float8_e4m3fn, seed=1,
        )
        for rank in range(2):
            got = per_rank[rank][n]
            label = f"{cfg} rank {rank}"
            assert got["ranks"] == (2, rank, SMALL["num_experts"] // 2), label
            assert got["resum_equal"] and got["stale_ok"], label
            t = cfg["tokens"][rank]
            if t == 0:
                continue
            l2_alpha = torch.empty(SMALL["num_experts"], dtype=torch.float32)
            # The one-rank buffer's shared scales use its own BLOCK_M; staging and kernel agree.
            stage(buf, got["x"], got["ids"], got["w"], weights, l2_alpha, 1.0)
            ref = bf16_values(run(buf, weights, t, l2_alpha))
            err = np.linalg.norm(bf16_values(got["y"]) - ref, axis=1)
            assert (err <= 2.0**-8 * np.linalg.norm(ref, axis=1)).all(), label
            assert np.mean(bf16_values(got["y"]) == ref) > 0.99, label
