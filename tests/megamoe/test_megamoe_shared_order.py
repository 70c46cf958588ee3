"""Where each build adds its fused shared row, first or last, proven on data where the order
changes the result; and the layout check proves that order before it marks a buffer.

On ordinary BF16 rows the FP32 sum is exact whatever the order, so adding the shared row
first or last gives the same ``y``: a build table entry with the wrong order would pass such
a batch. The crafted token here has routed rows ``2^16, 1, 1, 0`` and the shared row
``2^24`` in one column: first, ``2^24 + 2^16`` absorbs each ``+1`` (the FP32 spacing there is
2) and rounds to BF16 ``2^24`` (a tie, to even); last, ``2^16 + 2`` then ``+ 2^24`` is exact and
rounds to ``2^24 + 2^17``. Each batch also has a padding token (the shared row only) and a
token with an invalid slot, which rule out reading the shared row from another slot.

The checks run on :class:`moewire.megamoe.layout_check.Combine` as the experts wrapper
builds it (the build table's position for the kernel), with ``y`` from an oracle summing in
the order the build's source gives, written here independently of the table.
"""

from __future__ import annotations

import pytest
import torch

from moewire.megamoe import flavours, layout_check
from moewire.megamoe.layout_check import Combine, unproven_readings

K, TMAX, T, H = 4, 8, 6, 16

# (build, kernel) -> where the kernel's source adds the fused shared row. deepgemm-vllm-dev
# first: vllm-project/DeepGEMM at 63aa62a, impls/sm100_{fp8_fp4,bf16}_mega_moe.cuh
# ("Shared slot goes first"). The others: vLLM 0.33/0.34's bundled 2.8.1
# (sm100_fp8_fp4_mega_moe.cuh l.1464, sm100_bf16_mega_moe.cuh l.1286; nvfp4: ~l.1746-1807,
# last), vLLM 0.32's 2.8.0 (last), vllm-project/DeepGEMM 51655f2 (lanes in ascending order,
# the shared lane k last), sgl-deep-gemm 0.2.5 (first) and 0.2.3.post2 (last), DeepGEMM
# 2.8.0's SM100 kernels read as 2.8.1 (first).
SOURCE_POSITION = {
    ("deepgemm-vllm-dev", "fp8_fp4_mega_moe"): "first",
    ("deepgemm-vllm-dev", "bf16_mega_moe"): "first",
    ("vllm-0.33", "fp8_fp4_mega_moe"): "first",
    ("vllm-0.33", "bf16_mega_moe"): "first",
    ("vllm-0.33", "nvfp4_mega_moe"): "last",
    ("vllm-0.32", "fp8_fp4_mega_moe"): "last",
    ("vllm-0.32", "bf16_mega_moe"): "last",
    ("deepgemm-vllm-situ", "fp8_fp4_mega_moe"): "last",
    ("sgl-deep-gemm-0.2.5", "fp8_fp4_mega_moe"): "first",
    ("sgl-deep-gemm-0.2.3", "fp8_fp4_mega_moe"): "last",
    ("deepgemm-2.8", "fp8_fp4_mega_moe"): "first",
    ("deepgemm-2.8", "bf16_mega_moe"): "first",
}
# DeepGEMM 2.8.0's fp4_fp4_mega_moe adds its shared row after the routed sum was rounded and
# scaled (a routed_scale step); KernelLayout refuses "first" with that step, so the table
# cannot hold the other order for it (tests/megamoe/test_megamoe_fp4_fp4.py tests its sum).
ROUTED_SCALE_STEP = {("deepgemm-2.8", "fp4_fp4_mega_moe")}
OTHER = {"first": "last", "last": "first"}


class _Buffer:
    """A buffer object the layout check can tie its state to."""


def _batch(seed: int, crafted: bool):
    """BF16 rows ``[K + 1, TMAX, H]`` (the shared row at slot K), int64 ids ``[T, K]``:
    N(0, 1) rows, token 4 padding (no valid slot), token 5 with slot 2 invalid; with
    ``crafted``, token 0's column 0 shows the order (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn((K + 1, TMAX, H), generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(8, generator=gen)[:K] for _ in range(T)])
    ids[4] = -1
    ids[5, 2] = -1
    if crafted:
        ids[0] = torch.arange(K)
        rows[:, 0, 0] = torch.tensor([2.0**16, 1.0, 1.0, 0.0, 2.0**24])
    return rows, ids


def _oracle(rows: torch.Tensor, ids: torch.Tensor, position: str) -> torch.Tensor:
    """BF16 ``[T, H]``: FP32 from +0.0, the shared row ``position``, the valid routed rows in
    ascending slot order (router weight 1), one rounding."""
    acc = torch.zeros((T, H), dtype=torch.float32)
    if position == "first":
        acc = acc + rows[K, :T].float()
    for s in range(K):
        acc = torch.where((ids[:, s] >= 0)[:, None], acc + rows[s, :T].float(), acc)
    if position == "last":
        acc = acc + rows[K, :T].float()
    return acc.bfloat16()


def _call(build: str, kernel: str, rows, ids, y) -> Combine:
    """The combine as the experts wrapper builds it: the table's position for ``kernel``."""
    flavour = flavours.get(build)
    layout = flavour.layout(kernel)
    weights = torch.ones((T, K)) if layout.weighted else None
    return Combine(rows, ids, T, layout.shared_position, weights, y, flavour, kernel)


