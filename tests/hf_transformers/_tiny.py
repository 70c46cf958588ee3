"""Tiny random transformers MoE checkpoints, written with ``save_pretrained``.

Shapes are the smallest the stand-in kernel takes (``H`` and ``I`` multiples of 128 for
``bf16xbf16``, 512 for ``fp8xfp4``); 8 experts, top-2, 2 layers, a 256-token vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss")
VOCAB = 256


def config(family: str, hidden: int = 128, intermediate: int = 128, layers: int = 2):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  num_experts_per_tok=2, tie_word_embeddings=False)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            **common, intermediate_size=2 * intermediate, moe_intermediate_size=intermediate,
            n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
            first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=32, routed_scaling_factor=2.5, norm_topk_prob=True,
        )
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common, intermediate_size=2 * intermediate, moe_intermediate_size=intermediate,
            num_experts=8, head_dim=32, decoder_sparse_step=1, norm_topk_prob=True,
        )
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=intermediate, num_local_experts=8,
                                head_dim=32)
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, intermediate_size=intermediate, num_local_experts=8,
                               head_dim=32, sliding_window=64)
    raise ValueError(family)


def checkpoint(family: str, path: Path, seed: int = 0, **shape: int) -> Path:
    """A random BF16 checkpoint of ``family`` in ``path`` (weights from ``seed``)."""
    import transformers as tf

    with torch.random.fork_rng():  # the suite's global RNG stays as it was
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config(family, **shape))
        _randomize(model)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def _randomize(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Routers: visible preferences; the rest stays at the model's init.
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
            elif "experts" in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)


# -- DeepSeek-V4: an FP4 checkpoint (transformers' own Mega-MoE) and its BF16 twin ("moewire")

#: The smallest shapes the stand-in's FP8 x FP4 kernel takes (H and I multiples of 512);
#: 8 experts so that 2 and 4 ranks each hold whole experts.
V4 = {"hidden": 512, "intermediate": 512, "experts": 8, "top_k": 2}
#: E2M1 magnitudes by code (the sign is bit 3), as DeepSeek-V4's packed FP4 weights.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Every L1 weight is ``code * 2^-4``; L2 weights ``code * 2^-2``, one per output row.
L1_SCALE, L2_SCALE = 2.0**-4, 2.0**-2
#: transformers' FP8 quantizer config of the FP4 checkpoint: the experts FP4 with UE8M0 scales
#: (DeepSeek-V4-Flash's ``expert_dtype="fp4"``, ``scale_fmt="ue8m0"``), the rest left BF16.
V4_QUANTIZATION = {
    "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    "scale_fmt": "ue8m0", "expert_dtype": "fp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.shared_experts",
                               "lm_head"],
}


def deepseek_v4_config(layers: int = 1):
    import transformers as tf

    return tf.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=V4["hidden"], moe_intermediate_size=V4["intermediate"],
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
        q_lora_rank=64, num_experts_per_tok=V4["top_k"], n_routed_experts=V4["experts"],
        n_shared_experts=1, o_groups=2, o_lora_rank=64, index_n_heads=2, index_head_dim=32,
        index_topk=8, sliding_window=16, num_nextn_predict_layers=0,
        max_position_embeddings=256, mlp_layer_types=["moe"] * layers,
        layer_types=["sliding_attention"] * layers, tie_word_embeddings=False,
    )


def _expert_codes(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed E2M1 code indices (sign << 3 | magnitude index) of one expert: L1 ``[2I, H]``
    all random, L2 ``[H, I]`` with one non-zero per output row (so each combine row is one
    exact product and every FP32 sum of the kernel is exact: tests/hf_transformers/
    _v4_oracle.py)."""
    two_i, hidden = 2 * V4["intermediate"], V4["hidden"]
    l1 = torch.randint(0, 16, (two_i, hidden), generator=g)
    l2 = torch.zeros((hidden, V4["intermediate"]), dtype=torch.long)
    cols = torch.randint(0, V4["intermediate"], (hidden,), generator=g)
    codes = torch.randint(1, 8, (hidden,), generator=g) | (torch.randint(0, 2, (hidden,),
                                                                         generator=g) << 3)
    l2[torch.arange(hidden), cols] = codes
    return l1, l2


def decode(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of signed E2M1 code indices."""
    table = torch.tensor(E2M1, dtype=torch.float64)
    return table[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0).double()


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte, the even column in the low nibble: int8 ``[N, K / 2]``."""
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).view(torch.int8)


def deepseek_v4_checkpoints(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """A tiny random DeepSeek-V4 twice, with the same expert values: FP4 experts with UE8M0
    scales in DeepSeek-V4-Flash's layout (``layers.N.ffn.experts.E.w{1,2,3}.weight`` int8
    ``[N, K/2]`` and ``.scale`` float8_e8m0fnu ``[N, K/32]``, what transformers' loader
    converts into ``FP8Experts``), and BF16 (``DeepseekV4Experts``, for ``"moewire"``).

    Returns:
        ``(fp4 path, bf16 path)``.
    """
    import json

    import transformers as tf
    from safetensors.torch import load_file, save_file

    fp4, bf16 = root / "v4-fp4", root / "v4-bf16"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(deepseek_v4_config())
        _randomize(model)
    g = torch.Generator().manual_seed(seed + 1)
    codes = {}
    with torch.no_grad():
        for n, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for e in range(V4["experts"]):
                l1, l2 = _expert_codes(g)
                codes[n, e] = l1, l2
                experts.gate_up_proj[e] = decode(l1) * L1_SCALE
                experts.down_proj[e] = decode(l2) * L2_SCALE
    model.to(torch.bfloat16).save_pretrained(bf16)
    tensors = load_file(bf16 / "model.safetensors")
    inter = V4["intermediate"]
    for (n, e), (l1, l2) in codes.items():
        prefix = f"model.layers.{n}.ffn.experts.{e}"
        for name, c, scale in (("w1", l1[:inter], L1_SCALE), ("w3", l1[inter:], L1_SCALE),
                               ("w2", l2, L2_SCALE)):
            tensors[f"{prefix}.{name}.weight"] = _pack(c)
            tensors[f"{prefix}.{name}.scale"] = torch.full(
                (c.shape[0], c.shape[1] // 32), scale).to(torch.float8_e8m0fnu)
    fp4.mkdir()
    save_file(tensors, fp4 / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = V4_QUANTIZATION
    (fp4 / "config.json").write_text(json.dumps(config, indent=1))
    return fp4, bf16
