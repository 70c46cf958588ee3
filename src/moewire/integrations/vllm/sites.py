"""Where vLLM keeps its Mega-MoE experts, one declarative entry per site.

A site says what recognises a class (where it lives, the calls its source makes, how it
reaches DeepGEMM), how its forward stages the tokens (a staging global, or inline through
DeepGEMM's cast) and where its buffer is. Everything moewire does for vLLM is derived from
these entries (:mod:`moewire.integrations.vllm`: discovery, the bridge, the adapter); the
kernel side (which build, where its rows are) is ``moewire.megamoe.builds``. Adding a site
is one entry in :data:`SITES` (docs/architecture.md, "Adding a kernel build or a vLLM site").

One module for one idea, the site table: the entries, the structure each is recognised by
and the adapter built from one are read together when a site is added, so they stay in one
file although it passes 600 lines.

Sources read (vLLM repository ``vllm-project/vllm``; the commits are the stored versions):

- ``vllm/model_executor/layers/fused_moe/deep_gemm_mega_moe.py``: 0.33/0.34's
  ``DeepGemmMegaMoEExperts`` (released wheels); main (4083b32) has no experts class there
  any more but ``DeepGemmMegaMoEBackend`` / ``DeepGemmSm100MegaMoEBackend.run_mega_moe``
  (``y`` first, ``shared_l1_weights``/``shared_l2_weights`` and the activation arguments by
  keyword, DeepGEMM through ``_import_deep_gemm()``), as in 0.32.
- ``vllm/models/deepseek_v4/nvidia/model.py``: 0.32 (installed) stages with the global
  ``prepare_megamoe_inputs`` and calls ``backend.run_mega_moe``; two stored main versions
  (3296c77, 0101ca23) call ``deep_gemm.fp8_fp4_mega_moe`` on ``vllm.utils.deep_gemm``
  imported at module level, never ``_import_deep_gemm()``: that shape is refused (what the
  module-level name resolves to cannot be read here).
- ``vllm/models/deepseek_v4/nvidia/sm90_mega_moe.py`` (6cd8b6b):
  ``DeepseekV4MegaMoESM90Experts`` stages inline (``deep_gemm.utils.per_token_cast_to_fp8``
  then copies into ``symm_buffer.x``/``x_sf``/``topk_idx``/``topk_weights``) and calls
  ``deep_gemm.fp8_mega_moe_sm90``; buffer from ``get_symm_buffer()``.
- ``vllm/model_executor/layers/fused_moe/experts/deep_gemm_mega_moe.py`` (13f9685):
  gpt-oss's ``DeepGemmMegaExperts`` (a modular experts object, no ``nn.Module``) stages
  inline with ``per_token_cast_to_fp8(gran_k=32)`` on ``import deep_gemm`` and calls
  ``deep_gemm.fp8_fp4_mega_moe`` on ``self.buffer``; the ``nn.Module`` holding it is the
  MoE layer, ``RoutedExperts`` (``fused_moe/routed_experts.py``, a ``PluggableLayer``; 0.32
  installed, and main's quantization methods type their layer so), through
  ``quant_method.moe_kernel.fused_experts`` (0.32's ``eep_reconfigure.py`` reads that path).
- ``vllm/models/common/deep_gemm_mega_moe.py`` (6dfb263): ``DeepGemmMegaMoEExperts`` for FP4
  or BF16 expert weights. ``mma_type="fp8xfp4"`` stages with the global
  ``prepare_megamoe_inputs`` (imported from ``vllm.models.deepseek_v4.nvidia.ops.
  prepare_megamoe``); ``mma_type="bf16xbf16"`` stages with a plain copy,
  ``symm_buffer.x[:num_tokens].copy_(hidden_states)``, which no staging hook sees: the site's
  :class:`PlainCopy` makes the forward's own ``hidden_states`` argument the dispatch hook,
  once :func:`prove_plain_copy` has read from the forward's AST that the argument feeds
  nothing but that copy (and the staging call of the other branch). The kernel is a local
  name (``kernel = deep_gemm.bf16_mega_moe if ... else deep_gemm.fp8_fp4_mega_moe``).
- ``vllm/models/deepseek_v32/nvidia/mega_moe.py`` (30a3a7a): ``DeepseekV32MegaMoEExperts``
  (DeepSeek V3.2, GLM-5.2 NVFP4) stages with the global ``prepare_megamoe_nvfp4_inputs``
  (``.ops.prepare_megamoe_nvfp4``, 05be1d5) into an ``mma_type="fp4xfp4"`` buffer and calls
  ``deep_gemm.fp4_fp4_mega_moe(y, l1, l2, buf, l1_alphas=, l2_alphas=)``: quantized where
  the DeepGEMM is 2.8.0 (``deepgemm-2.8``, vLLM main's pin), refused on vLLM 0.33/0.34's
  bundled kernel of that name (``moewire.megamoe.builds``).
- ``vllm/model_executor/layers/quantization/modelopt.py`` (a stored main version; its commit
  is not recorded here): ``ModelOptNvFp4MegaMoE``, the quant method of a ModelOpt NVFP4
  ``RoutedExperts`` layer with ``--moe-backend deep_gemm_mega_moe``: ``apply(layer, x, ...)``
  stages with the global ``prepare_nvfp4_megamoe_inputs(x, a1_gscale, topk_weights,
  topk_ids, x, x_sf, topk_idx, topk_weights, is_padding=)`` (``fused_moe/prepare_megamoe.py``)
  and calls ``self._deep_gemm.fp4_fp4_mega_moe(y, l1, l2, self._symm_buffer, ...,
  a2_scales=, routed_scaling_factor=, shared_l1_weights=, shared_l2_weights=, x_bf16=)``
  (a fused BF16 shared expert where ``mk_fuses_shared_experts``); the DeepGEMM module is the
  one ``_import_deep_gemm()`` returned at weight loading.
- ``vllm/models/deepseek_v4/nvidia/fi_moe.py`` (055e47c): ``DeepseekV4MegaMoEExpertsFI``, a
  subclass of ``DeepseekV4MegaMoEExperts`` that stages through FlashInfer
  (``kernel.stage_inputs(..., quantize_input=True)``) and runs its ``moe_ep`` megakernel:
  recognised (it imports ``flashinfer.moe_ep`` with ``from ... import`` inside the forward)
  and refused (:data:`FLASHINFER_REFUSAL`).
- ``vllm/models/kimi_k3/nvidia/model.py`` (ed51064; 006193b holds the same experts class):
  main's ``KimiK3MegaMoEExperts`` stages with the global ``prepare_megamoe_inputs`` on the
  latent tokens and calls ``_import_deep_gemm().fp8_fp4_mega_moe(..., activation_beta=,
  activation_linear_beta=)`` itself (vllm-project/DeepGEMM's 2.6.1 SiTU spelling); vLLM 0.32's
  class calls it through the backend (``run_mega_moe(``): one entry each, told apart by the
  call.
- ``vllm/models/kimi_k3/nvidia/fi_moe.py`` (a48554, 4cfcde0):
  ``KimiK3FlashInferMegaMoEExperts``, a subclass of the above running FlashInfer's
  ``moe_ep`` (``MoEEpTensors`` imported inside the forward): recognised and refused.
- ``vllm/models/deepseek_v4/amd/mega_moe_experts.py`` with ``mega_moe_runtime.py`` (ed837da)
  and ``amd/mega_moe.py`` (7a6d2f8, also in vLLM 0.32): aiter's ``MegaMoEV2`` on ROCm
  (``--moe-backend flydsl_mega_moe``); the first class is named ``DeepseekV4MegaMoEExperts``
  like the NVIDIA one and is told apart by its module (it imports aiter, stages nothing for
  DeepGEMM): recognised and refused (:data:`AITER_REFUSAL`).
- ``vllm/model_executor/layers/fused_moe/experts/flashinfer_moe_ep.py`` (vLLM 0.34.0 wheel;
  main 33f1263): ``FlashInferMoeEpExperts``, a modular experts object (no ``nn.Module``,
  held by the MoE layer like gpt-oss's) for NVFP4 or MXFP4 weights with
  ``--moe-backend flashinfer_moe_ep_cutedsl`` or ``flashinfer_moe_ep_mega_deep_gemm``.
  ``process_weights_after_loading`` builds ``FlashInferMoeEp`` of
  ``fused_moe/flashinfer_moe_ep.py`` (0.34.0; main 2525892), which imports
  ``flashinfer.moe_ep`` inside a method (``from ... import``) and runs ``MoEEpMegaLayer``
  with ``MegaConfig(quantize_input=True)``; ``apply`` hands it the BF16 ``hidden_states``:
  recognised and refused (:data:`FLASHINFER_EP_EXPERTS_REFUSAL`).
- ``vllm/foundation/utilities/deep_gemm.py`` (055e47c): main's new home of
  ``_import_deep_gemm`` (:data:`ACCESS_MODULES`); ``fi_moe.py`` imports
  ``vllm.foundation...`` and ``vllm.runtime...``: a class is looked up at every path of its
  entry (``also_at``) and recognised by its own module's source, wherever it is defined.

May import: the standard library, torch, ``moewire.integrations._host`` and
``moewire.megamoe.registry`` (nothing of vLLM).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from moewire.integrations._host import SourceReach, source_reach
from moewire.megamoe.builds import AITER_MEGAMOE_V2
from moewire.megamoe.registry import ExpertsAdapter

__all__ = [
    "ACCESS_MODULES",
    "AITER_ACCESS",
    "AITER_REFUSAL",
    "FLASHINFER_ACCESS",
    "FLASHINFER_EP_EXPERTS_REFUSAL",
    "FLASHINFER_REFUSAL",
    "IMPORT_ACCESS",
    "KERNEL_ACCESS",
    "MODELOPT_NVFP4_STAGE_FN",
    "NVFP4_STAGE_FN",
    "REFUSED_ACCESSES",
    "SITES",
    "STAGE_FN",
    "ExpertsSite",
    "PlainCopy",
    "holder_class",
    "prove_plain_copy",
    "recognise",
    "site_adapter",
]

STAGE_FN = "prepare_megamoe_inputs"
NVFP4_STAGE_FN = "prepare_megamoe_nvfp4_inputs"
#: vLLM main's ModelOpt NVFP4 quant method stages with this one (a global input scale).
MODELOPT_NVFP4_STAGE_FN = "prepare_nvfp4_megamoe_inputs"
#: vLLM's call-time DeepGEMM lookup (``vllm.utils.deep_gemm._import_deep_gemm``).
KERNEL_ACCESS = "_import_deep_gemm"
#: A forward that imports DeepGEMM itself (gpt-oss's modular experts).
IMPORT_ACCESS = "import deep_gemm"
#: A forward that runs FlashInfer's ``moe_ep`` megakernel (no DeepGEMM call moewire hooks).
FLASHINFER_ACCESS = "flashinfer.moe_ep"
#: A forward that runs aiter's ``MegaMoEV2`` (FlyDSL, ROCm; no DeepGEMM call moewire hooks).
AITER_ACCESS = "aiter.ops.flydsl.kernels.mega_moe"
#: Accesses of kernels moewire recognises only to refuse: reached when the module (or an
#: access module) imports the package, with ``import`` or ``from ... import``.
REFUSED_ACCESSES = (FLASHINFER_ACCESS, AITER_ACCESS)
#: Where vLLM keeps ``_import_deep_gemm``: 0.32 to 0.34 and main until the move, then main's
#: ``vllm/foundation/utilities/deep_gemm.py`` (055e47c). The bridge rebinds it in each that
#: imports.
ACCESS_MODULES = ("vllm.utils.deep_gemm", "vllm.foundation.utilities.deep_gemm")

#: Why moewire refuses FlashInfer's ``moe_ep`` megakernel, and what to switch to.
FLASHINFER_REFUSAL = (
    "it runs FlashInfer's moe_ep megakernel (--moe-backend flashinfer_moe_ep_mega_*; "
    "flashinfer-python 0.7.2.post1: "
    "moe_ep/backends/mega/kernel/sm100/*/backend.py), whose workspace keeps no "
    "per-(token, slot) combine rows moewire can read: the cutedsl megakernels reduce the "
    "top-k rows in the kernel (in-flight cross-rank atomic adds with "
    "enable_in_kernel_fc2_reduce, in an order that is not deterministic) or, only with "
    "defer_topk_reduce, in a view whose shape and offset come from the compiled kernel's "
    "descriptor (deferred_topk_reduce_region), not from a layout moewire can check. Serve "
    "with --moe-backend deep_gemm_mega_moe (DeepseekV4MegaMoEExperts, KimiK3MegaMoEExperts, "
    "which moewire quantizes), or use FlashInfer's own quantized combine wire "
    "(combine_dtype='mxfp8' or 'nvfp4' of its nvfp4 cutedsl megakernel) unquantized by "
    "moewire"
)

#: Why moewire refuses vLLM's FlashInfer MoE-EP modular experts, and what to switch to.
FLASHINFER_EP_EXPERTS_REFUSAL = (
    "it runs FlashInfer's moe_ep megakernel through vLLM's modular experts "
    "FlashInferMoeEpExperts (--moe-backend flashinfer_moe_ep_cutedsl or "
    "flashinfer_moe_ep_mega_deep_gemm; vllm/model_executor/layers/fused_moe/experts/"
    "flashinfer_moe_ep.py and fused_moe/flashinfer_moe_ep.py, vLLM 0.34.0 and main 33f1263): "
    "apply() hands the BF16 tokens to MoEEpMegaLayer with MegaConfig(quantize_input=True), "
    "so FlashInfer quantizes them in its own staging kernel (fused_quant_stage, "
    "flashinfer-python 0.7.2.post1: moe_ep/backends/mega/kernel/sm100/*/staging.py), no "
    "staging call moewire hooks, and the megakernel returns the output already reduced "
    "over the top-k slots (combine_dtype='bf16', the in-kernel FC2 reduce off: TopkReduce "
    "in the kernel), so no per-(token, slot) combine rows are left to read. "
    "Serve with --moe-backend deep_gemm_mega_moe (ModelOptNvFp4MegaMoE for NVFP4 "
    "checkpoints, DeepGemmMegaExperts for MXFP4 ones, which moewire quantizes), or leave "
    "these layers unquantized (disable both quantizers)"
)

#: Why moewire refuses aiter's ``MegaMoEV2`` (ROCm), and what to switch to.
AITER_REFUSAL = (
    "it runs aiter's MegaMoEV2 (FlyDSL, ROCm; --moe-backend flydsl_mega_moe, vLLM PR #51918): "
    f"{AITER_MEGAMOE_V2}. Serve with "
    "--moe-backend deep_gemm_mega_moe on an NVIDIA SM100 GPU (DeepseekV4MegaMoEExperts of "
    "vllm/models/deepseek_v4/nvidia/model.py, which moewire quantizes), or leave these "
    "layers unquantized (disable both quantizers)"
)


@dataclass(frozen=True)
class PlainCopy:
    """A forward branch that stages the tokens with a plain copy into the buffer.

    vLLM main's ``DeepGemmMegaMoEExperts`` (``vllm/models/common/deep_gemm_mega_moe.py``,
    6dfb263) stages ``mma_type="bf16xbf16"`` with ``symm_buffer.x[:n].copy_(hidden_states)``:
    no staging function or cast ever sees the tokens. moewire then quantizes the forward's
    own ``hidden_states`` argument (out of place: the caller keeps its tokens), which is the
    staging hook of that branch, where :func:`prove_plain_copy` shows from the forward's
    AST that the argument feeds nothing else that a quantized value would change.

    Attributes:
        attr: the attribute of the experts object that selects the branch (``"mma_type"``).
        value: its value on the plain-copy branch (``"bf16xbf16"``).
        arg: the forward's parameter holding the tokens (``"hidden_states"``).
        view: the buffer view the copy writes (``"x"``).
    """

    attr: str
    value: str
    arg: str = "hidden_states"
    view: str = "x"

    def taken(self, experts: Any) -> bool:
        """Whether ``experts`` takes the plain-copy branch."""
        return getattr(experts, self.attr, None) == self.value


@dataclass(frozen=True)
class ExpertsSite:
    """One vLLM Mega-MoE experts class and the structure moewire hooks.

    Attributes:
        module: the module defining the class.
        cls_name: the class name.
        stage_fn: the staging global its forward calls (``hidden_states`` first), or
            ``None`` for a forward that stages inline through DeepGEMM's cast
            (``stage_cast``), hooked on the DeepGEMM module object.
        read_from: the vLLM versions the site was read from (messages only).
        extra_stage_fns: staging globals of other kernels the same forward may call.
        stage_cast: the DeepGEMM cast an inline-staging forward calls.
        calls: further calls the module's source must make (``"run_mega_moe("``): the
            structure that tells this shape from another at the same path.
        kernel_access: how the forward reaches DeepGEMM: :data:`KERNEL_ACCESS` (vLLM's
            call-time lookup, which the bridge rebinds) or :data:`IMPORT_ACCESS`.
        access_modules: other modules whose source may hold the access (the backend the
            forward calls).
        buffer: ``"name()"`` (a method of the experts object) or ``"name"`` (an attribute).
        holder: for an experts object that is no ``nn.Module``: the attribute path from the
            ``nn.Module`` holding it (``"quant_method.moe_kernel.fused_experts"``).
        holder_class: ``"module:Class"`` of that ``nn.Module`` (the class moewire converts;
            only its instances whose ``holder`` is one of these experts objects).
        group: the process group the kernel's buffer spans, over which calibrated amaxes
            are max-reduced: ``"ep"`` (vLLM's EP group) or ``"dp"`` (gpt-oss's buffer is on
            ``get_dp_group()``).
        also_at: further modules that may define or re-export the class (vLLM moves its
            packages); the class is recognised by its own module (``cls.__module__``).
        plain_copy: the forward branch that stages with a plain copy (:class:`PlainCopy`),
            or ``None``.
        refusal: why moewire refuses this class although it recognises it (and what to
            switch to), or ``None``; a refused site needs no staging.
        fused_shared_attr: the experts object's attribute saying a shared expert is fused
            into the kernel (``has_fused_shared_experts``; ModelOpt's NVFP4 quant method
            says ``mk_fuses_shared_experts``).
    """

    module: str
    cls_name: str
    stage_fn: str | None = STAGE_FN
    read_from: str = ""
    extra_stage_fns: tuple[str, ...] = ()
    stage_cast: str | None = None
    calls: tuple[str, ...] = ()
    kernel_access: str = KERNEL_ACCESS
    access_modules: tuple[str, ...] = ()
    buffer: str = "get_symm_buffer()"
    holder: str | None = None
    holder_class: str | None = None
    group: str = "ep"
    also_at: tuple[str, ...] = ()
    plain_copy: PlainCopy | None = None
    refusal: str | None = None
    fused_shared_attr: str = "has_fused_shared_experts"

    def __post_init__(self) -> None:
        if (self.holder is None) != (self.holder_class is None):
            raise ValueError(
                f"ExpertsSite {self.path}: holder and holder_class go together (an experts "
                "object that is no nn.Module, and the nn.Module class that holds it)"
            )
        if self.group not in ("ep", "dp"):
            raise ValueError(f"ExpertsSite {self.path}: group must be 'ep' or 'dp'")
        accesses = (KERNEL_ACCESS, IMPORT_ACCESS, *REFUSED_ACCESSES)
        if self.kernel_access not in accesses:
            raise ValueError(
                f"ExpertsSite {self.path}: kernel_access must be one of {accesses}, got "
                f"{self.kernel_access!r}"
            )
        if self.kernel_access in REFUSED_ACCESSES and self.refusal is None:
            raise ValueError(
                f"ExpertsSite {self.path}: a site reaching {self.kernel_access} has no DeepGEMM "
                "call to hook; give its refusal"
            )
        if self.refusal is None and (self.stage_fn is None) == (self.stage_cast is None):
            raise ValueError(
                f"ExpertsSite {self.path}: give a staging function (stage_fn) or an inline "
                "staging cast (stage_cast), exactly one"
            )

    @property
    def path(self) -> str:
        return f"{self.module}.{self.cls_name}"

    @property
    def modules(self) -> tuple[str, ...]:
        """Every module the class is looked up in (:attr:`module` first)."""
        return (self.module, *self.also_at)

    @property
    def stage_fns(self) -> tuple[str, ...]:
        """Every staging global of the forward (none for inline staging)."""
        return () if self.stage_fn is None else (self.stage_fn, *self.extra_stage_fns)

    def experts_of(self, module: nn.Module) -> Any:
        """The experts object of ``module`` (itself, or the one at :attr:`holder`)."""
        obj: Any = module
        for part in (self.holder or "").split(".") if self.holder else ():
            obj = getattr(obj, part, None)
        return obj

    def get_symm_buffer(self, module: nn.Module) -> Any:
        """The buffer the kernel of ``module`` reads (:attr:`buffer` of its experts)."""
        experts = self.experts_of(module)
        if self.buffer.endswith("()"):
            return getattr(experts, self.buffer[:-2])()
        return getattr(experts, self.buffer)

    def describe(self) -> str:
        staging = (
            f"calling {self.stage_fn}(...)"
            if self.stage_fn is not None
            else f"staging inline with deep_gemm...{self.stage_cast}(...)"
            if self.stage_cast is not None
            else "staging elsewhere"
        )
        calls = "".join(f", calling {c}...)" for c in self.calls)
        return (
            f"{self.path} {staging}{calls} and its kernel through {self.kernel_access}"
            f"{'()' if self.kernel_access == KERNEL_ACCESS else ''} (read from vLLM "
            f"{self.read_from or '?'})"
        )


_MEGA = "vllm.model_executor.layers.fused_moe.deep_gemm_mega_moe"
_KIMI_K3 = "vllm.models.kimi_k3.nvidia.model"

SITES: tuple[ExpertsSite, ...] = (
    # vLLM 0.33, 0.34.
    ExpertsSite(_MEGA, "DeepGemmMegaMoEExperts", read_from="0.33, 0.34",
                extra_stage_fns=(NVFP4_STAGE_FN,)),
    # The backend shape: vLLM 0.32 and main's DeepGemmMegaMoEBackend.run_mega_moe.
    ExpertsSite("vllm.models.deepseek_v4.nvidia.model", "DeepseekV4MegaMoEExperts",
                read_from="0.32, main (backend)", calls=("run_mega_moe(",),
                access_modules=(_MEGA,)),
    ExpertsSite(_KIMI_K3, "KimiK3MegaMoEExperts", read_from="0.32",
                calls=("run_mega_moe(",), access_modules=(_MEGA,)),
    # vLLM main on Hopper: inline staging, the fork's kernel.
    ExpertsSite("vllm.models.deepseek_v4.nvidia.sm90_mega_moe", "DeepseekV4MegaMoESM90Experts",
                stage_fn=None, stage_cast="per_token_cast_to_fp8", read_from="main",
                calls=("fp8_mega_moe_sm90(",)),
    # vLLM main, gpt-oss's modular experts (MXFP4 weights): held by the MoE layer.
    ExpertsSite("vllm.model_executor.layers.fused_moe.experts.deep_gemm_mega_moe",
                "DeepGemmMegaExperts", stage_fn=None, stage_cast="per_token_cast_to_fp8",
                read_from="main", calls=("fp8_fp4_mega_moe(",), kernel_access=IMPORT_ACCESS,
                buffer="buffer", holder="quant_method.moe_kernel.fused_experts",
                holder_class="vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts",
                group="dp"),
    # vLLM main's common experts: fp8xfp4 through the staging global, bf16xbf16 by a copy.
    ExpertsSite("vllm.models.common.deep_gemm_mega_moe", "DeepGemmMegaMoEExperts",
                read_from="main (6dfb263)", calls=("bf16_mega_moe", "fp8_fp4_mega_moe"),
                plain_copy=PlainCopy("mma_type", "bf16xbf16")),
    # vLLM main's NVFP4 x NVFP4 experts (DeepSeek V3.2, GLM-5.2) on DeepGEMM 2.8.0.
    ExpertsSite("vllm.models.deepseek_v32.nvidia.mega_moe", "DeepseekV32MegaMoEExperts",
                stage_fn=NVFP4_STAGE_FN, read_from="main (30a3a7a)",
                calls=("fp4_fp4_mega_moe(",)),
    # vLLM main's ModelOpt NVFP4 quant method on the same kernel: held by the MoE layer.
    ExpertsSite("vllm.model_executor.layers.quantization.modelopt", "ModelOptNvFp4MegaMoE",
                stage_fn=MODELOPT_NVFP4_STAGE_FN, read_from="main (modelopt.py)",
                calls=("fp4_fp4_mega_moe(",), buffer="_symm_buffer", holder="quant_method",
                holder_class="vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts",
                fused_shared_attr="mk_fuses_shared_experts"),
    # vLLM main's FlashInfer megakernel experts: recognised, refused.
    ExpertsSite("vllm.models.deepseek_v4.nvidia.fi_moe", "DeepseekV4MegaMoEExpertsFI",
                stage_fn=None, read_from="main (055e47c)", calls=("stage_inputs(",),
                kernel_access=FLASHINFER_ACCESS, refusal=FLASHINFER_REFUSAL),
    # vLLM main's Kimi-K3 on DeepGEMM, calling the kernel itself (no backend): SiTU spelled
    # activation_beta/activation_linear_beta, its own buffer cache, a first-launch barrier.
    ExpertsSite(_KIMI_K3, "KimiK3MegaMoEExperts", read_from="main (ed51064, 006193b)",
                calls=("fp8_fp4_mega_moe(",)),
    # Kimi-K3 on FlashInfer's moe_ep: a subclass of the Kimi-K3 experts above whose forward
    # runs the megakernel (its in-kernel FC2 reduce on).
    ExpertsSite("vllm.models.kimi_k3.nvidia.fi_moe", "KimiK3FlashInferMegaMoEExperts",
                stage_fn=None, read_from="main (a48554, 4cfcde0)", calls=("MoEEpTensors(",),
                kernel_access=FLASHINFER_ACCESS, refusal=FLASHINFER_REFUSAL),
    # vLLM 0.34 and main: FlashInfer's MoE-EP megakernel as modular experts, held by the
    # MoE layer (NVFP4 or MXFP4 weights); the kernel is reached through the adapter module.
    ExpertsSite("vllm.model_executor.layers.fused_moe.experts.flashinfer_moe_ep",
                "FlashInferMoeEpExperts", stage_fn=None, read_from="0.34, main (33f1263)",
                calls=("FlashInferMoeEp(",), kernel_access=FLASHINFER_ACCESS,
                access_modules=("vllm.model_executor.layers.fused_moe.flashinfer_moe_ep",),
                holder="quant_method.moe_kernel.fused_experts",
                holder_class="vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts",
                refusal=FLASHINFER_EP_EXPERTS_REFUSAL),
    # vLLM main on ROCm (--moe-backend flydsl_mega_moe): aiter's MegaMoEV2, refused. The
    # first class has the NVIDIA class's name; it is told apart by its module.
    ExpertsSite("vllm.models.deepseek_v4.amd.mega_moe_experts", "DeepseekV4MegaMoEExperts",
                stage_fn=None, read_from="main (ed837da)", calls=("bind_weights(",),
                kernel_access=AITER_ACCESS,
                access_modules=("vllm.models.deepseek_v4.amd.mega_moe_runtime",),
                refusal=AITER_REFUSAL),
    ExpertsSite("vllm.models.deepseek_v4.amd.mega_moe", "DeepseekV4AiterMegaMoEExperts",
                stage_fn=None, read_from="main (7a6d2f8)", calls=("MegaMoEV2(",),
                kernel_access=AITER_ACCESS, refusal=AITER_REFUSAL),
)

#: Uses of the tokens' parameter that read only its metadata.
_METADATA_ATTRS = frozenset({"shape", "dtype", "device", "size", "dim"})
#: Calls whose first argument contributes only its metadata.
_METADATA_CALLS = frozenset({"empty_like", "zeros_like", "ones_like"})


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _plain_copy_use(node: ast.Name, parent: ast.AST, plain: PlainCopy,
                    stage_fns: tuple[str, ...]) -> str | None:
    """``"copy"``/``"staging"``/``"metadata"`` for an allowed use of the tokens, else None."""
    if isinstance(parent, ast.Attribute) and parent.attr in _METADATA_ATTRS:
        return "metadata"
    if not isinstance(parent, ast.Call) or node not in parent.args:
        return None
    first = parent.args[0] is node
    name = _call_name(parent)
    if first and name in _METADATA_CALLS:
        return "metadata"
    if first and name in stage_fns:
        return "staging"
    func = parent.func
    if (name == "copy_" and len(parent.args) == 1 and isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Subscript)
            and isinstance(func.value.value, ast.Attribute)
            and func.value.value.attr == plain.view):
        return "copy"
    return None


def prove_plain_copy(cls: type, plain: PlainCopy, stage_fns: tuple[str, ...] = ()) -> str | None:
    """Why the forward's tokens may feed more than the plain staging copy, or None.

    Read from the AST of ``cls.forward``: the parameter ``plain.arg`` is never rebound, and
    each use of it is one of: its metadata (``.shape``, ``.dtype``, ``.device``,
    ``.size()``, ``.dim()``, ``torch.empty_like(arg, ...)``); the single argument of a copy
    into a slice of the buffer view ``plain.view`` (``symm_buffer.x[:n].copy_(arg)``, at
    least one); or the first argument of a staging function of ``stage_fns`` (the other
    branch: moewire refuses a forward that reaches both). Then replacing the argument by
    its quantized copy changes exactly the staged tokens: the router and an unfused shared
    expert see the caller's tensor, outside this forward.

    Args:
        cls: the experts class.
        plain: the site's plain-copy branch.
        stage_fns: the site's staging globals.
    """
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, AttributeError) as exc:
        return f"the source of {cls.__qualname__}.forward cannot be read ({exc})"
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef):
        return f"{cls.__qualname__}.forward is not a plain function"
    params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]
    if plain.arg not in params:
        return f"{cls.__qualname__}.forward has no parameter {plain.arg!r}"
    parents = {child: node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}
    copies = 0
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Name) and node.id == plain.arg):
            continue
        if not isinstance(node.ctx, ast.Load):
            return f"{cls.__qualname__}.forward rebinds {plain.arg} (line {node.lineno})"
        use = _plain_copy_use(node, parents[node], plain, stage_fns)
        if use is None:
            return (
                f"{cls.__qualname__}.forward uses {plain.arg} in "
                f"`{ast.unparse(parents[node])}` (line {node.lineno}), not only in the staging "
                f"copy into .{plain.view}[...]"
            )
        copies += use == "copy"
    if copies == 0:
        return f"{cls.__qualname__}.forward never copies {plain.arg} into .{plain.view}[...]"
    return None


def _reaches(reach: SourceReach, access: str) -> bool:
    """Whether a module's source reaches its kernel through ``access``: calls
    :data:`KERNEL_ACCESS`, imports ``deep_gemm`` (:data:`IMPORT_ACCESS`), or imports the
    package of a refused kernel (:data:`REFUSED_ACCESSES`, ``from ... import`` included:
    vLLM imports ``MoEEpTensors`` from ``flashinfer.moe_ep`` inside the forward)."""
    if access == IMPORT_ACCESS:
        return reach.imports_module(IMPORT_ACCESS.split()[1])
    if access in REFUSED_ACCESSES:
        return reach.imports_module(access, from_imports=True)
    return reach.calls(f"{access}(")


def recognise(cls: Any, site: ExpertsSite) -> str | None:
    """Why ``cls`` lacks the structure moewire hooks at ``site``, or None if it has it.

    The structure: an ``nn.Module`` class (any class for a ``holder`` site) whose module has
    and calls each staging global, or calls the staging cast; makes every call of
    ``site.calls``; and reaches DeepGEMM as ``site.kernel_access`` says (in its own source
    or one of ``site.access_modules``'). Calls and imports are read from the module's syntax
    tree: a function that is only defined, or named in a comment or a string, is not called.
    Versions play no part.
    """
    if not isinstance(cls, type) or (site.holder is None and not issubclass(cls, nn.Module)):
        return f"{site.path} is not an nn.Module class"
    module = importlib.import_module(cls.__module__)
    for fn in site.stage_fns:
        if not callable(getattr(module, fn, None)):
            return f"{cls.__module__} has no staging function {fn}"
    reach = source_reach(cls.__module__)
    if reach is None:
        return f"the source of {cls.__module__} cannot be read"
    wanted = [f"{fn}(" for fn in site.stage_fns[:1]] + (
        [f".{site.stage_cast}("] if site.stage_cast else []
    ) + list(site.calls)
    for call in wanted:
        if not reach.calls(call):
            return f"{cls.__module__} never calls {call.lstrip('.')}...)"
    reaches = [reach, *(r for r in map(source_reach, site.access_modules) if r)]
    if not any(_reaches(r, site.kernel_access) for r in reaches):
        return f"{cls.__module__} does not reach DeepGEMM through {site.kernel_access}" + (
            "()" if site.kernel_access == KERNEL_ACCESS else ""
        )
    return None


def holder_class(site: ExpertsSite) -> type:
    """The ``nn.Module`` class of a holder site (``site.holder_class``), imported.

    Raises:
        RuntimeError: it does not import, or is no ``nn.Module`` class.
    """
    module_name, _, name = (site.holder_class or "").partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(
            f"{site.path}: its experts object is held by {site.holder_class}, which this vLLM "
            f"lacks ({exc}); moewire cannot convert the layer holding it"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise RuntimeError(f"{site.path}: {site.holder_class} is not an nn.Module class")
    return cls


def holder_predicate(site: ExpertsSite, cls: type) -> Callable[[nn.Module], bool]:
    """``module -> bool``: the module holds an instance of ``cls`` at ``site.holder``."""

    def holds(module: nn.Module) -> bool:
        return isinstance(site.experts_of(module), cls)

    return holds


def site_adapter(
    site: ExpertsSite,
    cls: type,
    *,
    forward_module: str,
    stage_globals: tuple[str, ...],
    flavour: Callable[[nn.Module], str],
    ep_group: Callable[[nn.Module], Any],
    runtime: Callable[[], str],
    kernel_ns: str = "deep_gemm",
    get_symm_buffer: Callable[[nn.Module], Any] | None = None,
) -> ExpertsAdapter:
    """The experts adapter of ``cls`` at ``site``.

    Args:
        site: the site entry.
        cls: the experts class found there.
        forward_module: the module whose globals hold the staging functions and the
            DeepGEMM namespace (``moewire.integrations.vllm.bridge`` under vLLM; the
            class's own module for a class written to the same contract).
        stage_globals: the names of the staging globals there, in ``site.stage_fns``
            order (none for inline staging).
        flavour, ep_group, runtime: as :class:`~moewire.megamoe.registry.ExpertsAdapter`.
        kernel_ns: the DeepGEMM namespace global there.
        get_symm_buffer: overrides ``site.get_symm_buffer`` (a wrapper that refuses a
            debug setting, say).
    """
    stage: str | tuple[str, ...] = (
        stage_globals[0] if len(stage_globals) == 1 else tuple(stage_globals)
    )
    forward_dispatch = None
    if site.plain_copy is not None:
        forward_dispatch = _plain_copy_dispatch(site, site.plain_copy, cls)
    return ExpertsAdapter(
        name=f"vllm-{site.cls_name}",
        forward_module=forward_module,
        stage_fn=stage,
        stage_hidden_arg=0,
        kernel_ns=kernel_ns,
        get_symm_buffer=get_symm_buffer or site.get_symm_buffer,
        flavour=flavour,
        fused_shared=lambda m: bool(
            getattr(site.experts_of(m), site.fused_shared_attr, False)
        ),
        ep_group=ep_group,
        runtime=runtime,
        applies=holder_predicate(site, cls) if site.holder else None,
        forward_dispatch=forward_dispatch,
        refusal=site.refusal,
    )


def _plain_copy_dispatch(
    site: ExpertsSite, plain: PlainCopy, cls: type
) -> Callable[[nn.Module], str | None]:
    """``module -> "hidden_states" | None``: the forward's argument to quantize when the
    module takes the plain-copy branch; raises there if :func:`prove_plain_copy` failed."""
    unproven = prove_plain_copy(cls, plain, site.stage_fns)

    def dispatch(module: nn.Module) -> str | None:
        if not plain.taken(site.experts_of(module)):
            return None
        if unproven is not None:
            raise RuntimeError(
                f"{site.path}: with {plain.attr}={plain.value!r} the forward stages the tokens "
                f"with a plain copy into .{plain.view}, which no hook sees, and moewire "
                f"quantizes its {plain.arg} argument instead only where the source proves "
                f"that argument feeds nothing else; here {unproven}. Disable "
                f"dispatch_quantizer, or serve with {plain.attr} other than {plain.value!r}"
            )
        return plain.arg

    return dispatch
