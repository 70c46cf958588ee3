"""moewire.quantize on vLLM 0.32's real DeepseekV4MegaMoEExperts: calibrate, then quantize.

Oracles as in the core tests: the dispatch payload equals vLLM's staging of the tokens
quantized by the format's reference; the kernel output equals an independent FP32 re-sum
of the reference-quantized combine rows; padding rows never enter an amax.
"""

from __future__ import annotations

import itertools
import os
import tempfile

import _standin as standin
import _vllm_world as setup
import pytest
import torch
import torch.multiprocessing as mp
from _vllm_world import H, K

pytestmark = pytest.mark.vllm

vllm_mod = pytest.importorskip("moewire.integrations.vllm")
api = pytest.importorskip("moewire.megamoe.api")
formats = pytest.importorskip("moewire.formats")

RECIPE = "moe_fp8_dispatch_nvfp4_combine"
_layers = itertools.count(100)


def _prefix() -> str:
    # vLLM refuses a duplicate layer name in the static forward context.
    return f"model.layers.{next(_layers)}.ffn.experts"


def _forward(config, experts, x, ids, w, pad):
    from vllm.forward_context import create_forward_context, override_forward_context

    with override_forward_context(create_forward_context(None, config, is_padding=pad)):
        return experts(x, w, ids, activation_clamp=10.0)


def _batch(seed: int, num_tokens: int = 8):
    x, ids, w = setup.routing(num_tokens, seed)
    pad = torch.zeros(num_tokens, dtype=torch.bool)
    pad[[1, num_tokens - 1]] = True
    # Padding rows far above the rest: an amax that saw them would show it.
    x = torch.where(pad[:, None], x * 1000, x)
    return x, ids, w, pad


def _calibrate(config, experts, seeds):
    """Calibrate through moewire.quantize; return the oracle amaxes over valid data only."""
    seen = {"dispatch": torch.zeros(()), "combine": torch.zeros(())}

    def loop(model):
        for seed in seeds:
            x, ids, w, pad = _batch(seed)
            _forward(config, model["experts"], x, ids, w, pad)
            buffer = experts.get_symm_buffer()
            rows = setup.oracle_rows(buffer, K)[:, : x.shape[0]].float()
            valid = (buffer.topk_idx[: x.shape[0]] >= 0).T[..., None]
            combine = torch.where(valid, rows.abs(), 0).amax()
            dispatch = x[~pad].float().abs().amax()
            seen["dispatch"] = torch.maximum(seen["dispatch"], dispatch)
            seen["combine"] = torch.maximum(seen["combine"], combine)

    model = torch.nn.ModuleDict({"experts": experts})
    api.quantize(model, RECIPE, forward_loop=loop)
    return model, seen


def _oracle_y(buffer, num_tokens: int, amax: torch.Tensor) -> torch.Tensor:
    nvfp4 = formats.get("nvfp4")
    rows = setup.oracle_rows(buffer, K)[:, :num_tokens]
    quantized = torch.stack([nvfp4.reference(rows[s], amax) for s in range(K)])
    return setup.oracle_resum(quantized, buffer.topk_idx, num_tokens)


