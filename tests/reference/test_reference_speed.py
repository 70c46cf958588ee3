"""DeepSeek-V4-Flash-sized timing: one EP rank's share of a 4-rank layer.

V4-Flash: 256 experts, top-6, H=4096, I=2048; over 4 ranks each rank owns 64 experts and,
with 1024 tokens per rank and uniform routing, its experts receive about 1024 * 6 rows. A
one-rank buffer with 64 experts and 1024 tokens does exactly that per-rank work (minus the
all-to-all, which the multi-rank tests cover), so it measures the kernel on one core set
without four copies of 6.4 GB of dequantized weights. Weights use ``make_weights(distinct=4)``
so that building them takes seconds.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from moewire.reference import _weights_cache, deep_gemm, make_weights, stage_mega_moe_inputs

E_LOCAL, TOPK, HIDDEN, INTER, TOKENS = 64, 6, 4096, 2048, 1024


def _time_rank_share(device: str) -> tuple[float, float]:
    buf = deep_gemm.get_symm_buffer_for_mega_moe(
        None, E_LOCAL, TOKENS, TOPK, HIDDEN, INTER, device=device
    )
    weights = make_weights(E_LOCAL, HIDDEN, INTER, distinct=4, device=device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((TOKENS, HIDDEN), generator=gen).bfloat16().to(device)
    ids = torch.stack([torch.randperm(E_LOCAL, generator=gen)[:TOPK] for _ in range(TOKENS)])
    w = torch.rand((TOKENS, TOPK), generator=gen)
    stage_mega_moe_inputs(x, ids.to(device), w.to(device), buf)
    y = torch.empty((TOKENS, HIDDEN), dtype=torch.bfloat16, device=device)
    times = []
    for _ in range(2):  # the first call dequantizes the weights into the cache
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        deep_gemm.fp8_fp4_mega_moe(y, weights.l1, weights.l2, buf)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    assert torch.isfinite(y.float()).all() and y.float().abs().mean() > 0
    rows = buf.buffer[-TOPK * buf.num_max_tokens_per_rank * HIDDEN * 2 :].view(torch.bfloat16)
    rows = rows.view(TOPK, -1, HIDDEN)[:, :TOKENS].float()
    acc = torch.zeros_like(rows[0])
    for s in range(TOPK):  # every slot is valid here: the re-sum is a plain ordered sum
        acc += rows[s]
    assert torch.equal(acc.bfloat16(), y)
    return times[0], times[1]


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("MOEWIRE_REFERENCE_V4_FLASH"),
    reason="set MOEWIRE_REFERENCE_V4_FLASH=1 to run (needs ~9 GB of RAM and minutes)",
)
def test_v4_flash_rank_share_on_cpu(monkeypatch, capsys):
    monkeypatch.setenv(_weights_cache.ENV_CACHE_BYTES, str(8 << 30))
    first, warm = _time_rank_share("cpu")
    with capsys.disabled():
        print(f"\nV4-Flash rank share on CPU ({torch.get_num_threads()} threads): "
              f"first call {first:.2f} s (dequantizes), warm call {warm:.2f} s")


@pytest.mark.gpu
@pytest.mark.slow
def test_v4_flash_rank_share_on_cuda(capsys):
    first, warm = _time_rank_share("cuda")
    with capsys.disabled():
        print(f"\nV4-Flash rank share on CUDA: first call {first * 1e3:.1f} ms, "
              f"warm call {warm * 1e3:.1f} ms")
