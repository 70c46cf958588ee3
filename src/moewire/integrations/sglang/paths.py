"""SGLang's Mega-MoE paths that have no site entry, refused at load with the path's name.

With a recipe set, :func:`moewire.integrations.sglang.quantize_sglang_model` reads every
module of the loaded model before it quantizes anything: a module that runs on a Mega-MoE
path moewire has no site for is refused there, with the path and the fix, never after
warm-up (where the fail-closed check of the first forward would be the first sign) and
never as BF16 output that looks quantized. Each path is one declarative entry: how SGLang
marks a layer that runs on it (the attribute its own weight preparation sets, or its own
selection function) and what moewire cannot see there.

Sources read (the sglang 0.5.23 wheel, and the libraries each path calls):

- ``sglang/srt/layers/moe/flashinfer_megamoe.py`` (``run_flashinfer_megamoe``, the
  ``flashinfer_megamoe`` runner; every ``prepare_*_moe_weights_for_flashinfer_megamoe`` sets
  ``_flashinfer_megamoe_layer`` through ``_init_flashinfer_megamoe_layer_state``, the attribute
  SGLang's own ``warmup_all_flashinfer_megamoe_layers`` reads) and
  ``flashinfer_megamoe_autotune.py`` (``MegaMoeTunedForward``, the same layer's forward
  under tuned knobs). FlashInfer 0.7.2.post1, ``moe_ep/modes/mega_layer.py``:
  ``MoEEpMegaLayer.forward`` stages the tokens (``stage_inputs``: its own cast to the
  config's format) and launches one megakernel (``compute_staged``). The combine
  (``kernel_src/sm100/cutedsl_megamoe/src/moe_nvfp4_swapab/megamoe_kernel.py``): peers write
  one cell per (token, top-k slot) into the workspace's internal ``combine_quant`` region
  (BF16, or MXFP8 / NVFP4 codes per ``SGLANG_FLASHINFER_MEGAMOE_COMBINE_DTYPE``) and a tail
  reduce sums them; with ``SGLANG_FLASHINFER_MEGAMOE_IN_KERNEL_FC2_REDUCE=1`` the slots are
  added in flight by atomics in no fixed order.
- ``sglang/srt/layers/moe/mega_moe_flydsl.py``: on ROCm with
  ``SGLANG_AMD_USE_FLYDSL_MEGA_MOE=1`` (``mega_moe._use_amd_flydsl_mega_moe``) the layer's
  weights are built by its ``build_mega_moe_experts_weights`` (which sets
  ``_mega_moe_weights_built`` as the DeepGEMM path does, and ``_mega_w1``), and
  ``forward_mega_moe`` runs aiter's ``MegaMoEV2.forward(x, topk_weights, topk_ids)``. aiter
  (ROCm/aiter main at 03447f9; SGLang pins no aiter), ``ops/flydsl/kernels/mega_moe/
  intra_node.py``: ``forward`` casts the tokens to FP8 E4M3 with a scale per 32 columns
  (``per_1x32_mx_quant``), stage 1 sends them over MoRI shared memory, stage 2 writes each
  (token, top-k slot) row into the combine op's peer input, in BF16 or, when the config
  chosen for the token count says ``p2p_quant="fp8_blockwise_1x32"``
  (``mega_moe_config.py``), in FP8 with a scale per 32 columns, and ``combine_no_stage1``
  sums them; EP16 runs ``inter_node.py`` (A4W4) instead.
- ``sglang/srt/layers/muse_spark/muse_spark_megamoe.py`` (``forward_megamoe``, the Muse Spark
  model's layernorm-SP prefill): ``build_nvfp4_megamoe_weights`` / ``build_bf16_megamoe_weights``
  set ``_megamoe_metadata_prepared``; it stages with ``deep_gemm.mega_moe_pre_dispatch`` or a
  plain copy into its own buffer cache (``_MEGAMOE_SYMM_BUFFERS``) and calls
  ``deep_gemm.nvfp4_mega_moe`` / ``bf16_mega_moe`` (``weight_layout="trtllm"``) with
  ``post_expert_norm``: the kernel RMS-normalises each expert row at combine time, before the
  route-weighted sum, so the rows in the buffer are not what it adds.
- ``sglang/srt/arg_groups/mega_moe_hook.py`` picks the path a server runs
  (``handle_moe_runner_backend_alias``: ``--moe-runner-backend megamoe`` is
  ``--moe-a2a-backend megamoe``; ``check_mega_moe_compat``: SM90 / SM100 or ROCm with
  FlyDSL). It is no path of its own: its decision shows on each layer as the marks above.

Every path of the wheel marks a layer whose weights it prepared with a true attribute named
``*mega_moe*`` / ``*megamoe*`` ending in ``built`` or ``prepared``; a module with such a mark
that neither the sites (``_mega_moe_weights_built``) nor an entry here claims is refused as a
path moewire has not read. (Flags such as ``_use_mega_moe`` or ``use_megamoe`` say a model
may use a path, not that a layer runs on it, and do not count.)
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from moewire.integrations.sglang.refusals import POST_EXPERT_NORM
from moewire.integrations.sglang.sites import MEGA_MOE
from moewire.megamoe.builds import AITER_MEGAMOE_V2

__all__ = ["OTHER_PATHS", "OtherPath", "refuse_other_paths", "runs_other_path"]

#: moewire's format of aiter's ``p2p_quant="fp8_blockwise_1x32"`` combine rows.
FLYDSL_COMBINE = "flydsl_fp8_blockwise_1x32"
#: SGLang's FlashInfer Mega-MoE combine dtype (``sglang/srt/environ.py``).
ENV_FLASHINFER_COMBINE = "SGLANG_FLASHINFER_MEGAMOE_COMBINE_DTYPE"
_FIX_DEEPGEMM = (
    "serve it on SGLang's DeepGEMM Mega-MoE (--moe-a2a-backend megamoe on an SM90 or "
    "SM100 GPU), or unset MOEWIRE_RECIPE"
)


def _flydsl_selected() -> bool:
    """SGLang's own choice of FlyDSL (``mega_moe._use_amd_flydsl_mega_moe``), if loaded."""
    decide = getattr(sys.modules.get(MEGA_MOE), "_use_amd_flydsl_mega_moe", None)
    return bool(decide()) if callable(decide) else False


