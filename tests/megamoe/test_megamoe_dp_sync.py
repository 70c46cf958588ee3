"""``calibrate(..., extra_groups=(dp_group,))``: amax max-reduced over a DP group too."""

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
        import torch
        import torch.distributed as dist
        from mm_helpers import SHAPES, Model, batch

        from moewire.megamoe.api import calibrate, quantize

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        hidden = SHAPES["bf16xbf16"][0]
        recipe = [{"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "fp8"}},
                  {"quantizer_name": "*combine_quantizer", "cfg": {"format": "nvfp4"}}]

        def loop(m):
            # Each DP rank has the whole experts (no EP group) and its own data scale.
            x, w, ids = batch(12, hidden, seed=7 + rank, scale=1.0 + 3 * rank)
            m.layers[0].experts(x, w, ids)

        result = {}
        for key, groups in (("local", ()), ("synced", (dist.group.WORLD,))):
            model = quantize(Model(n=1, group=None), recipe)
            calibrate(model, loop, extra_groups=(None, *groups))
            experts = model.layers[0].experts
            result[key] = [float(experts.dispatch_quantizer.amax),
                           float(experts.combine_quantizer.amax)]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.mark.slow
def test_extra_groups_max_reduce_over_data_parallel_ranks(tmp_path):
    results = run_ranks(_worker, 2, tmp_path, TIMEOUT_S)
    local = [r["local"] for r in results]
    assert local[0] != local[1]  # the ranks saw different data
    want = [max(a, b) for a, b in zip(*local, strict=True)]
    assert [r["synced"] for r in results] == [want, want]