def _check_quantized_forward(config, experts, seen, seed: int):
    x, ids, w, pad = _batch(seed)
    y = _forward(config, experts, x, ids, w, pad)
    buffer = experts.get_symm_buffer()
    t = x.shape[0]
    amax_d, amax_c = experts.dispatch_quantizer.amax, experts.combine_quantizer.amax
    # Dispatch: the staged payload is vLLM's staging of the quantized tokens.
    xq = formats.get("fp8").reference(x, amax_d)
    x_fp8 = torch.empty(t, H, dtype=torch.float8_e4m3fn)
    x_sf = torch.empty(t, H // 128, dtype=torch.int32)
    idx, wo = torch.empty(t, K, dtype=torch.int64), torch.empty(t, K)
    standin.prepare_megamoe_inputs_reference(xq, w, ids, x_fp8, x_sf, idx, wo, is_padding=pad)
    assert torch.equal(buffer.x[:t].view(torch.uint8), x_fp8.view(torch.uint8))
    assert torch.equal(buffer.x_sf[:t], x_sf)
    assert torch.equal(buffer.topk_idx[:t], idx)
    # Combine: the output is the re-sum of the reference-quantized valid rows.
    expected = _oracle_y(buffer, t, amax_c)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(y[pad], torch.zeros_like(y[pad]))
    # The quantization did something: the unquantized re-sum differs.
    plain = setup.oracle_resum(setup.oracle_rows(buffer, K), buffer.topk_idx, t)
    assert not torch.equal(y, plain)
    return amax_d, amax_c


def test_calibrate_then_quantize_real_dsv4(vllm_config):
    vllm_mod.register_vllm_experts()
    with standin.use_reference_deep_gemm("vllm-0.32"):
        experts = setup.make_experts(vllm_config, prefix=_prefix())
        experts.finalize_weights()
        _, seen = _calibrate(vllm_config, experts, seeds=(31, 32, 33))
        amax_d, amax_c = _check_quantized_forward(vllm_config, experts, seen, seed=34)
    assert torch.equal(amax_d.float(), seen["dispatch"])
    assert torch.equal(amax_c.float(), seen["combine"])


def test_scales_round_trip_into_a_fresh_model(vllm_config, tmp_path):
    vllm_mod.register_vllm_experts()
    with standin.use_reference_deep_gemm("vllm-0.32"):
        experts = setup.make_experts(vllm_config, prefix=_prefix())
        experts.finalize_weights()
        model, seen = _calibrate(vllm_config, experts, seeds=(41,))
        path = tmp_path / "scales.pt"
        api.save_scales(model, path)
        fresh = setup.make_experts(vllm_config, prefix=_prefix())
        fresh.finalize_weights()
        served = torch.nn.ModuleDict({"experts": fresh})
        api.quantize(served, RECIPE)
        api.load_scales(served, path)
        _check_quantized_forward(vllm_config, fresh, seen, seed=42)
    assert torch.equal(fresh.combine_quantizer.amax, experts.combine_quantizer.amax)


def _two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    with setup.vllm_world(rank, 2, init_file) as config:
        vllm_mod.register_vllm_experts()
        with standin.use_reference_deep_gemm("vllm-0.32"):
            experts = setup.make_experts(config, rank=rank, world_size=2)
            experts.finalize_weights()
            # Different data per rank: the synced amax is the max of both ranks' amaxes.
            _, seen = _calibrate(config, experts, seeds=(60 + rank,))
            amax_d, amax_c = _check_quantized_forward(config, experts, seen, seed=70 + rank)
        torch.save(
            {"seen": seen, "amax": (amax_d, amax_c)}, os.path.join(out_dir, f"rank{rank}.pt")
        )


def test_two_rank_gloo_calibration_syncs_amax():
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "init")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_two_rank_worker, args=(r, init_file, out_dir)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        assert [p.exitcode for p in procs] == [0, 0]
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in (0, 1)]
    dispatch = torch.maximum(*(r["seen"]["dispatch"] for r in results))
    for r in results:
        assert torch.equal(r["amax"][0].float(), dispatch)
    # Each rank's combine amax covers rows of both ranks' experts; after the sync they agree.
    assert torch.equal(results[0]["amax"][1], results[1]["amax"][1])
    assert results[0]["seen"]["dispatch"] != results[1]["seen"]["dispatch"]


def test_unquantize_restores_vllm_twice_in_a_row(vllm_config):
    """Quantize and unquantize a real vLLM experts module twice in one process: each round
    quantizes the same way, and after each the class, the state dict and every vLLM global
    moewire rebound (``_import_deep_gemm``, the staging global) are vLLM's own again.

    Unquantized, vLLM's own staging is Triton and its DeepGEMM import finds none on CPU,
    so the unquantized forward is not run here; the stand-in core test
    (tests/megamoe/test_megamoe_unquantize.py) runs it bit for bit. Break: leave the
    bridge's rebinds out of the undo ledger: vLLM's globals stay moewire's.
    """
    import vllm.utils.deep_gemm as vllm_deep_gemm
    from vllm.models.deepseek_v4.nvidia import model as dsv4

    from moewire import patches
    from moewire.megamoe import convert

    # vLLM's static forward context keeps earlier tests' layers alive: undo them first.
    for module in list(convert._CONVERTED):
        convert.unconvert(module)
    assert patches.active_patches() == []
    originals = (vllm_deep_gemm._import_deep_gemm, dsv4.prepare_megamoe_inputs)
    experts, outputs = None, []
    for _ in range(2):
        vllm_mod.register_vllm_experts()
        with standin.use_reference_deep_gemm("vllm-0.32"):
            if experts is None:
                experts = setup.make_experts(vllm_config, prefix=_prefix())
                experts.finalize_weights()
                keys = set(experts.state_dict())
            model, _ = _calibrate(vllm_config, experts, seeds=(61,))
            x, ids, w, pad = _batch(62)
            outputs.append(_forward(vllm_config, experts, x, ids, w, pad).view(torch.int16))
        api.unquantize(model)
        assert type(experts) is dsv4.DeepseekV4MegaMoEExperts
        assert set(experts.state_dict()) == keys
        assert patches.active_patches() == []
        assert (vllm_deep_gemm._import_deep_gemm, dsv4.prepare_megamoe_inputs) == originals
    assert torch.equal(outputs[0], outputs[1])
