"""moewire as a transformers experts implementation: ``experts_implementation="moewire"``.

transformers 5.23.0 (``transformers/integrations/moe.py``) gives every modern MoE model one
experts contract, ``Experts.forward(hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]``, and a registry of implementations
(``ExpertsInterface``) that ``use_experts_implementation`` dispatches to from
``config._experts_implementation``. This module registers ``"moewire"`` there. Its forward
runs the experts through the Mega-MoE contract of the stand-in DeepGEMM kernel
(``moewire.reference.deep_gemm``), the way vLLM's ``DeepGemmMegaMoEExperts`` does:

1. stage the tokens, ids and router weights into the layer's symmetric buffer
   (``stage_mega_moe_inputs``: BF16 tokens for ``bf16xbf16``, UE8M0-per-32 FP8 for
   ``fp8xfp4``), in chunks of at most the buffer's capacity;
2. call the kernel through the ``deep_gemm`` namespace (``bf16_mega_moe`` or
   ``fp8_fp4_mega_moe``): ``y = sum_k w_k * L2(act(L1(x)))`` with the router weight applied
   to L1's activation, BF16 rows summed in FP32 (``moewire.reference.deep_gemm``);
3. return ``y`` in ``hidden_states``' dtype.

Both globals are read at call time, so :func:`moewire.quantize` interposes on them as on
vLLM's forward: each experts module, once converted, has ``dispatch_quantizer`` and
``combine_quantizer`` named ``model.layers.N.mlp.experts.{dispatch,combine}_quantizer``.

What the model keeps: its router (``top_k_weights`` arrive scaled by
``routed_scaling_factor``, which transformers' routers apply, e.g. DeepSeek-V3's
``DeepseekV3TopkRouter.forward``), its shared expert (added by the MoE block after the
experts, on unquantized tokens, as vLLM's unfused shared expert) and its SwiGLU limit
(DeepSeek-V4's ``swiglu_limit`` becomes the kernel's ``activation_clamp``).

Weight layouts come from the flags ``use_experts_implementation`` sets on each instance
(``is_concatenated``, ``is_transposed``, ``has_bias``, ``has_gate``,
``has_post_expert_norm``; read in transformers 5.23.0 ``integrations/moe.py``); the kernel
reads L1 ``[E, 2I, H]`` with rows ``[gate | up]`` and L2 ``[E, H, I]``. A layout or an
activation the kernel cannot express (biases, gpt-oss's ``(up + 1) * gate *
sigmoid(alpha * gate)``, a custom ``_apply_gate``, a non-SiLU activation) is refused.

Kernels (``prepare(model, kernel=...)``) and their builds (``mma_type``):

- ``"stand-in"`` (the default), ``moewire.reference.deep_gemm`` on any device:
  ``"bf16xbf16"`` (the default: BF16 weights stay as they are and only the wire changes;
  FP32 weights are rounded to BF16), ``"fp8xfp4"`` (weights quantized to FP4 E2M1 with
  UE8M0 scales per 32, tokens staged in FP8) or ``"fp4xfp4"`` (DeepGEMM 2.8.0's NVFP4 x NVFP4
  ``fp4_fp4_mega_moe``, the kernel vLLM main serves DeepSeek V3.2 / GLM-5.2 NVFP4 with:
  BF16/FP16/FP32 weights quantized to NVFP4 as ModelOpt's checkpoints hold them, gate, up
  and down each with a per-expert global scale passed as ``l1_alphas``/``l2_alphas``; the
  tokens staged as vLLM main's ``prepare_megamoe_nvfp4_inputs`` does, NVFP4 per 16 without
  a global scale; H and I multiples of 512; flavour ``deepgemm-2.8``);
- ``"deepgemm-sm90"`` (opt-in, a Hopper GPU and DeepGEMM PR #323's package): DeepGEMM's
  real ``fp8_mega_moe`` (``mma_type="fp8xfp8"``). The BF16 expert weights are quantized to
  FP8 E4M3 with one FP32 scale per 128x128 block
  (``moewire.integrations.deepgemm_sm90.quantize_weights``), the buffer is
  ``get_symm_buffer_for_sm90_mega_moe`` on a one-rank NCCL group (or the ``group`` given),
  the tokens are staged by ``stage_sm90_inputs`` (FP8, one FP32 scale per 128 columns). Its
  flavour is ``deepgemm-sm90``: moewire's quantizers re-sum the combine rows where that
  build leaves them.

Usage::

    import moewire.integrations.transformers as mt
    mt.register()
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moewire")
    mt.prepare(model)                    # build the Mega-MoE state of every experts module
    moewire.quantize(model, "moe_fp8", forward_loop)

Scale names map to the serving engines' module names with :func:`serving_name` (see
``docs/eval.md``).

Two more things run through this package:

- transformers' own Mega-MoE, ``experts_implementation="deepgemm_megamoe"`` (``FP8Experts``
  of a pre-quantized FP4 checkpoint, the kernels-hub DeepGEMM): a site moewire hooks like
  vLLM's (:mod:`.sites`, :mod:`.megamoe`); ``prepare(model)`` loads transformers' kernel,
  ``prepare(model, kernel="stand-in")`` opts in to moewire's stand-in of it (CPU, Hopper).
- expert parallelism (:mod:`.ep`): under ``torchrun`` with ``DistributedConfig(tp_size=N,
  ep_size=N, ep_implementation="moewire")`` the ``"moewire"`` experts run through
  transformers' ``MegaMoeEP``; ``prepare`` builds each buffer on the EP group, calibration
  reduces over EP and DP, and :func:`save_scales` writes one file from rank 0.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moewire.integrations import deepgemm_sm90 as sm90
from moewire.integrations.deepgemm_sm90 import stage_sm90_inputs
from moewire.integrations.transformers import ep, megamoe
from moewire.integrations.transformers.sites import SITES, MegaMoeSite
from moewire.integrations.transformers.sites import recognise as sites_recognise
from moewire.megamoe import api
from moewire.megamoe.flavours import detect
from moewire.megamoe.registry import (
    ExpertsAdapter,
    register_experts_class,
    unregister_experts_class,
)
from moewire.megamoe.scales_file import read_scales, write_scales
from moewire.reference import catalogue, fp4_fp4
from moewire.reference import deep_gemm as stand_in
from moewire.reference.dense import from_dense, kernel_kwargs
from moewire.reference.experts import stage_mega_moe_inputs
from moewire.reference.fp4_fp4.staging import prepare_megamoe_nvfp4_inputs

__all__ = [
    "ARCHITECTURES",
    "IMPLEMENTATION",
    "KERNELS",
    "MMA_TYPES",
    "Architecture",
    "architecture_of",
    "experts_modules",
    "prepare",
    "register",
    "save_scales",
    "save_serving_scales",
    "serving_name",
    "site_modules",
    "unregister",
]

IMPLEMENTATION = "moewire"
#: kernel -> its builds, each build -> the kernel function the forward calls (the rows of
#: ``moewire.reference.catalogue`` transformers offers; a kernel's first build is its default).
KERNELS: dict[str, dict[str, str]] = {
    kernel: {b.mma_type: b.function for b in catalogue.builds(kernel, "transformers")}
    for kernel in (catalogue.STAND_IN, catalogue.SM90)
}
MMA_TYPES = catalogue.mma_types(user="transformers")
#: Tokens per kernel call unless ``prepare`` is told otherwise (the buffer's capacity).
DEFAULT_MAX_TOKENS = 2048
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
_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts(\.(?:dispatch|combine)_quantizer)?$")


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


def serving_name(name: str, model_type: str, host: str) -> str:
    """The serving engine's name for a transformers experts module or quantizer name.

    ``serving_name("model.layers.3.mlp.experts.combine_quantizer", "deepseek_v4", "vllm")``
    is ``"model.layers.3.ffn.experts.combine_quantizer"``.

    Args:
        name: ``model.layers.N.mlp.experts`` with an optional ``.dispatch_quantizer`` /
            ``.combine_quantizer``.
        model_type: the transformers ``config.model_type``.
        host: ``"vllm"`` or ``"sglang"``.

    Raises:
        ValueError: an unknown host, architecture or name shape, or a family the host has
            no path for.
    """
    if host not in ("vllm", "sglang"):
        raise ValueError(f"serving_name: host must be 'vllm' or 'sglang', got {host!r}")
    arch = architecture_of(model_type)
    match = _NAME.match(name)
    if match is None:
        raise ValueError(
            f"serving_name: {name!r} is not a transformers experts name "
            "(model.layers.N.mlp.experts[.dispatch_quantizer|.combine_quantizer])"
        )
    template = getattr(arch, host)
    if template is None:
        raise ValueError(f"serving_name: {host} has no experts path for {model_type}")
    return template.format(n=match.group(1)) + (match.group(2) or "")


def save_serving_scales(model: nn.Module, path: str | Path, host: str) -> Path:
    """:func:`moewire.save_scales` with every name mapped to ``host``'s (:func:`serving_name`),
    so the file loads into the engine's experts modules.

    Returns:
        ``path``.
    """
    path = Path(path)
    model_type = _model_type(model)
    api.save_scales(model, path)
    scales = read_scales(path)
    return write_scales(path, {serving_name(n, model_type, host): s for n, s in scales.items()})


def save_scales(model: nn.Module, path: str | Path, host: str | None = None) -> Path:
    """One scales file for a model on one rank or under expert parallelism: every rank calls
    it, rank 0 writes, every rank returns once the file exists.

    Under a process group the amaxes must agree on every rank (calibration reduced them over
    the EP and DP groups, :mod:`.ep`), which is checked first; the file is then the one a
    one-rank run writes, loadable by every rank of a serving engine.

    Args:
        model: the quantized (calibrated) model.
        path: the scales file (``.json``, ``.safetensors`` or ``.pt``).
        host: ``"vllm"`` or ``"sglang"`` to write the engine's module names
            (:func:`save_serving_scales`), ``None`` for transformers' names.

    Returns:
        ``path``.

    Raises:
        RuntimeError: an amax differs between ranks (the message names the quantizers).
        ValueError: what :func:`moewire.save_scales` refuses.
    """
    import torch.distributed as dist

    path = Path(path)
    differ = ep.ranks_agree(model)
    if differ:
        raise RuntimeError(
            f"save_scales: the amax of {differ[:4]}{' ...' if len(differ) > 4 else ''} differs "
            "between ranks: the model was calibrated without reducing over the EP and DP "
            "groups; calibrate with moewire.quantize / moewire.calibrate after prepare(model), "
            "which records the groups"
        )
    distributed = dist.is_available() and dist.is_initialized()
    error: BaseException | None = None
    if not distributed or dist.get_rank() == 0:
        try:
            if host is None:
                api.save_scales(model, path)
            else:
                save_serving_scales(model, path, host)
        except (ValueError, OSError) as exc:
            error = exc
    if distributed:
        # Every rank learns whether rank 0 wrote the file (and the file exists on return).
        failed = [error is not None]
        dist.broadcast_object_list(failed, src=0)
        if failed[0] and error is None:
            raise RuntimeError(f"save_scales: rank 0 could not write {path}; see its error")
    if error is not None:
        raise error
    return path


# ---------------------------------------------------------------------------- the kernels


class _Kernels:
    """The kernel namespace the experts forward reads at call time (the adapter's
    ``kernel_ns``, which :func:`moewire.quantize` replaces by its proxy): each kernel
    function from the package that has it, the stand-in's ``bf16_mega_moe`` and
    ``fp8_fp4_mega_moe``, DeepGEMM's SM90 ``fp8_mega_moe`` (imported at first use)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(sm90.deep_gemm if name == "fp8_mega_moe" else stand_in, name)

    def __repr__(self) -> str:
        return "<moewire.integrations.transformers kernels>"


