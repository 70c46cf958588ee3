"""Tiny random MoE checkpoints, for trying ``moewire eval`` and the transformers integration
with nothing downloaded: ``moewire checkpoint KIND DIR`` (or :func:`make`).

Each is a transformers checkpoint as ``save_pretrained`` writes it (``config.json``,
``model.safetensors``), BF16, from a fixed seed, so two runs of the same command write the
same bytes of weights. Its numbers mean nothing about a real model; they show what the
commands print and how long they take.

==================  ===========================================================================
kind                what
==================  ===========================================================================
``qwen3-moe``       Qwen3-MoE, 4 layers, 16 experts top-4, H = I = 256, a vocabulary of 4096
                    (docs/eval.md's example)
``deepseek-v3``     DeepSeek-V3, 1 layer, 8 experts top-2 and a shared expert, H = I = 512
                    (the smallest shapes of the NVFP4 x NVFP4 stand-in, ``--mma fp4xfp4``)
``deepseek-v4-fp4`` DeepSeek-V4, 1 layer, 8 experts top-2, H = I = 512, the experts FP4 with
                    UE8M0 scales in DeepSeek-V4-Flash's layout (transformers' own Mega-MoE,
                    ``experts_implementation="deepgemm_megamoe"``)
``deepseek-v4``     the same DeepSeek-V4 with BF16 experts (the same expert values)
==================  ===========================================================================

``tokenizer=True`` (``--tokenizer``) saves a byte-level tokenizer into the checkpoint
(:func:`save_byte_tokenizer`: token ``i`` is byte ``i``, ``<eos>`` in place of byte 0), which
lm-evaluation-harness's tasks need (``moewire eval --tasks``); without one, ``moewire eval``
reads the text's bytes modulo the vocabulary, the same tokens.

The DeepSeek-V4 FP4 layout follows transformers 5.23's loader of DeepSeek-V4-Flash
(``integrations/finegrained_fp8.py``, ``FP8Experts`` with ``expert_dtype="fp4"``): per expert
``model.layers.N.ffn.experts.E.w{1,2,3}.weight`` int8 ``[N, K / 2]`` (two E2M1 codes a byte,
the even column in the low nibble) and ``.scale`` float8_e8m0fnu ``[N, K / 32]``.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["E2M1", "KINDS", "L1_SCALE", "L2_SCALE", "V4", "V4_QUANTIZATION", "decode",
           "deepseek_v4_checkpoints", "deepseek_v4_config", "make", "save_byte_tokenizer"]

#: The DeepSeek-V4 shapes: the smallest the stand-in's FP8 x FP4 kernel takes (H and I
#: multiples of 512); 8 experts, so that 2 and 4 ranks each hold whole experts.
V4 = {"hidden": 512, "intermediate": 512, "experts": 8, "top_k": 2, "vocab": 256}
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


def _randomize(model: torch.nn.Module) -> None:
    """Routers with visible preferences (``N(0, 0.5)``), experts ``N(0, 1 / K)``; the rest
    stays at the model's init."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
            elif "experts" in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)


def _save(config, path: Path, seed: int) -> Path:
    import transformers as tf

    with torch.random.fork_rng():  # the caller's global RNG stays as it was
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config)
        _randomize(model)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def qwen3_moe(path: Path, seed: int = 0) -> Path:
    """docs/eval.md's example model: Qwen3-MoE, 4 layers, 16 experts top-4, H = I = 256, a
    vocabulary of 4096."""
    import transformers as tf

    return _save(tf.Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
        intermediate_size=512, moe_intermediate_size=256, num_experts=16,
        num_experts_per_tok=4, decoder_sparse_step=1, norm_topk_prob=True,
        tie_word_embeddings=False), path, seed)


def deepseek_v3(path: Path, seed: int = 0) -> Path:
    """DeepSeek-V3, 1 layer, 8 experts top-2 and one shared expert, H = I = 512, a vocabulary
    of 256 (the NVFP4 x NVFP4 stand-in's smallest shapes)."""
    import transformers as tf

    return _save(tf.DeepseekV3Config(
        vocab_size=256, hidden_size=512, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=2,
        tie_word_embeddings=False, intermediate_size=1024, moe_intermediate_size=512,
        n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
        first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=32, routed_scaling_factor=2.5, norm_topk_prob=True,
    ), path, seed)


