"""The SGLang integration's refusals, in each quantizer mode, on CPU without SGLang.

What a refusal reads is the call's arguments, the environment, SGLang's ``mma_type`` and
the modes of the experts' two quantizers (``_refusal``, and the ``post_expert_norm`` guard on
``fp8_fp4_mega_moe``). A path moewire cannot see is refused while the quantizers calibrate
as while they quantize: calibrating through it would collect from tokens that never pass a
hook, or from rows moewire misreads, and save those scales. With both quantizers disabled
the call is SGLang's own. The SGLang tier runs the same refusals through SGLang 0.5.23's
released functions (``test_sglang_mega_moe.py``).
"""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch
from torch import nn

from moewire.integrations import sglang as sg
from moewire.integrations.sglang import refusals as sg_refusals
from moewire.integrations.sglang.sites import MEGA_MOE, SITES
from moewire.megamoe.active import ACTIVE
from moewire.quantizer import WireQuantizer

NAME = "model.layers.3.mlp.experts"


class Experts(nn.Module):
    """What the refusals read of a converted SGLang experts module: its name and its two
    quantizers (MXFP8, enabled or not)."""

    def __init__(self, enable: bool) -> None:
        super().__init__()
        self._moewire_name = NAME
        for attr in ("dispatch_quantizer", "combine_quantizer"):
            setattr(self, attr, WireQuantizer("mxfp8", enable=enable, name=f"{NAME}.{attr}"))


def _experts_in(mode: str) -> Experts:
    """Experts whose quantizers quantize, calibrate (``begin_calibration``, as moewire's
    ``calibrating`` does) or are disabled."""
    experts = Experts(enable=mode != "disabled")
    quantizers = (experts.dispatch_quantizer, experts.combine_quantizer)
    if mode == "calibrating":
        for q in quantizers:
            q.begin_calibration()
    want = {"quantizing": "quantize", "calibrating": "calibrate", "disabled": "disabled"}[mode]
    assert {q.mode for q in quantizers} == {want}
    return experts


def _tagged() -> torch.Tensor:
    """Tokens marked as written into the buffer by the op before the MoE (SGLang's tag,
    ``mega_moe.MEGA_MOE_INPUT_TAG``, whose default the integration reads without SGLang)."""
    x = torch.ones(2, 4)
    x._mega_moe_input_in_buffer = object()
    return x


#: case -> (the call's arguments, environment variables, SGLang's mma_type or None: the
#: default, the refusal's text).
REFUSED = {
    "mega-gate": ({"routing_in_buffer": True}, {}, None,
                  "Mega-Gate .* SGLANG_OPT_DEEPGEMM_MEGA_GATE=0"),
    "input-in-buffer": ({"hidden_states": _tagged()}, {}, None,
                        r"mega_moe_input_target.* SGLANG_OPT_DEEPGEMM_MEGA_GATE=0"),
    "fp8-combine": ({}, {sg.ENV_FP8_COMBINE: "1"}, None,
                    "DG_USE_FP8_COMBINE=1 makes .* unset DG_USE_FP8_COMBINE"),
    "unknown-mma-type": ({}, {}, "fp8xfp8", "mma_type='fp8xfp8', which moewire does not know"),
}
MODES = ["quantizing", "calibrating", "disabled"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_a_path_moewire_cannot_see_is_refused_while_calibrating_too(monkeypatch, case, mode):
    args, env, mma_type, match = REFUSED[case]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if mma_type is not None:  # a later SGLang deriving another kind
        monkeypatch.setitem(sys.modules, MEGA_MOE,
                            types.SimpleNamespace(_mega_moe_mma_type=lambda e: mma_type))
    why = sg_refusals._refusal(SITES[0], _experts_in(mode), args)
    if mode == "disabled":
        assert why is None
    else:
        assert why is not None and why.startswith(f"{NAME}: ")
        assert re.search(match, why), why


@pytest.mark.parametrize("mode", MODES)
def test_post_expert_norm_is_refused_while_calibrating_too(mode):
    calls = []
    guard = sg_refusals._refuse_post_norm(lambda *a, **k: calls.append(k))
    token = ACTIVE.set(_experts_in(mode))
    try:
        if mode == "disabled":
            guard(post_expert_norm=True)
        else:
            with pytest.raises(RuntimeError, match=f"{NAME}: .*post_expert_norm=True"):
                guard(post_expert_norm=True)
    finally:
        ACTIVE.reset(token)
    assert calls == ([{"post_expert_norm": True}] if mode == "disabled" else [])
