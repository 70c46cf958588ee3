"""The transformers MoE families moewire knows: each family's experts class and the serving
engines' names of its experts (:data:`ARCHITECTURES`), and the check that a module's layout
and activation are ones the Mega-MoE kernel can express.

May import: the standard library and torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["ARCHITECTURES", "Architecture", "architecture_of"]

_SILU = ("silu", "swish")


@dataclass(frozen=True)
class Architecture:
    """One transformers MoE family: its experts class and the serving engines' names.

    Attributes:
        model_type: ``config.model_type`` (``"deepseek_v3"``).
        module: the transformers module that defines the experts class.
        experts_class: the class decorated with ``use_experts_implementation``.
        clamp_attr: the experts' attribute holding a SwiGLU limit (``gate <= c``,
            ``|up| <= c``), passed as ``activation_clamp``; ``None``: no limit.
        vllm: vLLM's module path of the layer's experts, ``{n}`` the layer index, or
            ``None`` where vLLM has no Mega-MoE experts for the family.
        vllm_site: ``(module, class)`` of vLLM's Mega-MoE experts for the family (an entry
            of ``moewire.integrations.vllm.sites.SITES``), or ``None``.
        sglang: SGLang's module path of the layer's experts, or ``None``.
        refused: why the kernel cannot run this family's experts, or ``None``.
        read_from: the sources the entry was read from.
    """

    model_type: str
    module: str
    experts_class: str
    clamp_attr: str | None = None
    vllm: str | None = None
    vllm_site: tuple[str, str] | None = None
    sglang: str | None = None
    refused: str | None = None
    read_from: str = ""


_TF = "transformers.models"

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        "deepseek_v3", f"{_TF}.deepseek_v3.modeling_deepseek_v3", "DeepseekV3Experts",
        # vLLM's DeepseekV2MoE holds `experts` under `mlp`; SGLang 0.5.23
        # sglang/srt/models/deepseek_v2.py: model.layers.N.mlp.experts.
        vllm="model.layers.{n}.mlp.experts", sglang="model.layers.{n}.mlp.experts",
        read_from="transformers 5.23.0 modeling_deepseek_v3.py; SGLang 0.5.23 deepseek_v2.py",
    ),
    Architecture(
        "deepseek_v4", f"{_TF}.deepseek_v4.modeling_deepseek_v4", "DeepseekV4Experts",
        clamp_attr="limit",
        # vLLM's DeepSeek-V4 decoder layer calls its MoE `ffn`
        # (vllm/models/deepseek_v4/nvidia/model.py, DeepseekV4MegaMoEExperts).
        vllm="model.layers.{n}.ffn.experts",
        vllm_site=("vllm.models.deepseek_v4.nvidia.model", "DeepseekV4MegaMoEExperts"),
        sglang="model.layers.{n}.mlp.experts",
        read_from="transformers 5.23.0 modeling_deepseek_v4.py (DeepseekV4Experts._apply_gate)",
    ),
    Architecture(
        "qwen3_moe", f"{_TF}.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts",
        vllm="model.layers.{n}.mlp.experts", sglang="model.layers.{n}.mlp.experts",
        read_from="transformers 5.23.0 modeling_qwen3_moe.py",
    ),
    Architecture(
        "mixtral", f"{_TF}.mixtral.modeling_mixtral", "MixtralExperts",
        # vLLM's and SGLang's Mixtral keep the MoE block as `block_sparse_moe`.
        vllm="model.layers.{n}.block_sparse_moe.experts",
        sglang="model.layers.{n}.block_sparse_moe.experts",
        read_from="transformers 5.23.0 modeling_mixtral.py",
    ),
    Architecture(
        "gpt_oss", f"{_TF}.gpt_oss.modeling_gpt_oss", "GptOssExperts",
        vllm="model.layers.{n}.mlp.experts",
        vllm_site=("vllm.model_executor.layers.fused_moe.experts.deep_gemm_mega_moe",
                   "DeepGemmMegaExperts"),
        sglang="model.layers.{n}.mlp.experts",
        # The real kernels cannot run gpt-oss: DeepGEMM PR #323 (8ddf7f9) takes no bias
        # tensors in fp8_mega_moe / fp8_fp4_mega_moe and its SymmBuffer asserts
        # activation == 'swiglu' (deep_gemm/mega/__init__.py); the SM90 kernels compute
        # silu(gate) * up (impls/sm90_fp8_fp4_mega_moe.cuh). vLLM main's DeepGemmMegaExperts
        # (fused_moe/experts/deep_gemm_mega_moe.py, 13f9685) passes neither biases nor an
        # activation to fp8_fp4_mega_moe; its SWIGLUOAI entry is marked a temporary hack.
        refused=(
            "gpt-oss's experts have biases (has_bias=True) and the clamped activation "
            "(up + 1) * gate * sigmoid(alpha * gate) (transformers 5.23.0 "
            "GptOssExperts._apply_gate), and DeepGEMM's Mega-MoE kernels have neither: "
            "fp8_mega_moe and fp8_fp4_mega_moe take no bias tensors and only "
            "activation='swiglu', silu(gate) * up (DeepGEMM PR #323, 8ddf7f9, "
            "deep_gemm/mega/__init__.py asserts it); vLLM main's DeepGemmMegaExperts "
            "(fused_moe/experts/deep_gemm_mega_moe.py) passes neither biases nor an "
            "activation to it, which computes another network than gpt-oss's experts"
        ),
        read_from="transformers 5.23.0 modeling_gpt_oss.py (GptOssExperts._apply_gate); "
        "DeepGEMM PR #323 deep_gemm/mega/__init__.py; vLLM main "
        "fused_moe/experts/deep_gemm_mega_moe.py",
    ),
)

_BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES}


def architecture_of(model_type: str) -> Architecture:
    """The :class:`Architecture` of ``config.model_type``.

    Raises:
        ValueError: the family is not in :data:`ARCHITECTURES` (the message lists them).
    """
    arch = _BY_MODEL_TYPE.get(model_type)
    if arch is None:
        raise ValueError(
            f"moewire.integrations.transformers: unknown architecture {model_type!r}; moewire "
            f"knows the experts layouts of {', '.join(sorted(_BY_MODEL_TYPE))} (read from "
            "transformers 5.23.0); add an Architecture entry after reading the family's "
            "experts class"
        )
    return arch


def _where(module: nn.Module) -> str:
    return module.__dict__.get("_moewire_tf_name") or type(module).__name__


def _arch_of_module(module: nn.Module) -> Architecture | None:
    for arch in ARCHITECTURES:
        for klass in type(module).__mro__:
            if klass.__name__ == arch.experts_class and klass.__module__ == arch.module:
                return arch
    return None


def _check_layout(module: nn.Module, arch: Architecture | None) -> None:
    where = _where(module)
    if arch is None:
        raise ValueError(
            f"{where}: {type(module).__qualname__} is an experts class moewire has not read; "
            f"use one of {', '.join(a.experts_class for a in ARCHITECTURES if not a.refused)} "
            "or add an Architecture entry"
        )
    if arch.refused:
        raise ValueError(f"{where}: {arch.refused}; use experts_implementation='eager'")
    for flag, bad, why in (
        ("has_bias", True, "expert biases"),
        ("has_gate", False, "experts without a gate (no SwiGLU)"),
        ("has_post_expert_norm", True, "a norm after each expert"),
    ):
        if getattr(module, flag, not bad) == bad:
            raise ValueError(
                f"{where}: {flag}={bad}: the Mega-MoE kernel has no {why}; use "
                "experts_implementation='eager'"
            )
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    if act not in _SILU:
        raise ValueError(
            f"{where}: hidden_act={act!r}; the Mega-MoE kernel's activation is SwiGLU (silu); "
            "use experts_implementation='eager'"
        )