deep_gemm = _Kernels()


# ---------------------------------------------------------------------------- the state


@dataclass
class _MegaState:
    """The Mega-MoE form of one experts module: kernel weights, its buffer and the EP group
    the buffer spans (``None``: one rank)."""

    kernel: str
    mma_type: str
    l1: Any
    l2: Any
    clamp: float | None
    buffer: Any
    group: Any = None
    # Further kernel keywords (fp4xfp4: the per-expert l1_alphas and l2_alphas)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def function(self) -> str:
        return KERNELS[self.kernel][self.mma_type]

    @property
    def flavour(self) -> str:
        if self.kernel == "deepgemm-sm90":
            return sm90.FLAVOUR
        if self.mma_type == "fp4xfp4":
            # The stand-in's fp4_fp4_mega_moe imitates DeepGEMM 2.8.0's, whatever flavour
            # its other kernels imitate now.
            return fp4_fp4.FLAVOUR
        return detect(stand_in, "moewire.reference.deep_gemm").name


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(
            f"{type(model).__name__} has no config.model_type; pass a transformers model"
        )
    return model_type


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


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter transformers' EP sharded (a ``DTensor``), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _kernel_layout(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """L1 ``[E, 2I, H]`` rows ``[gate | up]`` and L2 ``[E, H, I]`` from the module's flags
    (``E``: this rank's experts under transformers' EP).

    ``is_transposed``: ``gate_up_proj`` is ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]``;
    ``is_concatenated=False``: gate and up rows interleave (``gate0, up0, gate1, ...``).
    """
    l1, l2 = _local(module.gate_up_proj).detach(), _local(module.down_proj).detach()
    if module.is_transposed:
        l1, l2 = l1.transpose(1, 2), l2.transpose(1, 2)
    if not module.is_concatenated:
        l1 = torch.cat([l1[:, 0::2], l1[:, 1::2]], dim=1)
    return l1, l2


def _stand_in_buffer(module: nn.Module, mma_type: str, l1: torch.Tensor, top_k: int,
                     max_num_tokens: int, group: Any) -> Any:
    """The stand-in's buffer, on ``group``, for the experts of all its ranks."""
    num_experts, two_i, hidden = l1.shape
    ranks = 1 if group is None else group.size()
    try:
        # The stand-in's fp4_fp4_mega_moe imitates DeepGEMM 2.8.0's, whatever flavour its
        # other kernels imitate now.
        with (stand_in.use_flavour(fp4_fp4.FLAVOUR) if mma_type == "fp4xfp4"
              else contextlib.nullcontext()):
            buffer = stand_in.get_symm_buffer_for_mega_moe(
                group, num_experts * ranks, max_num_tokens, top_k, hidden, two_i // 2,
                mma_type=mma_type, device=l1.device,
            )
    except ValueError as exc:
        raise ValueError(
            f"{_where(module)}: the {mma_type} build cannot take these experts ({exc}); use "
            "another mma_type"
        ) from exc
    return buffer


