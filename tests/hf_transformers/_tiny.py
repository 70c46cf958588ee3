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
        _randomize(model)  # moewire.checkpoints': the routers' and experts' draws
    model.to(torch.bfloat16).save_pretrained(path)
    return path


# -- DeepSeek-V4: an FP4 checkpoint (transformers' own Mega-MoE) and its BF16 twin ("moewire"),
# written by moewire.checkpoints (what `moewire checkpoint deepseek-v4-fp4 DIR` writes).

from moewire.checkpoints import (  # noqa: E402
    E2M1,
    L1_SCALE,
    L2_SCALE,
    V4,
    V4_QUANTIZATION,
    _randomize,
    decode,
    deepseek_v4_config,
)

__all__ = ["E2M1", "FAMILIES", "L1_SCALE", "L2_SCALE", "V4", "V4_QUANTIZATION", "VOCAB",
           "checkpoint", "config", "decode", "deepseek_v4_checkpoints", "deepseek_v4_config"]


def deepseek_v4_checkpoints(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """``(root / "v4-fp4", root / "v4-bf16")``: the tiny DeepSeek-V4 with FP4 experts and its
    BF16 twin of the same expert values (:func:`moewire.checkpoints.deepseek_v4_checkpoints`)."""
    from moewire.checkpoints import deepseek_v4_checkpoints as write

    fp4, bf16 = write(root / "v4-fp4", root / "v4-bf16", seed)
    assert fp4 is not None
    return fp4, bf16
