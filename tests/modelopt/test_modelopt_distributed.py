"""ModelOpt's max_calibrate and moewire's calibration of the same quantizers over a real gloo
EP group: the same amax on every rank."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest

from spawn_ranks import run_ranks

pytestmark = pytest.mark.modelopt
# Not "modelopt": pytest puts tests/ on sys.path, where tests/modelopt/ would pass for it.
pytest.importorskip("modelopt.torch.quantization")

TIMEOUT_S = 300
E, K, H, INTER, TMAX = 8, 2, 512, 512, 16


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    try:
        import modelopt.torch.quantization as mtq
        import torch
        import torch.distributed as dist
        from torch import nn

        from moewire.integrations import modelopt as mw_mo
        from moewire.megamoe.api import calibrate
        from moewire.quantizer import calibration
        from moewire.reference import MegaMoEExperts, forward_context

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        mw_mo.register(vllm=False)

        class Layer(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.experts = MegaMoEExperts(
                    num_experts=E, top_k=K, hidden=H, intermediate=INTER, max_num_tokens=TMAX,
                    group=dist.group.WORLD, seed=0, device="cpu",
                )

            def forward(self, x, w, ids):
                return self.experts(x, w, ids)

        model = Layer()
        buf = model.experts.get_symm_buffer()
        idle = rank == world - 1  # routes nothing: every token of this rank is padding
        local = {"dispatch": 0.0, "combine": 0.0}

        def loop(m):
            for step in range(2):
                g = torch.Generator().manual_seed(100 * rank + step)
                x = (torch.randn(12, H, generator=g) * (1 + rank)).to(torch.bfloat16)
                w, ids = torch.randn(12, E, generator=g).softmax(-1).topk(K)
                pad = torch.zeros(12, dtype=torch.bool)
                pad[:3] = True
                if idle:
                    pad[:] = True
                x[pad] = 50.0  # padding tokens must not reach the dispatch amax
                with forward_context(is_padding=pad):
                    m(x, w.float(), ids)
                # Oracle from the raw buffer (layout/mega_moe.cuh: base, slot-major rows).
                tmax = buf.num_max_tokens_per_rank
                flat = buf.buffer
                rows = flat[flat.numel() - K * tmax * H * 2:].view(torch.bfloat16)
                rows = rows.view(K, tmax, H)[:, :12].float()
                valid = buf.topk_idx[:12] >= 0
                for s in range(K):
                    if valid[:, s].any():
                        local["combine"] = max(
                            local["combine"], float(rows[s][valid[:, s]].abs().max())
                        )
                routed = valid.any(dim=1)
                if routed.any():
                    local["dispatch"] = max(
                        local["dispatch"], float(x[routed].float().abs().max())
                    )

        nvfp4 = {"num_bits": (2, 1),
                 "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
        cfg = {
            "quant_cfg": [
                {"quantizer_name": "*", "enable": False},
                {"quantizer_name": "*dispatch_quantizer", "cfg": {"num_bits": (4, 3)}},
                {"quantizer_name": "*combine_quantizer", "cfg": nvfp4},
            ],
            "algorithm": "max",
        }
        mtq.quantize(model, cfg, loop)
        result = {
            "idle": idle,
            "local": local,
            "dispatch": float(model.experts.dispatch_quantizer.amax),
            "combine": float(model.experts.combine_quantizer.amax),
            "ep_group_used": model.experts.parallel_state.expert_model_parallel_group
            .is_initialized(),
        }
        # moewire's calibration of the same WireTensorQuantizers: collect, EP sync, load.
        calibrate(model, loop)
        result["moewire"] = {
            "dispatch": float(model.experts.dispatch_quantizer.static_amax),
            "combine": float(model.experts.combine_quantizer.static_amax),
        }
        # One that collected nothing on the idle rank gets the group's max, nobody hangs.
        lone = mw_mo.WireTensorQuantizer(mw_mo.QuantizerAttributeConfig(num_bits=(4, 3)))
        with calibration([(lone, (dist.group.WORLD,))]):
            if not idle:
                lone.collect(torch.full((2, 4), float(rank + 1)))
        result["lone"] = float(lone.static_amax)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.mark.slow
def test_max_calibrate_reduces_amax_over_the_ep_group(tmp_path):
    world = 2
    results = run_ranks(_worker, world, tmp_path, TIMEOUT_S)
    assert all(r["ep_group_used"] for r in results)
    assert results[-1]["idle"] and results[-1]["local"]["dispatch"] == 0.0
    for key in ("dispatch", "combine"):
        want = max(r["local"][key] for r in results)
        assert want > 0
        assert {r[key] for r in results} == {want}, (key, results)
        assert {r["moewire"][key] for r in results} == {want}, (key, results)
    assert {r["lone"] for r in results} == {float(world - 1)}, results