def _check_sm90_alignment(module: nn.Module, hidden: int, intermediate: int) -> None:
    """Refuse shapes whose per-token scale rows the SM90 kernel cannot place (the H and I
    multiples of its catalogue row, which says why)."""
    row = catalogue.build(catalogue.SM90, "fp8xfp8")
    h_multiple, i_multiple = row.hidden_multiple, row.intermediate_multiple
    if hidden % h_multiple or intermediate % i_multiple:
        raise ValueError(
            f"{_where(module)}: DeepGEMM's SM90 fp8_mega_moe keeps H/32 and I/16 scale bytes per "
            f"token in 16-byte (TMA) rows, so H must be a multiple of {h_multiple} and I of "
            f"{i_multiple}; got H={hidden}, I={intermediate}; use kernel='stand-in' for this "
            "model"
        )


def _sm90_form(module: nn.Module, l1: torch.Tensor, l2: torch.Tensor, top_k: int,
               max_num_tokens: int, group: Any) -> tuple[Any, Any, Any, Any]:
    """DeepGEMM's SM90 buffer (on ``group``, default a one-rank group) and FP8 128x128
    block-scaled weights: ``(buffer, l1, l2, group)``."""
    ok, why = sm90.available()
    if not ok:
        raise RuntimeError(
            f"{_where(module)}: kernel='deepgemm-sm90' runs DeepGEMM's real SM90 fp8_mega_moe, "
            f"which cannot run here ({why}); run on a Hopper GPU with the package on "
            "PYTHONPATH (docs/real-kernel.md), or use kernel='stand-in'"
        )
    if l1.device.type != "cuda" and torch.cuda.is_available():
        raise ValueError(
            f"{_where(module)}: the experts' weights are on {l1.device}; move the model to the "
            "Hopper GPU before prepare(kernel='deepgemm-sm90')"
        )
    try:
        weights = sm90.quantize_weights(l1.bfloat16(), l2.bfloat16(), "fp8_mega_moe")
    except ValueError as exc:
        raise ValueError(
            f"{_where(module)}: the deepgemm-sm90 build cannot take these experts ({exc}); "
            "use kernel='stand-in'"
        ) from exc
    group = sm90.one_rank_group() if group is None else group
    num_experts, two_i, hidden = l1.shape
    _check_sm90_alignment(module, hidden, two_i // 2)
    ranks = 1 if group is None else group.size()
    buffer = sm90.deep_gemm.get_symm_buffer_for_sm90_mega_moe(
        group, num_experts * ranks, max_num_tokens, top_k, hidden, two_i // 2
    )
    return buffer, *weights, group


def _build_state(module: nn.Module, mma_type: str | None, max_num_tokens: int,
                 kernel: str = "stand-in", group: Any = None) -> _MegaState:
    arch = _arch_of_module(module)
    _check_layout(module, arch)
    if kernel not in KERNELS:
        raise ValueError(
            f"{_where(module)}: kernel must be one of {sorted(KERNELS)}, got {kernel!r}"
        )
    mma_type = next(iter(KERNELS[kernel])) if mma_type is None else mma_type
    if mma_type not in KERNELS[kernel]:
        raise ValueError(
            f"{_where(module)}: kernel {kernel!r} has the builds {tuple(KERNELS[kernel])}, "
            f"got mma_type={mma_type!r}; pick one of them"
        )
    if _local(module.gate_up_proj).dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ValueError(
            f"{_where(module)}: weights are {module.gate_up_proj.dtype}; moewire quantizes "
            "BF16/FP16/FP32 expert weights for the kernel (dequantize the checkpoint first)"
        )
    l1, l2 = _kernel_layout(module)
    top_k = int(module.config.num_experts_per_tok)
    extra: dict[str, Any] = {}
    if kernel == "deepgemm-sm90":
        buffer, l1_k, l2_k, group = _sm90_form(module, l1, l2, top_k, max_num_tokens, group)
    else:
        buffer = _stand_in_buffer(module, mma_type, l1, top_k, max_num_tokens, group)
        weights = from_dense(l1, l2, mma_type)
        l1_k, l2_k, extra = weights.l1, weights.l2, kernel_kwargs(weights)
    clamp = getattr(module, arch.clamp_attr) if arch.clamp_attr else None
    return _MegaState(kernel, mma_type, l1_k, l2_k, None if clamp is None else float(clamp),
                      buffer, group, extra)


def _state(module: nn.Module) -> _MegaState:
    state = module.__dict__.get("_moewire_mega")
    if state is None:
        if getattr(module, "_is_expert_parallel", False):
            raise RuntimeError(
                f"{_where(module)}: transformers split these experts over an expert-parallel "
                "group, and their Mega-MoE buffer must span it; call "
                "moewire.integrations.transformers.prepare(model) after from_pretrained"
            )
        state = _build_state(module, "bf16xbf16", DEFAULT_MAX_TOKENS)
        module.__dict__["_moewire_mega"] = state
    return state


def stage_fp4_fp4_inputs(hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, buffer: Any) -> None:
    """Stage ``T`` tokens into an ``fp4xfp4`` buffer as vLLM main's
    ``DeepseekV32MegaMoEExperts`` does (``prepare_megamoe_nvfp4_inputs``, NVFP4 per 16);
    the arguments of :func:`~moewire.reference.experts.stage_mega_moe_inputs`."""
    t = hidden_states.shape[0]
    prepare_megamoe_nvfp4_inputs(
        hidden_states, topk_weights, topk_ids, buffer.x[:t], buffer.x_sf[:t],
        buffer.topk_idx[:t], buffer.topk_weights[:t],
    )
def _group_name(group: Any) -> str | None:
    return None if group is None else group.group_name


def _check_call(module: nn.Module, state: _MegaState, hidden: torch.Tensor,
                process_group: Any) -> None:
    """Refuse a call the kernel cannot serve under expert parallelism: with gradients
    (``MegaMoeEP`` runs at inference only: the kernel has no backward and the all-gather is
    not differentiated), without the group its buffer spans, or with another group."""
    where = _where(module)
    if process_group is not None and torch.is_grad_enabled() and hidden.requires_grad:
        raise RuntimeError(
            f"{where}: under expert parallelism the Mega-MoE experts run at inference only "
            "(the kernel has no backward and MegaMoeEP's all-gather is not differentiated), "
            "but gradients are enabled; run the model under torch.no_grad() or "
            "torch.inference_mode()"
        )
    ranks = 1 if state.group is None else state.group.size()
    if process_group is None and ranks > 1:
        raise RuntimeError(
            f"{where}: the buffer spans an expert-parallel group of {ranks} ranks, but the "
            "experts were called without process_group: an EP implementation other than "
            f"{ep.IMPLEMENTATION!r} called them, with local expert ids the Mega-MoE buffer does "
            f"not dispatch; load with DistributedConfig(..., ep_implementation="
            f"{ep.IMPLEMENTATION!r})"
        )
    if process_group is None:
        return
    if process_group.size() > 1 and _group_name(process_group) != _group_name(state.group):
        raise RuntimeError(
            f"{where}: called with the expert-parallel group {process_group.group_name!r} "
            f"({process_group.size()} ranks), but its buffer was built on "
            f"{_group_name(state.group)!r}; call prepare(model) after from_pretrained, under "
            "the same DistributedConfig"
        )


def moewire_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    process_group: Any = None,
) -> torch.Tensor:
    """The ``"moewire"`` experts implementation (the module docstring says the steps).

    Under transformers' EP, ``MegaMoeEP`` calls it with this rank's slice of the batch,
    global expert ids (``-1`` on padding rows) and the EP group (:mod:`.ep`); inside a
    module moewire converted it runs within the quantized forward
    (:func:`.megamoe.run_quantized`), which EP bypasses otherwise.

    Args:
        self: the transformers experts module.
        hidden_states: ``[T, H]`` floating.
        top_k_index: integer ``[T, k]`` expert ids.
        top_k_weights: floating ``[T, k]`` router weights (``routed_scaling_factor`` in).
        process_group: the EP group (given by ``MegaMoeEP``), or ``None`` on one rank.

    Returns:
        ``[T, H]`` in ``hidden_states``' dtype (the kernel's BF16 ``y``).
    """
    return megamoe.run_quantized(_run_kernel, self, hidden_states, top_k_index,
                                 top_k_weights, process_group)


