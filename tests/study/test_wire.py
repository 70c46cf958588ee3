"""Bytes on the wire per token and the off-rank fraction, against hand counts."""

import pytest
import torch

from moewire.study.wire import remote_fraction, wire_cost


def test_nvfp4_dispatch_fp8_combine_at_v4_flash_width():
    # nvfp4: 4 bits x 4096 + one 8-bit scale per 16 (256 scales) = 18432 bits = 2304 B;
    # fp8 per tensor: 4096 B. Six copies each way; BF16 is 2 x 6 x 8192 B.
    cost = wire_cost("nvfp4", "fp8", hidden=4096, top_k=6)
    assert cost.dispatch_bytes_per_token == 6 * 2304
    assert cost.combine_bytes_per_token == 6 * 4096
    assert cost.bytes_per_token == 38400
    assert cost.ratio_to_bf16 == 38400 / 98304


def test_bf16_both_ways_is_the_unit():
    cost = wire_cost("bf16", "bf16", hidden=512, top_k=4)
    assert cost.bytes_per_token == 2 * 4 * 1024
    assert cost.ratio_to_bf16 == 1.0


def test_mx_block_scales_are_counted():
    # mxfp8: 8 bits + one 8-bit scale per 32 -> 8.25 bits per element.
    cost = wire_cost("mxfp8", "mxfp4", hidden=1024, top_k=1)
    assert cost.dispatch_bytes_per_token == 1024 * 8.25 / 8
    assert cost.combine_bytes_per_token == 1024 * 4.25 / 8


@pytest.mark.parametrize(
    "ids, ranks, per_rank, want",
    [
        ([[0, 2], [1, 3]], 2, 1, 0.5),
        ([[0, 1], [2, 3]], 2, 1, 0.0),
        ([[2, 3], [0, 1]], 2, 1, 1.0),
        ([[0, -1], [3, -1]], 2, 1, 0.0),
        ([[2, -1], [3, 0]], 2, 1, 2 / 3),
        ([[0, 2], [1, 3]], 1, 2, 0.0),
    ],
    ids=["half", "all-local", "all-remote", "masked-local", "masked-mixed", "one-rank"],
)
def test_remote_fraction(ids, ranks, per_rank, want):
    # Four experts: with two ranks, experts 0-1 live on rank 0 and 2-3 on rank 1.
    got = remote_fraction(torch.tensor(ids), num_experts=4, num_ranks=ranks,
                          tokens_per_rank=per_rank)
    assert got == pytest.approx(want, abs=0)
