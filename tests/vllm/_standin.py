"""vLLM's Mega-MoE experts on CPU: the stand-in DeepGEMM and staging the ``vllm`` tests run on.

Only the tests use this (``moewire.integrations.vllm`` is the integration alone):

- :func:`use_reference_deep_gemm`: while active, vLLM's ``_import_deep_gemm()`` returns
  ``moewire.reference.deep_gemm`` (plus :class:`_ReferenceForVllm`'s helpers), every
  registered site stages with :func:`prepare_megamoe_inputs_reference` (vLLM's staging is
  Triton, which has no CPU backend), vLLM's SM100 capability checks pass, and without an
  accelerator ``torch.accelerator`` answers as device 0.
- :func:`prepare_megamoe_inputs_reference`: vLLM's ``prepare_megamoe_inputs`` in plain torch,
  on the stand-in kernel's own UE8M0 cast (``moewire.reference._numerics``), checked against
  an ml_dtypes oracle in ``test_vllm_experts.py``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from moewire.integrations.vllm import NVFP4_STAGE_FN
from moewire.integrations.vllm import bridge as _vllm_bridge
from moewire.reference._numerics import cast_to_fp8_ue8m0, pack_ue8m0
from moewire.reference.nvfp4.mega_moe import shared_sf_row

__all__ = ["prepare_megamoe_inputs_reference", "use_reference_deep_gemm"]


def prepare_megamoe_inputs_reference(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    x_fp8: torch.Tensor,
    x_sf: torch.Tensor | None,
    topk_idx_out: torch.Tensor,
    topk_weights_out: torch.Tensor,
    is_padding: torch.Tensor | None = None,
    shared_x_sf: torch.Tensor | None = None,
    shared_block_m: int | None = None,
    hidden_quant: Any = "mxfp8",
    eplb_state: Any = None,
) -> None:
    """vLLM's ``prepare_megamoe_inputs`` (a Triton kernel) in plain torch, for CPU tests.

    Same signature and math as vLLM 0.32/0.33's MXFP8 staging: per token and 32 channels,
    ``amax = max(max|x|, 1e-4)`` (FP32), ``s = amax / 448`` rounded up to a power of two
    (exponent field clamped to [1, 254]), ``x_fp8 = e4m3(x * (1 / s))``; ``x_sf`` int32
    ``[T, H/128]`` holds the biased exponent of group ``4i + j`` in byte ``j`` of int ``i``.
    Routing: ``topk_idx_out = -1`` and ``topk_weights_out = 0`` on padding tokens, else int64
    ids and FP32 weights. ``shared_x_sf`` gets the same ints at the rows of DeepGEMM's SM100
    shared-expert layout for ``shared_block_m``. ``hidden_quant=None`` (vLLM 0.33's BF16
    format) copies ``hidden_states`` into ``x_fp8``.

    Args:
        hidden_states: BF16 ``[T, H]``, ``H`` a multiple of 128.
        topk_weights: FP32 ``[T, k]``; topk_ids: integer ``[T, k]``.
        x_fp8, x_sf, topk_idx_out, topk_weights_out: the buffer's ``[:T]`` views.
        is_padding: bool ``[T]`` or ``None``.
        hidden_quant: vLLM's ``kMxfp8Dynamic`` (or anything but ``None``) or ``None``.
        eplb_state: vLLM 0.34's ``EplbLayerState`` (the staging kernel maps logical ids to
            physical replicas there); only a state without a mapping is accepted here.
    """
    if getattr(eplb_state, "logical_to_physical_map", None) is not None:
        raise ValueError(
            "prepare_megamoe_inputs_reference: EPLB id mapping (eplb_state with a "
            "logical_to_physical_map) is not implemented in the CPU stand-in; run without EPLB"
        )
    num_tokens, hidden = hidden_states.shape
    if num_tokens == 0:
        return
    if hidden % 128:
        raise ValueError(
            f"prepare_megamoe_inputs_reference: hidden size {hidden} is not a multiple of 128"
        )
    pad = (
        torch.zeros(num_tokens, dtype=torch.bool, device=hidden_states.device)
        if is_padding is None
        else is_padding[:num_tokens].to(torch.bool)
    )
    topk_idx_out.copy_(torch.where(pad[:, None], -1, topk_ids.to(torch.int64)))
    topk_weights_out.copy_(torch.where(pad[:, None], 0.0, topk_weights.float()))
    if hidden_quant is None:
        x_fp8.copy_(hidden_states)
        return
    q, sf = cast_to_fp8_ue8m0(hidden_states, 32)
    x_fp8.copy_(q.to(x_fp8.dtype))
    packed = pack_ue8m0(sf)
    x_sf.copy_(packed)
    if shared_x_sf is not None:
        if shared_block_m is None:
            raise ValueError("prepare_megamoe_inputs_reference: shared_x_sf needs shared_block_m")
        token = torch.arange(num_tokens, device=packed.device)
        shared_x_sf[shared_sf_row(token, shared_block_m)] = packed


@contextlib.contextmanager
def use_reference_deep_gemm(flavour: str | None = None) -> Iterator[Any]:
    """Make vLLM's Mega-MoE experts call moewire's stand-in DeepGEMM (tests, CPU).

    The same move as vLLM's own Mega-MoE tests (they monkeypatch DeepGEMM): while active,
    ``vllm.utils.deep_gemm._import_deep_gemm()`` returns ``moewire.reference.deep_gemm``,
    the staging function of every registered site is
    :func:`prepare_megamoe_inputs_reference` (vLLM's is Triton, which has no CPU backend),
    vLLM's SM100 capability checks pass, and on a machine with no accelerator
    ``torch.accelerator.current_device_index()`` (read by ``get_symm_buffer``) returns 0
    and ``torch.accelerator.synchronize()`` (0.33's first-launch barrier) does nothing.

    Args:
        flavour: the stand-in's build (``vllm-0.32``, ``vllm-0.33``, ...); default the
            stand-in's current one.

    Yields:
        ``moewire.reference.deep_gemm``.
    """
    from moewire.reference import deep_gemm as reference

    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    stack = contextlib.ExitStack()
    try:
        if flavour is not None:
            stack.enter_context(reference.use_flavour(flavour))
        namespace = _ReferenceForVllm(reference)
        _vllm_bridge.set_kernel_override(lambda: namespace)
        installed = _vllm_bridge.installed_stage_globals()
        for _, stage_fn, stage_global in installed:
            if stage_fn == _vllm_bridge.PRIMARY_STAGE_FN:
                patch(_vllm_bridge, stage_global, prepare_megamoe_inputs_reference)
            elif stage_fn == NVFP4_STAGE_FN:
                from moewire.reference import prepare_megamoe_nvfp4_inputs

                patch(_vllm_bridge, stage_global, prepare_megamoe_nvfp4_inputs)
        _bypass_capability_checks(patch)
        if not torch.accelerator.is_available():
            patch(torch.accelerator, "current_device_index", lambda: 0)
            patch(torch.accelerator, "synchronize", lambda device=None: None)
        yield reference
    finally:
        for owner, name, value in reversed(patches):
            setattr(owner, name, value)
        _vllm_bridge.set_kernel_override(None)
        stack.close()


class _ReferenceForVllm:
    """``moewire.reference.deep_gemm`` plus the DeepGEMM helpers vLLM 0.32 calls at load.

    Attribute lookups go to the stand-in; only names it lacks come from here, so the
    stand-in's own versions win once it has them.
    """

    def __init__(self, reference: Any) -> None:
        self._reference = reference
        self.__name__ = reference.__name__

    def __getattr__(self, name: str) -> Any:
        if hasattr(self._reference, name):
            return getattr(self._reference, name)
        if name == "transform_sf_into_required_layout":
            return _transform_sf_into_required_layout
        raise AttributeError(f"moewire.reference.deep_gemm has no {name!r}")


def _transform_sf_into_required_layout(
    sf: torch.Tensor, mn: int, k: int, recipe: tuple[int, int], num_groups: int | None = None
) -> torch.Tensor:
    """DeepGEMM's scale packing for ``recipe=(1, 32)``: FP32 powers of two -> UE8M0 int32.

    Args:
        sf: FP32 ``[G, MN, K/32]`` (or ``[MN, K/32]``), each a power of two.
        mn, k, num_groups: the weight's shape, checked against ``sf``.

    Returns:
        int32 ``[G, MN, K/128]`` (K-major; the stand-in kernel reads values, not strides):
        byte ``j`` of int ``i`` is the biased exponent of group ``4i + j``.
    """
    if tuple(recipe) != (1, 32):
        raise ValueError(f"transform_sf_into_required_layout: recipe {recipe} is not (1, 32)")
    if sf.shape[-2:] != (mn, k // 32):
        raise ValueError(
            f"transform_sf_into_required_layout: sf shape {tuple(sf.shape)} is not "
            f"[..., {mn}, {k // 32}]"
        )
    return pack_ue8m0(sf)


def _bypass_capability_checks(patch: Callable[[Any, str, Any], None]) -> None:
    mega = importlib.import_module("vllm.model_executor.layers.fused_moe.deep_gemm_mega_moe")
    if hasattr(mega, "DeepGemmSm100MegaMoEBackend"):
        dsv4 = importlib.import_module("vllm.models.deepseek_v4.nvidia.model")

        def sm100_backend(device: Any, hidden: int, intermediate: int) -> Any:
            return mega.DeepGemmSm100MegaMoEBackend()

        patch(dsv4, "get_deep_gemm_mega_moe_backend", sm100_backend)
    # 0.33 checks in the experts' __init__; also a 0.33 module loaded under another name.
    for name in {mega.__name__, *(m for m, _, _ in _vllm_bridge.installed_stage_globals())}:
        module = importlib.import_module(name)
        if hasattr(module, "check_deep_gemm_mega_moe_supported"):
            patch(module, "check_deep_gemm_mega_moe_supported", lambda *args: None)
