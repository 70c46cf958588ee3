"""Real vLLM 0.32 Mega-MoE experts on CPU: a minimal vLLM config, gloo EP, seeded weights."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator

import torch

E, K, H, INTER = 4, 2, 512, 512
PREFIX = "model.layers.0.ffn.experts"


def make_config(max_tokens: int = 64):
    from vllm.config import ParallelConfig, SchedulerConfig, VllmConfig

    return VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_tokens,
            max_num_seqs=8,
            max_model_len=max_tokens,
            is_encoder_decoder=False,
        ),
        parallel_config=ParallelConfig(enable_expert_parallel=True),
    )


@contextlib.contextmanager
def vllm_world(rank: int, world_size: int, init_file: str) -> Iterator[object]:
    """vLLM's config context and distributed state (gloo; EP group = all ranks)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    os.environ.setdefault("VLLM_MOE_SKIP_PADDING", "1")
    config = make_config()
    config.parallel_config.tensor_parallel_size = world_size
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=world_size,
            rank=rank,
            distributed_init_method=f"file://{init_file}",
            local_rank=rank,
            backend="gloo",
        )
        ensure_model_parallel_initialized(world_size, 1)
        yield config


def make_experts(
    config, rank: int = 0, world_size: int = 1, seed: int = 0, prefix: str = PREFIX,
    num_shared_experts: int = 0,
):
    """The real ``DeepseekV4MegaMoEExperts`` with seeded checkpoint-format weights.

    Expert ``e``'s FP4 bytes and UE8M0 scale bytes come from a generator seeded with
    ``seed * 1000 + e``, so every rank builds the same expert from the same numbers.
    """
    from vllm.models.deepseek_v4.nvidia.model import DeepseekV4MegaMoEExperts

    local = E // world_size
    experts = DeepseekV4MegaMoEExperts(
        config,
        num_experts=E,
        num_local_experts=local,
        experts_start_idx=rank * local,
        top_k=K,
        hidden_size=H,
        intermediate_size=INTER,
        num_shared_experts=num_shared_experts,
        prefix=prefix,
    )
    for j in range(local):
        g = torch.Generator().manual_seed(seed * 1000 + rank * local + j)
        for name in ("w13_weight", "w2_weight"):
            param = getattr(experts, name)
            param.data[j] = torch.randint(0, 256, param.shape[1:], dtype=torch.uint8, generator=g)
        for name in ("w13_weight_scale", "w2_weight_scale"):
            param = getattr(experts, name)
            # Exponents 122..126: weights of magnitude 2^-5..2^-1, outputs stay finite.
            param.data[j] = torch.randint(122, 127, param.shape[1:], dtype=torch.uint8, generator=g)
    return experts


def routing(num_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_tokens, H, generator=g) * 2).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, K, generator=g)
    return x, ids, weights


def oracle_rows(buffer, num_slots: int, flavour: str = "vllm-0.32") -> torch.Tensor:
    """BF16 ``[num_slots, Tmax, H]`` view of the combine region (DeepGEMM `layout/mega_moe.cuh`).

    ``vllm-0.32``/``deepgemm-main``: the last region of the buffer; ``vllm-0.33`` and
    ``deepgemm-sm90``: it starts where the ``l2_acts_sf`` view ends (``l2_acts`` without
    scales).
    """
    tmax, hidden = buffer.num_max_tokens_per_rank, buffer.hidden
    nbytes = num_slots * tmax * hidden * 2
    flat = buffer.buffer.view(torch.int8).reshape(-1)
    if flavour in ("vllm-0.33", "deepgemm-sm90"):
        sf = buffer.l2_acts_sf if buffer.l2_acts_sf is not None else buffer.l2_acts
        base = sf.data_ptr() + sf.numel() * sf.element_size() - flat.data_ptr()
    else:
        base = flat.numel() - nbytes
    return flat[base : base + nbytes].view(torch.bfloat16).view(num_slots, tmax, hidden)


def oracle_resum(
    rows: torch.Tensor, topk_idx: torch.Tensor, num_tokens: int, shared: str | None = None
) -> torch.Tensor:
    """FP32 sum from +0.0 over valid slots in ascending order, one BF16 rounding
    (DeepGEMM's combine).

    A fused shared row is stored at slot ``k`` (always valid); ``shared="last"`` adds it
    after the routed slots, ``"first"`` before them.
    """
    k = topk_idx.shape[1]
    out = torch.zeros(num_tokens, rows.shape[-1], dtype=torch.float32)
    if shared == "first":
        out = out + rows[k, :num_tokens].float()
    for s in range(k):
        valid = (topk_idx[:num_tokens, s] >= 0)[:, None]
        out = torch.where(valid, out + rows[s, :num_tokens].float(), out)
    if shared == "last":
        out = out + rows[k, :num_tokens].float()
    return out.bfloat16()


def order_visible_kernel(real: Callable, k: int, shared_first: bool | None = None) -> Callable:
    """The stand-in kernel ``real``, then token 0's rows rewritten so that the FP32 sum order
    survives the BF16 rounding (routed -2^24, 0.5, 0.. and the shared row 2^24, stored at
    slot k) and ``y`` as a build adding the shared row first (2^24 - 2^24 + 0.5 = 0.5) or
    last (-2^24 + 0.5 rounds to -2^24 in FP32, + 2^24 = 0) would give. ``shared_first``:
    that build's order; ``None``: the order of the stand-in flavour the buffer was built with.
    """

    @functools.wraps(real)
    def kernel(y, l1, l2, buf, **kwargs):
        real(y, l1, l2, buf, **kwargs)
        tmax, h = buf.num_max_tokens_per_rank, buf.hidden
        rows = oracle_rows(buf, k + 1, buf._moewire_flavour)
        assert rows.shape == (k + 1, tmax, h)
        rows[:, 0, 0] = 0.0
        rows[:2, 0, 0] = torch.tensor([-(2.0**24), 0.5], dtype=torch.bfloat16)
        rows[k, 0, 0] = 2.0**24
        first = buf.build.shared_position == "first" if shared_first is None else shared_first
        y[0, 0] = 0.5 if first else 0.0

    return kernel
