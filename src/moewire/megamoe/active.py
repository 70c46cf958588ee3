"""Which quantized experts forward is running, and which of moewire's hooks it reached.

Context variables, so that concurrent forwards (threads, asyncio tasks) never see each
other's module. ``Quant<Cls>.forward`` (:mod:`moewire.megamoe.quant_experts`) sets them
for the length of its forward; the hooks (:mod:`moewire.megamoe.hooks`) read them and pass
everything through when no quantized forward is running.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "ACTIVE", "CAST_CALIBRATION", "IN_STAGING_CALL", "PLAIN_COPY_HOOK", "REACHED",
    "SHARED_PASS", "reached",
]

# The quantized experts module (a ``QuantExperts``) whose forward is running (None: pass
# everything through). Typed as a module: this module sits below the class.
ACTIVE: contextvars.ContextVar[nn.Module | None] = contextvars.ContextVar(
    "moewire_active_experts", default=None
)
# The hooks the running quantized forward has reached ("staging", "kernel", and
# PLAIN_COPY_HOOK once its own tokens argument was quantized).
REACHED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "moewire_reached_hooks", default=None
)
# The mark of a forward whose tokens argument was quantized (it stages with a plain copy).
PLAIN_COPY_HOOK = "plain copy"
# True while the adapter's staging function runs: it already got the quantized tokens, so
# a cast it makes through the module (the SM90 staging does) is not a staging of its own.
IN_STAGING_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "moewire_in_staging_call", default=False
)
# Tokens a calibrating dispatch quantizer saw in a staging cast, collected at the kernel
# call (the ids that say which tokens are padding are staged after the cast).
CAST_CALIBRATION: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar(
    "moewire_cast_calibration", default=None
)

# The quantized staging a forward with a fused shared expert still owes (a callable): its
# staging hook staged the original tokens with no routed slot for the shared expert's own
# kernel launch, and the kernel hook runs that launch and then this staging.
SHARED_PASS: contextvars.ContextVar[list[Callable[[], Any]] | None] = contextvars.ContextVar(
    "moewire_shared_pass", default=None
)


def reached(hook: str) -> None:
    """Record that the running quantized forward reached ``hook`` (``"staging"``,
    ``"kernel"``); nothing outside one."""
    hooks = REACHED.get()
    if hooks is not None:
        hooks.add(hook)