def _run_kernel(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, process_group: Any) -> torch.Tensor:
    state = _state(self)
    _check_call(self, state, hidden_states, process_group)
    buffer = state.buffer
    capacity = buffer.num_max_tokens_per_rank
    sm90_kernel = state.kernel == "deepgemm-sm90"
    # Module globals read at call time: moewire's staging hook replaces them.
    if sm90_kernel:
        stage = stage_sm90_inputs
    elif state.mma_type == "fp4xfp4":
        stage = stage_fp4_fp4_inputs
    else:
        stage = stage_mega_moe_inputs
    # PR #323's fp8_mega_moe takes its recipe and activation by keyword.
    extra = (dict(recipe=sm90.KERNELS["fp8_mega_moe"][0], activation="swiglu") if sm90_kernel
             else dict(state.extra))
    outputs = []
    for start in range(0, hidden_states.shape[0], capacity):
        tokens = hidden_states[start : start + capacity]
        stage(
            tokens.bfloat16(), top_k_index[start : start + capacity],
            top_k_weights[start : start + capacity].float(), buffer,
        )
        y = torch.empty(tokens.shape, dtype=torch.bfloat16, device=tokens.device)
        getattr(deep_gemm, state.function)(y, state.l1, state.l2, buffer,
                                           activation_clamp=state.clamp, **extra)
        outputs.append(y)
    if not outputs:
        return torch.zeros_like(hidden_states)
    return torch.cat(outputs).to(hidden_states.dtype)


