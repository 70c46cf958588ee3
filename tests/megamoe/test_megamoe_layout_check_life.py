"""The layout check's state lives as long as the buffer object it describes.

A check keyed by an address would let a new buffer that lands where a checked one was
count as checked already: a silent pass of the layout check. Here a pool allocator (what a
caching allocator, or DeepGEMM's ``SymmBuffer(..., base=...)`` sharing one allocation, does)
hands the same memory, as the same tensor, to every buffer of one size.
"""

from __future__ import annotations

import gc
import types

import pytest
import torch
from mm_helpers import SHAPES, Model, batch, region

from moewire.megamoe import layout_check
from moewire.megamoe.convert import convert
from moewire.megamoe.layout_check import layout_checked
from moewire.quantizer import WireQuantizer
from moewire.reference import buffer as reference_buffer
from moewire.reference import deep_gemm

T = 20


@pytest.fixture(autouse=True)
def fresh_checks():
    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


@pytest.fixture
def pooled(monkeypatch):
    """Every stand-in buffer of a given size gets the same flat tensor (same address)."""
    pool: dict[tuple[int, str], torch.Tensor] = {}

    def allocate(num_bytes, device, group, num_ranks):
        key = (num_bytes, str(device))
        if key not in pool:
            pool[key] = torch.empty(num_bytes, dtype=torch.int8, device=device)
        return pool[key], None

    monkeypatch.setattr(reference_buffer, "allocate", allocate)
    return pool


def _quantized_layer():
    model = Model(n=1)
    experts = convert(model.layers[0].experts, "layers.0.experts")
    experts.combine_quantizer = WireQuantizer("mxfp8")
    return model, experts


def _corrupting(real):
    def kernel(y, l1, l2, buf, **kwargs):
        real(y, l1, l2, buf, **kwargs)
        t, s = torch.nonzero(buf.topk_idx[: y.shape[0]] >= 0)[0].tolist()
        region(buf)[s, t, 3] += 1.0

    return kernel


def test_a_new_buffer_at_a_freed_buffers_address_is_checked_again(pooled, monkeypatch):
    """Break: key the check by ``(device, buffer.data_ptr())`` (as an earlier version did): the
    second buffer counts as checked and the corrupted rows pass silently."""
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=70)
    model, experts = _quantized_layer()
    experts(x, w, ids)
    first = experts.get_symm_buffer()
    assert layout_checked(first)
    address = first.buffer.data_ptr()
    del model, experts, first
    gc.collect()  # the checked buffer object is gone (the stand-in caches it weakly)

    model, experts = _quantized_layer()
    second = experts.get_symm_buffer()
    assert second.buffer.data_ptr() == address  # the freed buffer's memory, reused
    assert not layout_checked(second)
    monkeypatch.setattr(deep_gemm, "bf16_mega_moe", _corrupting(deep_gemm.bf16_mega_moe))
    with pytest.raises(RuntimeError, match=r"layers\.0\.experts: the Mega-MoE layout check"):
        experts(x, w, ids)


def test_check_state_goes_with_the_buffer(pooled):
    """Break: hold the buffer strongly in the registry: the entry outlives its buffer."""
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=71)
    model, experts = _quantized_layer()
    experts(x, w, ids)
    assert len(layout_check._CHECKS) == 1
    del model, experts
    gc.collect()
    assert len(layout_check._CHECKS) == 0


def test_a_buffer_without_weak_references_carries_its_check_and_forgets_it_on_reset():
    """Break: skip the generation in ``reset_layout_checks``: the attribute keeps
    ``checked`` across a reset."""
    buffer = types.SimpleNamespace()
    layout_check.buffer_state(buffer).checked = True
    assert layout_checked(buffer)
    layout_check.reset_layout_checks()
    assert not layout_checked(buffer)


def test_a_buffer_with_neither_weak_references_nor_attributes_is_refused():
    class Slotted:
        __slots__ = ("buffer",)

    with pytest.raises(TypeError, match="neither a weak reference nor an attribute"):
        layout_check.buffer_state(Slotted())
