"""vLLM 0.32's fused shared expert (DeepSeek-V4) through vLLM's own code, on the stand-in build
0.32 bundles (``vllm-0.32``: the shared row stored at slot ``k`` and added last).

Real vLLM code that runs: ``DeepseekV4MLP.__init__`` under DeepSeek-V4's block-FP8 config
(``DeepseekV4FP8Config``, UE8M0 scales), its linear layers' weight loaders;
``DeepseekV4MegaMoEExperts.__init__(num_shared_experts=1)`` and ``finalize_weights(shared)``
with the SM100 backend's ``supports_shared_experts`` (read on the stand-in's signatures),
``transform_shared_expert_weights`` and ``_prepare_shared_expert_scale`` (128x128 block scales
to 1x32, ``transform_sf_into_required_layout``, ``transform_weights_for_mega_moe``, the
loader parameter re-homed on the transformed storage); the forward, which reads
``get_block_m_for_mega_moe`` and stages the shared expert's scales into
``shared_l1_acts_sf``; ``run_mega_moe`` calling ``fp8_fp4_mega_moe`` with the shared weights.

What cannot run on CPU, and is replaced only for building the shared MLP:

- ``Fp8LinearMethod.create_weights`` ends with ``init_fp8_linear_kernel``, which finds no
  scaled-mm kernel on a CPU without AMX tiles ("CPUFp8W8A8BlockScaledMMKernel requires AMX
  tile support (Sapphire Rapids or newer)"). That kernel would run the shared MLP's own
  GEMM, which a fused layer never calls, so it is replaced by ``None``.
- ``Fp8LinearMethod.__init__`` reads ``model_config.dtype``; the minimal test config has no
  model config (building one needs a Hugging Face checkpoint), so one with ``dtype`` BF16
  and DeepSeek-V4-Flash's ``expert_dtype="fp4"`` (UE8M0 linear scales) stands in.
- ``Fp8LinearMethod.process_weights_after_loading`` (the same missing kernel) is not run:
  the scales stay the checkpoint's ``float8_e8m0fnu`` block scales, the unpacked branch of
  ``_prepare_shared_expert_scale`` (on an SM100 GPU DeepGEMM's linear hook packs them into
  int32 first, the other branch).
"""

from __future__ import annotations

import types

import _standin as standin
import _vllm_world as setup
import pytest
import torch
from _vllm_world import INTER, E, H, K

pytestmark = pytest.mark.vllm

vllm_mod = pytest.importorskip("moewire.integrations.vllm")
api = pytest.importorskip("moewire.megamoe.api")
formats = pytest.importorskip("moewire.formats")

LAYER = 300  # layer numbers unique to this file (vLLM refuses duplicate layer names)
BLOCK = 128


