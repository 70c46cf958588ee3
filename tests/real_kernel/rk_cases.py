"""Shapes, weights, routing and the oracle of the real-kernel tier (GPU only)."""

from __future__ import annotations

import os
import socket
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moewire import formats
from moewire.integrations.deepgemm_sm90 import SM90MegaMoEExperts, deep_gemm, quantize_weights


def one_rank_group() -> dist.ProcessGroup:
    """A one-rank NCCL group on GPU 0 (the SM90 buffer is torch symmetric memory over a
    group), NVLink multicast kept off; the pytest fixture and the child processes share it."""
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                      NVSHMEM_DISABLE_NVLS="1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1,
                            rank=0, device_id=torch.device("cuda:0"))
    return dist.new_group([0])

KERNELS = ("fp8_mega_moe", "fp8_fp4_mega_moe")


@dataclass(frozen=True)
class Shape:
    """One MoE layer as one GPU holds it (E: experts on this rank = all experts, 1 rank)."""

    name: str
    experts: int
    hidden: int
    inter: int
    top_k: int
    tokens: int
    padding: int


SHAPES = (
    Shape("tiny", 16, 2048, 1024, 6, 100, 8),
    # DeepSeek-V4-Flash's routed experts, all 256 on one GPU.
    Shape("v4flash", 256, 4096, 2048, 6, 512, 16),
    # Kimi-K3's top-16 layer as one rank of EP8 holds it (896 / 8 = 112 experts).
    Shape("kimik3-ep8-rank", 112, 3584, 3072, 16, 256, 8),
)
SHAPE_IDS = [s.name for s in SHAPES]
TINY = SHAPES[0]


def seed_of(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def _gen(*parts: object) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed_of(*parts))


_BUILT: dict[tuple[str, str], tuple] = {}


def prepared(kernel: str, shape: Shape, group) -> tuple:
    """``(l1_weights, l2_weights, symm_buffer)`` for ``kernel`` at ``shape``, built once."""
    key = (kernel, shape.name)
    if key not in _BUILT:
        g = _gen("weights", shape.name)
        e, h, i = shape.experts, shape.hidden, shape.inter
        bf16 = dict(generator=g, device="cuda", dtype=torch.bfloat16)
        l1 = torch.randn(e, 2 * i, h, **bf16).mul_(h**-0.5)
        l2 = torch.randn(e, h, i, **bf16).mul_(i**-0.5)
        w1, w2 = quantize_weights(l1, l2, kernel)
        del l1, l2
        buf = deep_gemm.get_symm_buffer_for_sm90_mega_moe(
            group, e, shape.tokens, shape.top_k, h, i
        )
        _BUILT[key] = (w1, w2, buf)
    return _BUILT[key]


def experts(kernel: str, shape: Shape, group) -> SM90MegaMoEExperts:
    """A fresh module on the shared weights and buffer of ``(kernel, shape)``."""
    w1, w2, buf = prepared(kernel, shape, group)
    return SM90MegaMoEExperts(w1, w2, buf, kernel)


def batch(shape: Shape, tag: str, *, padding_only: bool = False):
    """``(x BF16 [T, H], topk_weights FP32 [T, k], topk_ids int64 [T, k], single)``.

    Random distinct experts per token; a quarter of the slots masked (-1, weight 0); tokens
    0..3 with exactly one valid slot (``single`` = their slots); token 4 with every slot
    valid; the last ``padding`` tokens with none.
    """
    t, e, k = shape.tokens, shape.experts, shape.top_k
    g = _gen("batch", shape.name, tag)
    x = torch.randn(t, shape.hidden, generator=g, device="cuda").bfloat16()
    scores = torch.randn(t, e, generator=g, device="cuda")
    weights, ids = torch.topk(scores, k, dim=-1)
    weights = weights.softmax(-1)
    masked = torch.rand(t, k, generator=g, device="cuda") < 0.25
    single = [0, k - 1, 1, k - 2]
    for tok, slot in enumerate(single):
        masked[tok] = True
        masked[tok, slot] = False
    masked[len(single)] = False
    masked[t - shape.padding :] = True
    if padding_only:
        masked[:] = True
    return x, weights.masked_fill(masked, 0.0), ids.masked_fill(masked, -1), single


def rows_of(symm_buffer, num_tokens: int) -> torch.Tensor:
    """The combine rows by the tail rule (layout/mega_moe.cuh), independently of moewire's
    flavours."""
    k, tmax, h = symm_buffer.num_topk, symm_buffer.num_max_tokens_per_rank, symm_buffer.hidden
    nbytes = k * tmax * h * 2
    flat = symm_buffer.buffer
    return flat[flat.numel() - nbytes :].view(torch.bfloat16).view(k, tmax, h)[:, :num_tokens]


def oracle(rows, topk_ids, fmt=None, amax=None, descending=False) -> torch.Tensor:
    """DeepGEMM's combine: per token, FP32 from +0.0 over the valid slots in order (each row through
    ``fmt``'s torch reference first: its BF16 QDQ, or its FP32 dequantized values for a format
    whose real combine accumulates in FP32), one BF16 rounding."""
    k, t, h = rows.shape
    if fmt is not None:
        f = formats.get(fmt)
        rows = f.dequantize(rows, amax) if f.combine_accumulate == "fp32" else f.qdq(rows, amax)
    acc = torch.zeros(t, h, dtype=torch.float32, device=rows.device)
    valid = topk_ids[:t] >= 0
    for s in (range(k - 1, -1, -1) if descending else range(k)):
        acc = torch.where(valid[:, s, None], acc + rows[s].float(), acc)
    return acc.bfloat16()


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


def valid_amax(rows, topk_ids) -> float:
    valid = (topk_ids[: rows.shape[1]] >= 0).T
    return float(rows.float()[valid].abs().max())