def deepseek_v4_config(layers: int = 1):
    """transformers' ``DeepseekV4Config`` of the tiny DeepSeek-V4 (:data:`V4`'s shapes)."""
    import transformers as tf

    return tf.DeepseekV4Config(
        vocab_size=V4["vocab"], hidden_size=V4["hidden"],
        moe_intermediate_size=V4["intermediate"], num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, q_lora_rank=64,
        num_experts_per_tok=V4["top_k"], n_routed_experts=V4["experts"], n_shared_experts=1,
        o_groups=2, o_lora_rank=64, index_n_heads=2, index_head_dim=32, index_topk=8,
        sliding_window=16, num_nextn_predict_layers=0, max_position_embeddings=256,
        mlp_layer_types=["moe"] * layers, layer_types=["sliding_attention"] * layers,
        tie_word_embeddings=False,
    )


def _expert_codes(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed E2M1 code indices (sign << 3 | magnitude index) of one expert: L1 ``[2I, H]``
    all random, L2 ``[H, I]`` with one non-zero per output row (so each combine row is one
    exact product and every FP32 sum of the kernel is exact)."""
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


def deepseek_v4_checkpoints(fp4: Path | None, bf16: Path, seed: int = 0) -> tuple[Path | None,
                                                                                     Path]:
    """The tiny DeepSeek-V4 twice, with the same expert values: BF16 experts
    (``DeepseekV4Experts``) into ``bf16``, and, unless ``fp4`` is ``None``, FP4 experts with
    UE8M0 scales in DeepSeek-V4-Flash's layout (what transformers' loader converts into
    ``FP8Experts``) into ``fp4``. Every L1 weight is ``E2M1 code * 2^-4`` and every L2 weight
    ``E2M1 code * 2^-2`` (:func:`decode`), so both hold exactly the same values.

    Returns:
        ``(fp4, bf16)``.
    """
    from safetensors.torch import load_file, save_file

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        import transformers as tf

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
    if fp4 is None:
        return None, bf16
    tensors = load_file(bf16 / "model.safetensors")
    inter = V4["intermediate"]
    for (n, e), (l1, l2) in codes.items():
        prefix = f"model.layers.{n}.ffn.experts.{e}"
        for name, c, scale in (("w1", l1[:inter], L1_SCALE), ("w3", l1[inter:], L1_SCALE),
                               ("w2", l2, L2_SCALE)):
            tensors[f"{prefix}.{name}.weight"] = _pack(c)
            tensors[f"{prefix}.{name}.scale"] = torch.full(
                (c.shape[0], c.shape[1] // 32), scale).to(torch.float8_e8m0fnu)
    fp4.mkdir(parents=True, exist_ok=True)
    save_file(tensors, fp4 / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = V4_QUANTIZATION
    (fp4 / "config.json").write_text(json.dumps(config, indent=1))
    return fp4, bf16


def _deepseek_v4_fp4(path: Path, seed: int = 0) -> Path:
    with tempfile.TemporaryDirectory() as twin:
        deepseek_v4_checkpoints(path, Path(twin) / "bf16", seed)
    return path


def _deepseek_v4_bf16(path: Path, seed: int = 0) -> Path:
    return deepseek_v4_checkpoints(None, path, seed)[1]


#: ``moewire checkpoint``'s kinds: name -> ``maker(path, seed)``.
KINDS: dict[str, Callable[[Path, int], Path]] = {
    "qwen3-moe": qwen3_moe,
    "deepseek-v3": deepseek_v3,
    "deepseek-v4-fp4": _deepseek_v4_fp4,
    "deepseek-v4": _deepseek_v4_bf16,
}


def _byte_chars() -> dict[int, str]:
    """The byte -> character table of byte-level BPE (GPT-2's ``bytes_to_unicode``, the one
    ``tokenizers``' ``ByteLevel`` uses): printable bytes are themselves, the others the
    characters from U+0100 on, in byte order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer of 256 tokens into checkpoint ``path``: token ``i`` is byte
    ``i`` (the tokens ``moewire eval`` reads from a checkpoint without a tokenizer), with
    ``<eos>`` in place of byte 0 (which text holds rarely); no merges, so a text's tokens are
    its bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_chars()
    vocab = {chars[b]: b for b in range(1, 256)} | {"<eos>": 0}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(path)


def make(kind: str, path: str | Path, *, tokenizer: bool = False, seed: int = 0) -> Path:
    """Write the tiny checkpoint ``kind`` (:data:`KINDS`) into ``path``, which must not exist
    or be empty; with ``tokenizer``, a byte-level tokenizer beside it.

    Raises:
        ValueError: an unknown ``kind``, or ``path`` is a file or a directory with files in
            it (nothing is overwritten); the message names the fix.
    """
    if kind not in KINDS:
        raise ValueError(f"moewire checkpoint: unknown kind {kind!r}; pick one of "
                         f"{', '.join(KINDS)}")
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"moewire checkpoint: {path} exists and is not an empty directory; "
                         "pass a new directory (nothing is overwritten)")
    KINDS[kind](path, seed)
    if tokenizer:
        save_byte_tokenizer(path)
    return path