def _checkpoint(seed: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 weights ``[rows, cols]`` and UE8M0 128x128 block scales (exponents 120..123)."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=g) * 8).to(torch.float8_e4m3fn)
    exponents = torch.randint(120, 124, (rows // BLOCK, cols // BLOCK), generator=g)
    return weight, exponents.to(torch.uint8).view(torch.float8_e8m0fnu)


def _shared_mlp(config, prefix: str, seed: int, monkeypatch) -> tuple[torch.nn.Module, dict]:
    """vLLM's ``DeepseekV4MLP`` with block-FP8 checkpoint weights loaded by its own loaders."""
    from vllm.model_executor.layers.quantization import fp8
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4MLP
    from vllm.models.deepseek_v4.quant_config import DeepseekV4FP8Config

    model_config = types.SimpleNamespace(
        dtype=torch.bfloat16, hf_config=types.SimpleNamespace(expert_dtype="fp4")
    )
    with monkeypatch.context() as m:
        m.setattr(config, "model_config", model_config)
        m.setattr(fp8, "init_fp8_linear_kernel", lambda **kwargs: None)
        quant_config = DeepseekV4FP8Config(weight_block_size=[BLOCK, BLOCK])
        assert quant_config.is_scale_e8m0
        mlp = DeepseekV4MLP(
            H, INTER, "silu", swiglu_limit=10.0, quant_config=quant_config,
            is_sequence_parallel=True, prefix=prefix,
        )
    ckpt = {
        "w1": _checkpoint(seed, INTER, H),
        "w3": _checkpoint(seed + 1, INTER, H),
        "w2": _checkpoint(seed + 2, H, INTER),
    }
    # As DeepseekV4Model.load_weights: w1/w3 stacked into gate_up_proj (shards 0, 1).
    for shard_id, name in enumerate(("w1", "w3")):
        for param, data in zip(("weight", "weight_scale_inv"), ckpt[name], strict=True):
            p = getattr(mlp.gate_up_proj, param)
            p.weight_loader(p, data, shard_id)
    for param, data in zip(("weight", "weight_scale_inv"), ckpt["w2"], strict=True):
        p = getattr(mlp.down_proj, param)
        p.weight_loader(p, data)
    assert mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert mlp.gate_up_proj.weight_scale_inv.dtype == torch.float8_e8m0fnu
    return mlp, ckpt


def _expected_shared_weights(ckpt: dict, reference) -> tuple:
    """The fused shared weights from the checkpoint, independently of vLLM: 128x128 block
    scales repeated to one per 32 along K and per row, packed four per int32, transformed."""

    def per_row_1x32(scale: torch.Tensor) -> torch.Tensor:
        exponents = scale.view(torch.uint8).repeat_interleave(BLOCK, 0)
        return exponents.repeat_interleave(BLOCK // 32, 1).contiguous().view(torch.int32)

    gate_up = torch.cat([ckpt["w1"][0], ckpt["w3"][0]])
    gate_up_sf = torch.cat([per_row_1x32(ckpt["w1"][1]), per_row_1x32(ckpt["w3"][1])])
    down, down_sf = ckpt["w2"][0], per_row_1x32(ckpt["w2"][1])
    return reference.transform_weights_for_mega_moe((gate_up, gate_up_sf), (down, down_sf))


def _forward(config, experts, x, ids, w, pad):
    from vllm.forward_context import create_forward_context, override_forward_context

    with override_forward_context(create_forward_context(None, config, is_padding=pad)):
        return experts(x, w, ids, activation_clamp=10.0)


def test_032_fused_shared_combine_on_order_visible_rows(vllm_config, monkeypatch):
    """Combine-only (mxfp8) on vLLM 0.32's real fused shared expert: bit-exact to the
    re-sum with the shared row added last, on rows whose FP32 sum order shows after the
    BF16 rounding; the same buffer read as vllm-0.33 (shared row first) fails the layout
    check."""
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4MegaMoEExperts

    from moewire.megamoe import layout_check
    from moewire.reference.nvfp4.mega_moe import shared_sf_row

    vllm_mod.register_vllm_experts()
    # vLLM caches buffers per shape across layers: this test's buffer is its own.
    monkeypatch.setattr(DeepseekV4MegaMoEExperts, "_symm_buffer_cache", {})
    prefix = f"model.layers.{LAYER}.ffn"
    shared, ckpt = _shared_mlp(vllm_config, f"{prefix}.shared_experts", 31, monkeypatch)
    experts = setup.make_experts(
        vllm_config, seed=32, prefix=f"{prefix}.experts", num_shared_experts=1
    )
    x, ids, w = setup.routing(6, seed=33)
    pad = torch.zeros(6, dtype=torch.bool)
    pad[3] = True
    ids[0] = torch.arange(K)
    with standin.use_reference_deep_gemm("vllm-0.32") as reference:
        # DeepseekV4MoE.finalize_mega_moe_weights: the real fusing of the shared weights.
        experts.finalize_weights(shared)
        assert experts.has_fused_shared_experts and experts.num_shared_experts == 1
        (l1, l1_sf), (l2, l2_sf) = _expected_shared_weights(ckpt, reference)
        (got_l1, got_l1_sf), (got_l2, got_l2_sf) = (
            experts._transformed_shared_l1_weights, experts._transformed_shared_l2_weights
        )
        for got, want in ((got_l1, l1), (got_l1_sf, l1_sf), (got_l2, l2), (got_l2_sf, l2_sf)):
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8),
                                                           want.view(torch.uint8))
        # vLLM re-homes the loader parameter on the transformed L1 storage.
        assert shared.gate_up_proj.weight.data_ptr() == got_l1.data_ptr()

        model = torch.nn.ModuleDict({"experts": experts})
        api.quantize(model, "moe_combine_mxfp8")
        # After finalize_weights: vLLM reads the kernel's signature to decide on fusion.
        monkeypatch.setattr(
            reference, "fp8_fp4_mega_moe",
            setup.order_visible_kernel(reference.fp8_fp4_mega_moe, K),
        )
        assert vllm_mod.kernel_flavour(experts) == "vllm-0.32"
        y = _forward(vllm_config, experts, x, ids, w, pad)
        buffer = experts.get_symm_buffer()
        assert buffer._moewire_flavour == "vllm-0.32" and buffer.num_shared_experts == 1
        # vLLM staged the shared expert's scales at the rows of the call's BLOCK_M.
        block_m = reference.get_block_m_for_mega_moe(
            1, E, buffer.num_max_tokens_per_rank, 6, K, "fp8xfp4"
        )
        staged = buffer.shared_l1_acts_sf[shared_sf_row(torch.arange(6), block_m)]
        assert torch.equal(staged, buffer.x_sf[:6])

        mxfp8 = formats.get("mxfp8")
        rows = setup.oracle_rows(buffer, K + 1, "vllm-0.32")[:, :6]
        quantized = torch.stack([mxfp8.reference(r, None) for r in rows[:K]] + [rows[K]])
        expected = setup.oracle_resum(quantized, buffer.topk_idx, 6, shared="last")
        assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
        assert y[0, 0].item() == 0.0
        # The padding token gets the shared row only.
        assert torch.equal(y[3].view(torch.int16), rows[K, 3].view(torch.int16))
        wrong = setup.oracle_resum(quantized, buffer.topk_idx, 6, shared="first")
        assert not torch.equal(wrong.view(torch.int16), expected.view(torch.int16))

        # The same buffer read with the wrong shared position: vllm-0.33 reads the combine
        # region at the same place here, so only the order differs.
        from moewire.megamoe.layout import combine_rows

        same_base = [
            combine_rows(buffer, f, "fp8_fp4_mega_moe", fused_shared=True).data_ptr()
            for f in ("vllm-0.32", "vllm-0.33")
        ]
        assert same_base[0] == same_base[1]
        layout_check.reset_layout_checks()
        monkeypatch.setenv("MOEWIRE_FLAVOUR", "vllm-0.33")
        with pytest.raises(
            RuntimeError, match=r"flavour 'vllm-0\.33'.*added first\) does not reproduce"
        ):
            _forward(vllm_config, experts, x, ids, w, pad)
        assert experts.get_symm_buffer() is buffer
