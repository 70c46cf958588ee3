"""Calibration over a real gloo EP group in spawned processes: same amax on every rank."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import pytest

from spawn_ranks import run_ranks

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 240


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    try:
        sys.path.insert(0, str(HERE))
        import mm_oracles as oracles
        import numpy as np
        import torch
        import torch.distributed as dist
        from mm_helpers import SHAPES, Model, batch, region

        from moewire.megamoe.api import calibrate
        from moewire.megamoe.convert import convert
        from moewire.quantizer import WireQuantizer
        from moewire.reference import forward_context

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        group = dist.group.WORLD
        model = Model(n=1, group=group)
        experts = convert(model.layers[0].experts, "layers.0.experts")
        experts.combine_quantizer = WireQuantizer("nvfp4")
        experts.dispatch_quantizer = WireQuantizer("fp8")
        buf = experts.get_symm_buffer()
        hidden = SHAPES["bf16xbf16"][0]
        idle = rank == world - 1  # this rank routes nothing: all its tokens are padding
        local = {"combine": 0.0, "dispatch": 0.0}

        def loop(m):
            for step in range(2):
                x, w, ids = batch(12, hidden, seed=100 * rank + step, scale=1.0 + rank)
                pad = torch.zeros(12, dtype=torch.bool)
                pad[:3] = True
                if idle:
                    pad[:] = True
                x[pad] = 50.0  # padding tokens must not reach the dispatch amax
                region(buf).fill_(1e4)  # stale rows must not reach the combine amax
                with forward_context(is_padding=pad):
                    m(x, w, ids)
                topk = buf.topk_idx[:12].numpy()
                rows = oracles.to_np(region(buf))
                for s in range(topk.shape[1]):
                    for t in np.nonzero(topk[:, s] >= 0)[0]:
                        local["combine"] = max(local["combine"], float(np.abs(rows[s, t]).max()))
                routed = (topk >= 0).any(axis=1)
                if routed.any():
                    xs = oracles.to_np(x)[routed]
                    local["dispatch"] = max(local["dispatch"], float(np.abs(xs).max()))

        calibrate(model, loop)
        result = {
            "idle": idle,
            "local": local,
            "combine": float(experts.combine_quantizer.static_amax),
            "dispatch": float(experts.dispatch_quantizer.static_amax),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "4-ranks"])
def test_calibration_syncs_amax_over_the_ep_group(world, tmp_path):
    results = run_ranks(_worker, world, tmp_path, TIMEOUT_S)
    assert results[-1]["idle"] and results[-1]["local"]["dispatch"] == 0.0
    for key in ("combine", "dispatch"):
        want = max(r["local"][key] for r in results)
        assert want > 0
        assert {r[key] for r in results} == {want}, (key, results)