def _check_if_unchecked(buf, call: Combine) -> None:
    """What the experts wrapper does on every eager call: check until the buffer is marked."""
    state = layout_check.buffer_state(buf)
    if not state.checked:
        layout_check.check("layers.0.experts", state, call)


@pytest.fixture(autouse=True)
def fresh_checks():
    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


def test_every_fusing_table_entry_is_listed():
    fusing = {(f.name, kernel) for f in map(flavours.get, flavours.names())
              for kernel, layout in f.kernels.items() if layout.shared_position is not None}
    assert fusing == set(SOURCE_POSITION) | ROUTED_SCALE_STEP


@pytest.mark.parametrize(("build", "kernel"), list(SOURCE_POSITION),
                         ids=[f"{b}-{k}" for b, k in SOURCE_POSITION])
def test_each_build_adds_its_shared_row_where_its_source_does(build, kernel):
    """On data where the order changes ``y``, the check passes with ``y`` summed in the
    source's order and marks the buffer (every other reading refuted), and refuses ``y``
    summed with the shared row at the other end. Break: an entry of the build table with
    the other position."""
    rows, ids = _batch(seed=1, crafted=True)
    position = SOURCE_POSITION[(build, kernel)]
    want, other = _oracle(rows, ids, position), _oracle(rows, ids, OTHER[position])
    assert not torch.equal(want, other)  # the data tells the two orders apart
    right = _Buffer()
    _check_if_unchecked(right, _call(build, kernel, rows, ids, want))
    assert layout_check.layout_checked(right) and unproven_readings(right) == ()
    with pytest.raises(RuntimeError, match="layout check failed"):
        _check_if_unchecked(_Buffer(), _call(build, kernel, rows, ids, other))


def test_a_batch_that_cannot_show_the_order_leaves_it_unproven():
    """Ordinary rows give the same ``y`` first or last: the check passes, rules out the
    other slots, and leaves the buffer unchecked with the other end named as unproven.
    Break: mark the buffer once the slot readings are refuted."""
    rows, ids = _batch(seed=2, crafted=False)
    y = _oracle(rows, ids, "first")
    assert torch.equal(y, _oracle(rows, ids, "last"))
    buf = _Buffer()
    _check_if_unchecked(buf, _call("deepgemm-vllm-dev", "fp8_fp4_mega_moe", rows, ids, y))
    assert not layout_check.layout_checked(buf)
    assert unproven_readings(buf) == ("shared row added last",)


@pytest.mark.parametrize("kernel_adds", ["first", "last"], ids=["table-right", "table-wrong"])
def test_a_later_batch_proves_or_refutes_the_order(kernel_adds):
    """deepgemm-vllm-dev's table says first. A kernel that adds its shared row ``kernel_adds``
    passes a first batch of ordinary rows; the second batch's rows show the order: the
    right table is then proven (the buffer is marked), the wrong one refused, naming the
    reading the first batch left open. Break: mark the buffer after the first batch (the
    second is then never checked)."""
    build, kernel = "deepgemm-vllm-dev", "fp8_fp4_mega_moe"
    buf = _Buffer()
    rows, ids = _batch(seed=3, crafted=False)
    _check_if_unchecked(buf, _call(build, kernel, rows, ids, _oracle(rows, ids, kernel_adds)))
    assert unproven_readings(buf) == ("shared row added last",)
    rows, ids = _batch(seed=4, crafted=True)
    later = _call(build, kernel, rows, ids, _oracle(rows, ids, kernel_adds))
    if kernel_adds == "first":
        _check_if_unchecked(buf, later)
        assert layout_check.layout_checked(buf) and unproven_readings(buf) == ()
    else:
        with pytest.raises(RuntimeError, match="left unproven: shared row added last"):
            _check_if_unchecked(buf, later)
        assert not layout_check.layout_checked(buf)


def test_the_shared_pass_check_accepts_an_exact_negative_zero():
    """The fused shared expert's own launch (no routed slot) returns ``bf16(+0.0 +
    float(row))``: a stored ``-0.0`` comes back as ``+0.0``, and a correct kernel must not be
    refused for the sign of a zero. A ``y`` one ulp off is still refused. Break: compare
    ``y`` with the stored row as it is (without the ``+0.0`` start of the kernel's sum)."""
    gen = torch.Generator().manual_seed(5)
    stored = torch.randn((T, H), generator=gen).bfloat16()
    stored[0, :4] = -0.0
    stored[1, 3] = -0.0
    y = (torch.zeros((T, H)) + stored.float()).bfloat16()  # the kernel's sum of one row
    assert (y[0, :4].view(torch.int16) == 0).all()  # +0.0, not -0.0
    flavour = flavours.get("deepgemm-vllm-dev")
    state = layout_check.buffer_state(_Buffer())
    layout_check.check_shared_pass("layers.0.experts", state, stored, y, flavour,
                                   "fp8_fp4_mega_moe")
    off = y.clone()
    off[2, 5] = (off[2, 5].view(torch.int16) + 1).view(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"did not return the row .* \(1 of 6 tokens differ\)"):
        layout_check.check_shared_pass("layers.0.experts", state, stored, off, flavour,
                                       "fp8_fp4_mega_moe")