def _on_flydsl(module: nn.Module) -> bool:
    return bool(getattr(module, "_mega_moe_weights_built", False)) and (
        hasattr(module, "_mega_w1") or _flydsl_selected())


def _flashinfer_why() -> str:
    combine = os.environ.get(ENV_FLASHINFER_COMBINE, "bf16").strip().lower() or "bf16"
    engine = ("" if combine == "bf16" else
              f"; with {ENV_FLASHINFER_COMBINE}={combine} FlashInfer already casts those "
              f"cells to {combine.upper()} (moewire's flashinfer_{combine} format is that cast)")
    return (
        "flashinfer.moe_ep.MoEEpMegaLayer stages the tokens with its own cast and launches "
        "one megakernel whose peers write each (token, top-k slot) cell into the "
        "workspace's internal combine_quant region and sum them in a tail reduce (or, with "
        "SGLANG_FLASHINFER_MEGAMOE_IN_KERNEL_FC2_REDUCE=1, by atomics in no fixed order): "
        "neither the staged tokens nor the combine cells pass a call moewire hooks, and "
        f"moewire does not model that region or its reduce{engine}"
    )


@dataclass(frozen=True)
class OtherPath:
    """One SGLang Mega-MoE path with no site entry.

    Attributes:
        name: the path's name (messages, docs).
        module: SGLang's module running it.
        runs: whether a loaded module (after ``ModelRunner.load_model``) runs on it.
        why: what moewire cannot see there (called when refusing: it may read the env).
        fix: what to do.
    """

    name: str
    module: str
    runs: Callable[[nn.Module], bool]
    why: Callable[[], str]
    fix: str = _FIX_DEEPGEMM


OTHER_PATHS: tuple[OtherPath, ...] = (
    OtherPath(
        "flashinfer-megamoe", "sglang.srt.layers.moe.flashinfer_megamoe",
        runs=lambda m: hasattr(m, "_flashinfer_megamoe_layer"),
        why=_flashinfer_why,
        fix=("serve it without --moe-runner-backend / --moe-a2a-backend flashinfer_megamoe "
             "(SGLang's DeepGEMM Mega-MoE: --moe-a2a-backend megamoe), or unset "
             "MOEWIRE_RECIPE")),
    OtherPath(
        "flydsl-megamoe", "sglang.srt.layers.moe.mega_moe_flydsl",
        runs=_on_flydsl,
        why=lambda: AITER_MEGAMOE_V2,
        fix=("serve it with SGLANG_AMD_USE_FLYDSL_MEGA_MOE=0 on a GPU SGLang's DeepGEMM "
             "Mega-MoE runs on (SM90 / SM100), or unset MOEWIRE_RECIPE")),
    OtherPath(
        "muse-spark-megamoe", "sglang.srt.layers.muse_spark.muse_spark_megamoe",
        runs=lambda m: bool(getattr(m, "_megamoe_metadata_prepared", False)
                            or getattr(m, "_megamoe_weights_built", False)),
        why=lambda: ("forward_megamoe stages into its own buffer cache and calls "
                     "deep_gemm.nvfp4_mega_moe / bf16_mega_moe (weight_layout='trtllm'), "
                     "kernels no moewire build models, with post_expert_norm, applied before "
                     f"the route-weighted sum: {POST_EXPERT_NORM}"),
        fix=("serve Muse Spark without --enable-megamoe-for-layernorm-sp, or unset "
             "MOEWIRE_RECIPE")),
)

#: The mark a path's weight preparation sets on a layer it runs.
_PREPARED = re.compile(r"mega_?moe.*(built|prepared)$")
#: The mark of the DeepGEMM sites (``mega_moe.py``, ``mega_moe_sm90.py``).
_SITES_MARK = "_mega_moe_weights_built"


def _unknown(module: nn.Module) -> list[str]:
    """The marks of a Mega-MoE path no site or entry claims on ``module`` (true ones)."""
    return sorted(k for k, v in vars(module).items()
                  if k != _SITES_MARK and _PREPARED.search(k.lower()) and v is True)


def runs_other_path(module: nn.Module) -> OtherPath | None:
    """The path of :data:`OTHER_PATHS` ``module`` runs on, or ``None``."""
    return next((p for p in OTHER_PATHS if p.runs(module)), None)


def refuse_other_paths(model: nn.Module) -> None:
    """Refuse a model with a module on a Mega-MoE path moewire has no site for.

    Raises:
        RuntimeError: naming the first such module, its path, the cause and the fix.
    """
    for name, module in model.named_modules():
        path = runs_other_path(module)
        if path is not None:
            raise RuntimeError(
                f"{name}: this layer runs SGLang's {path.name} path ({path.module}), which "
                f"moewire has no site for: {path.why()}; {path.fix}")
        marks = _unknown(module)
        if marks:
            raise RuntimeError(
                f"{name}: this layer carries {', '.join(marks)}, the mark of an SGLang "
                "Mega-MoE path moewire has not read (neither "
                f"{MEGA_MOE}.run_mega_routed_experts nor one of "
                f"{', '.join(p.name for p in OTHER_PATHS)}), so its dispatch and combine "
                f"may run where no hook reaches; {_FIX_DEEPGEMM}")
