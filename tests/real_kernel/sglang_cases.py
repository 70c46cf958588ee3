"""SGLang's released SM90 path on the real kernel: loading, the experts, the runs (GPU only).

SGLang's ``mega_moe_sm90.py`` comes from the sglang 0.5.23 wheel (``tests/sglang/_released``:
installed, or unpacked at ``$SGLANG_SRC``), unmodified; ``deep_gemm`` is DeepGEMM PR #323's
package with its ``mega_moe_pre_dispatch_sm90`` replaced by moewire's, written from
sgl-deep-gemm's ``impls/sm90_mega_moe_pre_dispatch.cuh`` (``moewire.reference.sgl_staging``):
sgl-deep-gemm's own host library is not built here.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "sglang"))

import _released  # noqa: E402
import rk_cases as rk  # noqa: E402

from moewire.reference.sgl_staging import mega_moe_pre_dispatch_sm90  # noqa: E402

SHAPE = rk.TINY


def load_sglang() -> tuple[object, object]:
    """``(SGLang's released mega_moe_sm90 module, PR #323's own pre-dispatch)``; the real
    ``deep_gemm`` module then stages with moewire's pre-dispatch."""
    root = _released.wheel_root()
    if root is None:
        raise RuntimeError("the sglang 0.5.23 wheel is not installed and $SGLANG_SRC is unset")
    real = importlib.import_module("deep_gemm")
    own = real.__dict__.get("mega_moe_pre_dispatch_sm90")
    real.mega_moe_pre_dispatch_sm90 = mega_moe_pre_dispatch_sm90
    _released.load(root, device_sm=90)
    return sys.modules[_released.MEGA_MOE_SM90], own


class Experts(nn.Module):
    """What SGLang's SM90 path reads of ``moe.experts`` after
    ``build_sm90_mega_moe_experts_weights``: the transformed FP8 weights of the tier."""

    def __init__(self, group) -> None:
        super().__init__()
        w1, w2, self.buf = rk.prepared("fp8_mega_moe", SHAPE, group)
        self.mega_l1_weights, self.mega_l2_weights = w1, w2
        self.num_experts = SHAPE.experts
        self._mega_moe_weights_built = True
        self._mega_moe_sm90_fp8_weights = True
        # Set by SGLang's FusedMoE.__init__ (fused_moe_triton/layer.py); mega_moe.py's
        # _mega_moe_mma_type reads them.
        self._mega_moe_nvfp4 = False
        self._mega_moe_w4a4 = False

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise AssertionError("SGLang's Mega-MoE path never calls the experts' forward")


class Model(nn.Module):
    def __init__(self, group) -> None:
        super().__init__()
        self.experts = Experts(group)


def run(sm90, experts, x, w, ids, rsf=1.0):
    """SGLang's call: int32 ids and FP32 weights as ``run_mega_routed_experts`` passes them."""
    return sm90.run_sm90_mega_routed(experts, x, ids.int(), w.float(), experts.buf, x.shape[0],
                                     hidden_size=SHAPE.hidden, activation_clamp=10.0,
                                     routed_scaling_factor=rsf)