# ---------------------------------------------------------------------------- registration


def _uses_moewire(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return getattr(config, "_experts_implementation", None) == IMPLEMENTATION


def _adapter(arch: Architecture) -> ExpertsAdapter:
    import transformers

    return ExpertsAdapter(
        name=f"transformers-{arch.model_type}",
        forward_module=__name__,
        stage_fn=("stage_mega_moe_inputs", "stage_sm90_inputs", "stage_fp4_fp4_inputs"),
        stage_hidden_arg=0,
        kernel_ns="deep_gemm",
        get_symm_buffer=sm90.symm_buffer_of(lambda m: _state(m).buffer),
        flavour=lambda m: _state(m).flavour,
        fused_shared=lambda m: False,
        ep_group=lambda m: _state(m).group,
        dp_groups=lambda m: m.__dict__.get(megamoe.GROUPS, (None, ()))[1],
        runtime=lambda: f"transformers {transformers.__version__}",
        applies=_uses_moewire,
    )


def _experts_classes() -> Iterator[tuple[Architecture, type]]:
    import importlib

    for arch in ARCHITECTURES:
        if arch.refused:
            continue
        try:
            module = importlib.import_module(arch.module)
        except ImportError:
            continue
        cls = getattr(module, arch.experts_class, None)
        if isinstance(cls, type):
            yield arch, cls


def register() -> None:
    """Register ``"moewire"`` in transformers' ``ExpertsInterface`` and
    ``EPImplementationInterface`` (:mod:`.ep`), an experts adapter for every family in
    :data:`ARCHITECTURES`, and the sites of transformers' own Mega-MoE (:mod:`.megamoe`)
    (idempotent; :func:`unregister` undoes it)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, moewire_experts_forward)
    for arch, cls in _experts_classes():
        register_experts_class(cls, _adapter(arch))
    ep.register()
    megamoe.register()


def unregister() -> None:
    """Undo :func:`register` (and the stand-in opt-in of ``prepare(kernel="stand-in")`` for
    transformers' own Mega-MoE)."""
    from transformers.integrations.moe import ExpertsInterface

    megamoe.unregister()
    ep.unregister()
    ExpertsInterface._global_mapping.pop(IMPLEMENTATION, None)
    for _, cls in _experts_classes():
        unregister_experts_class(cls)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every experts module of ``model`` that runs ``"moewire"``."""
    return [(n, m) for n, m in model.named_modules()
            if _uses_moewire(m) and hasattr(m, "gate_up_proj")]


def site_modules(model: nn.Module) -> list[tuple[str, nn.Module, MegaMoeSite]]:
    """``(name, module, site)`` of every experts module of ``model`` that runs one of
    transformers' own Mega-MoE implementations (:data:`.sites.SITES`)."""
    found = []
    for name, module in model.named_modules():
        site = megamoe.site_of(module)
        if site is not None:
            found.append((name, module, site))
    return found


#: The FP8 x FP4 tile of the stand-in kernel: H and I multiples of it.
_STAND_IN_FP4_MULTIPLE = catalogue.build(catalogue.STAND_IN, "fp8xfp4").hidden_multiple


def _check_site_layout(name: str, module: nn.Module, site: MegaMoeSite) -> None:
    """Refuse an experts module of ``site`` that the stand-in's FP8 x FP4 build cannot run."""
    weights = _local(module.gate_up_proj)
    hidden, intermediate = module.hidden_dim, module.intermediate_dim
    if not getattr(module, "has_gate", True) or getattr(module, "has_bias", False):
        raise ValueError(
            f"{name}: {site.name} runs the gated SwiGLU experts of fp8_fp4_mega_moe without "
            "biases; this module has has_gate=False or has_bias=True"
        )
    if weights.dtype != torch.int8:
        raise ValueError(
            f"{name}: {site.name} runs fp8_fp4_mega_moe on FP4 (int8-packed) expert weights, "
            f"these are {weights.dtype}; load a checkpoint with expert_dtype='fp4'"
        )
    if hidden % _STAND_IN_FP4_MULTIPLE or intermediate % _STAND_IN_FP4_MULTIPLE:
        raise ValueError(
            f"{name}: the stand-in's fp8_fp4_mega_moe tiles H and I by "
            f"{_STAND_IN_FP4_MULTIPLE} (FP4 weights, 128-byte rows), got H={hidden}, "
            f"I={intermediate}; use a model whose sizes are multiples of it"
        )


def _prepare_site(site: MegaMoeSite, modules: list[tuple[str, nn.Module]],
                  mma_type: str | None, kernel: str | None) -> None:
    where = modules[0][0]
    why = sites_recognise(site)
    if why is not None:
        raise RuntimeError(f"{where}: moewire cannot hook experts_implementation="
                           f"{site.name!r} in this transformers: {why}")
    if mma_type is not None:
        raise ValueError(
            f"{where}: experts_implementation={site.name!r} runs transformers' own "
            f"fp8_fp4_mega_moe on the checkpoint's FP4 weights; mma_type={mma_type!r} does "
            "not apply (leave it None)"
        )
    if kernel is None:
        megamoe.load_bundle(site, where)
        return
    if kernel != "stand-in":
        raise ValueError(
            f"{where}: experts_implementation={site.name!r} runs the kernel transformers "
            f"loads (kernel=None) or moewire's stand-in of it (kernel='stand-in'), got "
            f"kernel={kernel!r}"
        )
    for name, module in modules:
        _check_site_layout(name, module, site)
    megamoe.install_stand_in(site)


def prepare(
    model: nn.Module,
    mma_type: str | None = None,
    *,
    max_num_tokens: int = DEFAULT_MAX_TOKENS,
    kernel: str | None = None,
    group: Any = None,
) -> nn.Module:
    """Make every Mega-MoE experts module of ``model`` ready to run and to quantize.

    Call it after ``from_pretrained`` and before :func:`moewire.quantize`.

    - ``"moewire"`` experts: build the Mega-MoE state (kernel weights, buffer). A module
      without a state builds the default one on its first forward (not under EP).
    - transformers' ``"deepgemm_megamoe"`` experts: load the DeepGEMM transformers runs
      (``kernel=None``: its kernels-hub build, SM100), or opt in to moewire's stand-in of that
      build (``kernel="stand-in"``: CPU or any GPU; :mod:`.megamoe` says exactly what is
      bypassed: transformers' SM100 assertion). The stand-in is used only when asked for.
    - Under transformers' expert parallelism (``model`` loaded with a ``DistributedConfig``
      with ``ep_size > 1``): every buffer spans the EP group and calibration reduces over
      the EP group and the data-parallel dimensions of the expert mesh (:mod:`.ep`).

    Args:
        model: a transformers model.
        mma_type: ``"moewire"`` experts: a build of ``kernel`` (:data:`KERNELS`); default its
            first: ``"bf16xbf16"`` for the stand-in, ``"fp8xfp8"`` for ``"deepgemm-sm90"``.
        max_num_tokens: ``"moewire"`` experts: tokens per kernel call (a longer batch is
            split).
        kernel: ``"moewire"`` experts: ``"stand-in"`` (``None``, the default) or
            ``"deepgemm-sm90"`` (DeepGEMM's real SM90 ``fp8_mega_moe``; the model on a
            Hopper GPU). ``"deepgemm_megamoe"`` experts: ``None`` (transformers' kernel) or
            ``"stand-in"``.
        group: the process group the ``"moewire"`` buffers span; default the EP group of a
            model transformers distributed, else one rank (``"deepgemm-sm90"``: a one-rank
            NCCL group, ``deepgemm_sm90.one_rank_group``).

    Returns:
        ``model``.

    Raises:
        ValueError: no experts module runs ``"moewire"`` or one of transformers' Mega-MoE
            implementations; a module's layout or activation is one the kernel cannot
            express; an unknown kernel or build (the message names the module).
        RuntimeError: ``"deepgemm-sm90"`` without a Hopper GPU or DeepGEMM's SM90 package;
            transformers' kernel without an SM100 GPU.
    """
    ours, theirs = experts_modules(model), site_modules(model)
    if not ours and not theirs:
        names = ", ".join(repr(n) for n in (IMPLEMENTATION, *(s.name for s in SITES)))
        raise ValueError(
            f"prepare: {type(model).__name__} has no experts module running "
            f"experts_implementation {names}; load it with from_pretrained(path, "
            f"experts_implementation={IMPLEMENTATION!r}) after register()"
        )
    ep_group, dp_groups = ep.mesh_groups(model)
    group = ep_group if group is None else group
    for name, module in ours:
        module.__dict__["_moewire_tf_name"] = name
        module.__dict__[megamoe.GROUPS] = (group, dp_groups)
        module.__dict__["_moewire_mega"] = _build_state(
            module, mma_type, max_num_tokens, kernel or "stand-in", group
        )
    by_site: dict[MegaMoeSite, list[tuple[str, nn.Module]]] = {}
    for name, module, site in theirs:
        module.__dict__["_moewire_tf_name"] = name
        module.__dict__[megamoe.GROUPS] = (ep_group, dp_groups)
        by_site.setdefault(site, []).append((name, module))
    for site, modules in by_site.items():
        _prepare_site(site, modules, mma_type, kernel)
    return model
