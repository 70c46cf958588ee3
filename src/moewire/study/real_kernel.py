"""The study's layer on the real SM90 Mega-MoE kernel (``moewire study --kernel deepgemm-sm90``).

Built by the study's one builder, :func:`moewire.study.layer.build_layer` (router and
unfused shared expert on the unquantized tokens, ``moewire.quantize`` on the experts); here
only what differs: the routed experts run on
DeepGEMM's SM90 ``fp8_fp4_mega_moe`` (PR #323) through
:class:`moewire.integrations.deepgemm_sm90.SM90MegaMoEExperts`: the real kernel's own
numerics (its FP8 staging, FP4 weights with UE8M0 scales per 32, its SwiGLU and combine
order), at full size on one H100/H200. The buffer is allocated on a one-rank NCCL group
(set up here when no process group exists).
"""

from __future__ import annotations

import os
import socket
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from moewire.study import layer as study_layer
from moewire.study.data import LayerWeights
from moewire.study.errors import StudyArgumentError
from moewire.study.layer import MoELayer, StudyLayer
from moewire.study.settings import StudyConfig, check_kernel_flags

__all__ = ["RealKernelLayer", "build_layer", "check", "kernel_experts"]

# The stand-in's --mma name -> the SM90 kernel function with those operand types.
_SM90_KERNEL = {"fp8xfp4": "fp8_fp4_mega_moe"}


def check(cfg: StudyConfig) -> None:
    """Refuse ``--kernel deepgemm-sm90`` where it cannot run, saying what is missing."""
    from moewire.integrations import deepgemm_sm90

    check_kernel_flags(cfg)
    ok, why = deepgemm_sm90.available()
    if not ok:
        raise StudyArgumentError(
            "--kernel", f"the real SM90 Mega-MoE kernel cannot run here: {why}. It needs a "
            "Hopper GPU and DeepGEMM's SM90 package (scripts/real_kernel/build_kit.sh, "
            "docs/real-kernel.md); without them use --kernel stand-in"
        )


def _one_rank_group() -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1,
                                rank=0, device_id=torch.device("cuda", torch.cuda.current_device()))
    return dist.new_group([dist.get_rank()])


@dataclass
class RealKernelLayer(StudyLayer):
    """A :class:`StudyLayer` whose experts are the real SM90 kernel.

    Attributes:
        kernel: the DeepGEMM function (``"fp8_fp4_mega_moe"``).
        kernel_weights: ``(l1, l2)`` as the kernel takes them (shared by every copy).
        symm_buffer: the one SM90 buffer every copy uses.
    """

    kernel: str = ""
    kernel_weights: tuple = ()
    symm_buffer: Any = None

    def fresh(self) -> MoELayer:
        from moewire.integrations.deepgemm_sm90 import SM90MegaMoEExperts

        experts = SM90MegaMoEExperts(*self.kernel_weights, self.symm_buffer, self.kernel)
        return MoELayer(experts, self.shared)

    def shapes(self) -> dict[str, Any]:
        return {**super().shapes(), "kernel": f"deepgemm-sm90 {self.kernel}"}


def _synthetic_dense(e: int, h: int, i: int, seed: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(zlib.crc32(f"study-sm90/{seed}".encode()))
    bf16 = dict(generator=g, device=device, dtype=torch.bfloat16)
    return torch.randn(e, 2 * i, h, **bf16).mul_(h**-0.5), torch.randn(e, h, i, **bf16).mul_(
        i**-0.5)


def kernel_experts(cfg: StudyConfig, dense: LayerWeights | None, num_experts: int,
                   hidden: int, intermediate: int) -> dict[str, Any]:
    """The routed experts of :func:`moewire.study.layer.build_layer` on the real kernel.

    The dense weights of ``--weights`` (``dense``), or synthetic BF16 weights
    ``N(0, 1/fan_in)`` seeded from ``--seed``, quantized by the kernel's own weight recipe
    (:func:`moewire.integrations.deepgemm_sm90.quantize_weights`), and the kernel's symmetric
    buffer on a one-rank group.

    Returns:
        The :class:`RealKernelLayer` fields ``kernel``, ``kernel_weights``, ``symm_buffer``.
    """
    from moewire.integrations import deepgemm_sm90

    device = torch.device("cuda")
    kernel = _SM90_KERNEL[cfg.mma]
    if dense is not None:
        w1, w2 = dense.w1.to(device, torch.bfloat16), dense.w2.to(device, torch.bfloat16)
    else:
        w1, w2 = _synthetic_dense(num_experts, hidden, intermediate, cfg.seed, device)
    weights = deepgemm_sm90.quantize_weights(w1, w2, kernel)
    del w1, w2
    buffer = deepgemm_sm90.deep_gemm.get_symm_buffer_for_sm90_mega_moe(
        _one_rank_group(), num_experts, cfg.tokens, cfg.preset.top_k, hidden, intermediate)
    return {"kernel": kernel, "kernel_weights": weights, "symm_buffer": buffer}


def build_layer(cfg: StudyConfig, generator: torch.Generator) -> RealKernelLayer:
    """The study's layer on the real kernel: refuse where it cannot run (:func:`check`),
    then the study's one builder, :func:`moewire.study.layer.build_layer`, with this
    module's experts."""
    check(cfg)
    return study_layer.build_layer(cfg, generator, experts=kernel_experts,
                                   layer_cls=RealKernelLayer)
