"""The SGLang Mega-MoE paths moewire cannot see, refused with the fix: Mega-Gate's routing
written into the buffer, an input fused into the buffer by the op before the MoE, FP8
combine rows, an ``mma_type`` a site does not know, and ``post_expert_norm``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from moewire.integrations.sglang.sites import MEGA_MOE, SglangSite

# Every SGLang path that passes post_expert_norm (fp8_fp4_mega_moe on the mega site, Muse
# Spark's nvfp4_mega_moe / bf16_mega_moe) is refused for the reason vLLM's normalising NVFP4
# kernel is: one sentence, kept with the builds.
from moewire.megamoe.builds import POST_EXPERT_NORM

__all__ = ["ENV_FP8_COMBINE", "ENV_MEGA_GATE", "POST_EXPERT_NORM"]

#: sgl-deep-gemm's switch to FP8 combine rows (impls/sm100_fp8_fp4_mega_moe.cuh).
ENV_FP8_COMBINE = "DG_USE_FP8_COMBINE"
#: SGLang's Mega-Gate switch (``sglang/srt/layers/moe/mega_gate.py``).
ENV_MEGA_GATE = "SGLANG_OPT_DEEPGEMM_MEGA_GATE"


def _enabled(experts: nn.Module) -> list[str]:
    return [q for q in ("dispatch_quantizer", "combine_quantizer")
            if getattr(experts, q).mode != "disabled"]


def _mma_type(experts: nn.Module) -> str:
    """The ``mma_type`` SGLang derives for ``experts`` (``mega_moe._mega_moe_mma_type``).

    Without SGLang's ``mega_moe`` module only ``run_sm90_mega_routed`` can run, and only on
    FP8 dispatch (sgl-deep-gemm's ``get_symm_buffer_for_mega_moe`` asserts it on SM90).
    """
    module = sys.modules.get(MEGA_MOE)
    derive = getattr(module, "_mega_moe_mma_type", None)
    return str(derive(experts)) if callable(derive) else "fp8xfp4"


def _refusal(site: SglangSite, experts: nn.Module, args: dict[str, Any]) -> str | None:
    """Why moewire cannot quantize this call (with the fix), or ``None``."""
    name = experts._moewire_name
    enabled = _enabled(experts)
    if not enabled:
        return None
    if args.get("routing_in_buffer"):
        return (
            f"{name}: SGLang's Mega-Gate (run_mega_gate) wrote the routing into the Mega-MoE "
            "buffer itself, and the tokens were staged without a call moewire can hook, so "
            f"{'/'.join(enabled)} would not run; serve with {ENV_MEGA_GATE}=0, or disable "
            "the quantizers of this layer"
        )
    hidden = args.get("hidden_states")
    tag = getattr(sys.modules.get(MEGA_MOE), "MEGA_MOE_INPUT_TAG", "_mega_moe_input_in_buffer")
    if getattr(hidden, tag, None) is not None:
        return (
            f"{name}: the op before this MoE (mega_moe_input_target) wrote x and its scales "
            "straight into the Mega-MoE buffer, so the dispatched tokens never pass a staging "
            f"call moewire can hook; serve with {ENV_MEGA_GATE}=0 (the fused input needs "
            "Mega-Gate), or disable the quantizers of this layer"
        )
    if os.environ.get(ENV_FP8_COMBINE, "0").strip() not in ("", "0"):
        return (
            f"{name}: {ENV_FP8_COMBINE}=1 makes sgl-deep-gemm's combine rows FP8 with one "
            "UE8M0 scale per 128 columns, and moewire reads BF16 combine rows only; unset "
            f"{ENV_FP8_COMBINE}, or disable the quantizers of this layer"
        )
    mma = _mma_type(experts)
    if mma not in site.mma_types:
        return (
            f"{name}: SGLang runs this layer with mma_type={mma!r}, which moewire does not "
            f"know for {site.path} (known: {', '.join(site.mma_types)}); use an FP8 "
            "(fp8xfp4) checkpoint for the layer, or disable its quantizers"
        )
    return None


def _refuse_post_norm(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fp8_fp4_mega_moe`` refusing ``post_expert_norm`` inside a quantized SGLang call."""
    if getattr(fn, "_moewire_post_norm_guard", False):
        return fn

    def fp8_fp4_mega_moe(*args: Any, **kwargs: Any) -> Any:
        from moewire.megamoe.active import ACTIVE

        module = ACTIVE.get()
        if module is not None and kwargs.get("post_expert_norm") and _enabled(module):
            raise RuntimeError(
                f"{module._moewire_name}: fp8_fp4_mega_moe was called with "
                f"post_expert_norm=True: {POST_EXPERT_NORM}; call it without "
                "post_expert_norm, or disable the quantizers of this layer"
            )
        return fn(*args, **kwargs)

    fp8_fp4_mega_moe._moewire_post_norm_guard = True  # type: ignore[attr-defined]
    fp8_fp4_mega_moe.__wrapped__ = fn  # type: ignore[attr-defined]
    return fp8_fp4_mega_moe
