"""A CPU stand-in of sgl-deep-gemm's SM90 API, the names SGLang's ``mega_moe_sm90.py`` calls.

``mega_moe_pre_dispatch_sm90`` is moewire's stand-in written from the wheel's
``impls/sm90_mega_moe_pre_dispatch.cuh`` (``moewire.reference.sgl_staging``); the buffer
and kernel are ``moewire.reference.sm90_fork``'s (the SM90 buffer with the combine region
right after ``l2_acts_sf``; FP8 x FP8, 128x128 weight scales, valid slots summed in
ascending order in FP32), behind sgl-deep-gemm's signatures (``deep_gemm/__init__.py``):
``fp8_mega_moe(y, l1, l2, sym_buffer, cumulative_local_expert_recv_stats=None,
recipe=(128, 128, 128), activation='swiglu', activation_clamp=None, fast_math=True)``.
"""

from __future__ import annotations

import contextlib
import types

import torch

from moewire.reference.sgl_staging import mega_moe_pre_dispatch_sm90

# Bound here, not looked up on the module: another test may have hooked sm90_fork's module
# object as a DeepGEMM, and the stand-in's kernel must not run moewire's hooks twice.
from moewire.reference.sm90_fork import fp8_mega_moe_sm90 as _sm90_kernel
from moewire.reference.sm90_fork import get_symm_buffer_for_sm90_mega_moe as _sm90_buffer

FLAVOUR = "sgl-deep-gemm-0.2.3"


def fp8_mega_moe(y, l1_weights, l2_weights, sym_buffer, cumulative_local_expert_recv_stats=None,
                 recipe=(128, 128, 128), activation="swiglu", activation_clamp=None,
                 fast_math=True, num_tokens_bound=None):
    if tuple(recipe) != (128, 128, 128) or activation != "swiglu":
        raise ValueError(f"fp8_mega_moe: recipe {recipe} / activation {activation!r}")
    _sm90_kernel(
        y, l1_weights, l2_weights, sym_buffer,
        cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
        activation_clamp=activation_clamp, fast_math=fast_math)


def get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                 intermediate_hidden, num_shared_experts=0,
                                 use_fp8_dispatch=None, mma_type="fp8xfp4", activation="swiglu"):
    """sgl-deep-gemm's entry on a Hopper: the SM90 buffer, FP8 dispatch, no shared expert
    (``deep_gemm/__init__.py`` asserts both there)."""
    if mma_type.split("x")[0] != "fp8" or num_shared_experts != 0 or activation != "swiglu":
        raise AssertionError(
            f"get_symm_buffer_for_mega_moe on SM90: mma_type={mma_type!r}, "
            f"num_shared_experts={num_shared_experts}, activation={activation!r}")
    return _sm90_buffer(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                        intermediate_hidden)


def module() -> types.ModuleType:
    """A fresh plain module named ``deep_gemm`` (moewire hooks module objects)."""
    dg = types.ModuleType("deep_gemm")
    dg.moewire_flavour = lambda: FLAVOUR
    dg.get_symm_buffer_for_sm90_mega_moe = _sm90_buffer
    dg.mega_moe_pre_dispatch_sm90 = mega_moe_pre_dispatch_sm90
    dg.fp8_mega_moe = fp8_mega_moe
    dg.get_symm_buffer_for_mega_moe = get_symm_buffer_for_mega_moe
    dg.get_num_sms = lambda: 132  # an H200's SM count (SGLang keys its buffer cache by it)
    return dg


@contextlib.contextmanager
def sm100_module(monkeypatch):
    """A plain module named ``deep_gemm`` with sgl-deep-gemm 0.2.5's SM100 names.

    Staging: moewire's ``mega_moe_pre_dispatch`` (from ``sm100_mega_moe_pre_dispatch.cuh``).
    Buffer and kernel: ``moewire.reference.deep_gemm`` under its ``vllm-0.33`` build, whose
    combine region follows the L2 scales and whose fused shared row is added first, as
    sgl-deep-gemm 0.2.5's (``layout/mega_moe.cuh``, ``sm100_fp8_fp4_mega_moe.cuh``); its
    ``x_sf`` is int32 ``[Tmax, H/128]`` with the UE8M0 bytes in group order, the layout
    SGLang's cast writes. ``get_num_sms``/``set_num_sms`` keep a count, and the CUDA
    device properties SGLang reads for its SM budget are a B200's 148 SMs.
    """
    from moewire.reference import deep_gemm as ref
    from moewire.reference.builds import use_flavour
    from moewire.reference.sgl_staging import mega_moe_pre_dispatch

    sms = {"n": 148}
    dg = types.ModuleType("deep_gemm")
    dg.moewire_flavour = lambda: "sgl-deep-gemm-0.2.5"
    dg.get_symm_buffer_for_mega_moe = ref.get_symm_buffer_for_mega_moe
    dg.fp8_fp4_mega_moe = ref.fp8_fp4_mega_moe
    dg.get_block_m_for_mega_moe = ref.get_block_m_for_mega_moe
    dg.mega_moe_pre_dispatch = mega_moe_pre_dispatch
    dg.get_num_sms = lambda: sms["n"]
    dg.set_num_sms = lambda n: sms.update(n=n)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(multi_processor_count=148))
    with use_flavour("vllm-0.33"):
        yield dg
