"""Where SGLang runs its Mega-MoE experts, one declarative entry per site.

SGLang has no experts class per kernel: a module-level function receives ``moe.experts``
(an ``nn.Module``) and the hidden states, stages them and calls the kernel. A site says
which function that is, which module's globals SGLang calls it through, the staging and
kernel calls its source makes (what recognises it, never a version), where its buffer
comes from and which group its amax is reduced over. :mod:`moewire.integrations.sglang`
derives everything from these entries; the kernel side (which build, where its rows are)
is ``moewire.megamoe.builds`` (the ``sgl-deep-gemm-*`` entries).

Sources read (the sglang 0.5.23 wheel):

- ``sglang/srt/layers/moe/mega_moe.py``: ``_run_mega_routed`` calls the module global
  ``run_mega_routed_experts(moe.experts, hidden_states, topk_ids, topk_weights, ...,
  routed_scaling_factor=, shared_l1_weights=, routing_in_buffer=)``, which takes its
  buffer from ``_get_mega_moe_symm_buffer`` (cached in ``_MEGA_MOE_SYMM_BUFFER``), hands
  SM90 to ``run_sm90_mega_routed`` (a global imported from ``mega_moe_sm90``) and on SM100
  folds ``routed_scaling_factor`` into the weights, stages with SGLang's own
  ``mega_moe_pre_dispatch`` (``sglang.kernels.ops.moe.dsv4``; fp8xfp4) or
  ``deep_gemm.mega_moe_pre_dispatch`` (nvfp4xnvfp4, mxf4xmxf4) and calls
  ``deep_gemm.fp8_fp4_mega_moe``; ``deep_gemm`` is imported inside the function.
- ``sglang/srt/layers/moe/mega_moe_sm90.py``: ``run_sm90_mega_routed(experts, hidden_states,
  topk_ids, topk_weights, buf, num_tokens, *, hidden_size, activation_clamp,
  routed_scaling_factor)`` stages with ``deep_gemm.mega_moe_pre_dispatch_sm90`` and calls
  ``deep_gemm.fp8_mega_moe``.

May import: the standard library and ``moewire.integrations._host`` (nothing of SGLang).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from moewire.integrations._host import missing_call
from moewire.reference.catalogue import DEEPGEMM, mma_types

__all__ = ["MEGA_MOE", "MMA_TYPES", "SITES", "SglangSite", "recognise"]

MEGA_MOE = "sglang.srt.layers.moe.mega_moe"
#: The ``mma_type`` values SGLang 0.5.23 derives (``_mega_moe_mma_type``; rows of
#: ``moewire.reference.catalogue``).
MMA_TYPES = mma_types(DEEPGEMM, "sglang")


@dataclass(frozen=True)
class SglangSite:
    """One SGLang function that runs the Mega-MoE experts.

    Attributes:
        name: short name (messages, docs).
        module: the module defining the function.
        function: its name; its first argument is ``moe.experts``, its second the hidden
            states.
        called_from: the modules whose globals SGLang calls it through (each rebound).
        calls: calls its module's source must make (staging, kernel).
        buffer_arg: the argument holding the buffer, or ``None``: the buffer comes from
            ``buffer_fn`` during the call.
        buffer_fn: the global of :data:`MEGA_MOE` returning the cached buffer
            (``_get_mega_moe_symm_buffer``, the cache ``_MEGA_MOE_SYMM_BUFFER``).
        group: the process group the buffer spans (amax max-reduce): ``"ep"``, SGLang's
            ``get_parallel().moe_ep_group``.
        mma_types: the ``mma_type`` values it runs.
    """

    name: str
    module: str
    function: str
    called_from: tuple[str, ...]
    calls: tuple[str, ...]
    buffer_arg: str | None
    buffer_fn: str = "_get_mega_moe_symm_buffer"
    group: str = "ep"
    mma_types: tuple[str, ...] = MMA_TYPES

    @property
    def path(self) -> str:
        return f"{self.module}.{self.function}"


SITES: tuple[SglangSite, ...] = (
    # SM100 (and the SM90 hand-off): the buffer comes from _get_mega_moe_symm_buffer.
    SglangSite("mega", MEGA_MOE, "run_mega_routed_experts", called_from=(MEGA_MOE,),
               calls=("mega_moe_pre_dispatch(", ".fp8_fp4_mega_moe(",
                      "_get_mega_moe_symm_buffer("),
               buffer_arg=None),
    # SM90: the buffer is an argument.
    SglangSite("mega-sm90", "sglang.srt.layers.moe.mega_moe_sm90", "run_sm90_mega_routed",
               called_from=("sglang.srt.layers.moe.mega_moe_sm90", MEGA_MOE),
               calls=(".mega_moe_pre_dispatch_sm90(", ".fp8_mega_moe("),
               buffer_arg="buf", mma_types=("fp8xfp4",)),
)


def recognise(site: SglangSite) -> str | None:
    """Why SGLang lacks ``site``'s structure, or ``None`` if it has it.

    The structure: the module imports, defines the function (taking the experts first),
    and its source makes every call of ``site.calls`` (read from its syntax tree). Versions
    play no part.
    """
    try:
        module = importlib.import_module(site.module)
    except ImportError as exc:
        return f"{site.module} does not import ({exc})"
    if not callable(getattr(module, site.function, None)):
        return f"{site.module} has no function {site.function}"
    return missing_call(site.module, site.calls)
