"""The region-layout machinery both stand-in buffers share (``reference.buffer``), and the
one grouped matmul both kernels use (``_kernel._grouped_matmul``)."""

from __future__ import annotations

import pickle

import nvfp4_cases
import pytest
import reference_cases
import torch

from moewire.reference import _kernel, _weights_cache

BUFFERS = {
    "symm-vllm-0.33": lambda: reference_cases.build(t=11, shared=1).buf,
    "symm-bf16": lambda: reference_cases.build(t=11, mma="bf16xbf16", shared=1).buf,
    "symm-sm90-dlpack": lambda: reference_cases.build(t=11, flavour="deepgemm-sm90").buf,
    "nvfp4": lambda: nvfp4_cases.build(t=11, shared="mxfp8").buf,
}


def _views(buf) -> dict[str, torch.Tensor]:
    return {n: getattr(buf, n) for n in buf._view_names()}


def _offset(buf, view: torch.Tensor) -> int:
    return view.data_ptr() - buf.buffer.data_ptr()


@pytest.mark.parametrize("which", list(BUFFERS))
def test_views_and_combine_rows_lie_at_their_region(which):
    buf = BUFFERS[which]()
    for name, view in _views(buf).items():
        assert _offset(buf, view) == buf._moewire_regions[name][0], name
    rows = buf.combine_rows()
    assert _offset(buf, rows) == buf._moewire_regions["combine"][0]
    assert rows.shape == (buf.num_slots, buf.num_max_tokens_per_rank, buf.hidden)
    assert not hasattr(buf, "combine")  # no view exposes the combine region


@pytest.mark.parametrize("which", list(BUFFERS))
def test_pickled_buffer_slices_its_views_again(which):
    buf = BUFFERS[which]()
    copy = pickle.loads(pickle.dumps(buf))
    assert torch.equal(copy.buffer, buf.buffer)
    assert copy._moewire_regions == buf._moewire_regions
    for name, view in _views(copy).items():
        # In the copy's buffer, at the same offset: not a copy of its own.
        assert _offset(copy, view) == _offset(buf, getattr(buf, name)), name
        assert torch.equal(view.view(torch.uint8), getattr(buf, name).view(torch.uint8))
    copy.x.view(torch.uint8)[0, 0] ^= 1
    start = copy._moewire_regions["x"][0]
    assert copy.buffer[start] != buf.buffer[start]


@pytest.mark.parametrize("which", list(BUFFERS))
def test_destroyed_buffer_drops_its_views_and_stays_destroyed_when_pickled(which):
    buf = BUFFERS[which]()
    names = list(_views(buf))
    buf.destroy()
    copy = pickle.loads(pickle.dumps(buf))
    for b in (buf, copy):
        assert b.buffer is None and b.handle is None and b.group is None
        assert all(getattr(b, n) is None for n in names)


@pytest.mark.parametrize("which", ["fp8xfp4", "bf16xbf16", "nvfp4"])
def test_per_expert_fallback_equals_the_grouped_matmul(which, monkeypatch):
    """The loop over experts (no cached weights) and ``torch._grouped_mm`` give the same
    combine rows and ``y``, bit for bit (both accumulate each dot product in FP32)."""

    def run():
        _weights_cache.WEIGHT_CACHE.clear()
        if which == "nvfp4":
            case = nvfp4_cases.build(t=23, shared="mxfp8")
        else:
            case = reference_cases.build(t=23, mma=which, shared=1, cache_weights=False)
        return case.y, case.buf.combine_rows().clone()

    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    y_grouped, rows_grouped = run()
    assert calls  # the cached path ran torch._grouped_mm
    calls.clear()
    monkeypatch.setenv(_weights_cache.ENV_CACHE_BYTES, "0")
    y_loop, rows_loop = run()
    assert not calls  # no weights cached: the per-expert loop
    assert torch.equal(y_loop.view(torch.int16), y_grouped.view(torch.int16))
    assert torch.equal(rows_loop.view(torch.int16), rows_grouped.view(torch.int16))
    _weights_cache.WEIGHT_CACHE.clear()


class _Experts:
    """What ``_grouped_matmul`` reads of ``_weights_cache.Experts``: cached FP32 weights or none."""

    def __init__(self, weights: torch.Tensor, cached: bool) -> None:
        self.weights, self.n, self.dtype = weights, weights.shape[1], weights.dtype
        self.dense = weights if cached else None

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.weights[e]


@pytest.mark.parametrize("cached", [True, False], ids=["grouped-mm", "loop"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["cache-dtype", "fp32"])
def test_grouped_matmul_groups_rows_by_expert(cached, out_dtype):
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(3, 8, 16, generator=gen)
    x = torch.randn(10, 16, generator=gen)
    ends = torch.tensor([4, 4, 10], dtype=torch.int32)  # expert 1 gets no rows
    out = _kernel._grouped_matmul(x, _Experts(weights, cached), ends, out_dtype)
    assert out.dtype == torch.float32 and out.shape == (10, 8)
    torch.testing.assert_close(out, torch.cat([x[:4] @ weights[0].T, x[4:] @ weights[2].T]))


def test_the_capture_path_selects_each_experts_rows_like_the_loop():
    """``_masked_grouped_matmul`` (what a CUDA-graph capture takes when torch's grouped GEMM
    refuses FP32 out) gives each row its own expert's product, zeros past the last group,
    and the loop's values: small integers keep every product and sum exact, so any row sent
    to another expert (or an off-by-one at a group end) shows."""
    gen = torch.Generator().manual_seed(1)
    weights = torch.randint(-3, 4, (4, 8, 16), generator=gen).float()
    x = torch.randint(-3, 4, (13, 16), generator=gen).float()
    ends = torch.tensor([3, 3, 7, 11], dtype=torch.int32)  # expert 1 empty, rows 11-12 unused
    experts = _Experts(weights, cached=True)
    got = _kernel._masked_grouped_matmul(x, experts, ends)
    loop = _kernel._grouped_matmul(x, _Experts(weights, cached=False), ends)
    assert torch.equal(got[:11], loop[:11])
    assert torch.equal(got[11:], torch.zeros(2, 8))
    owner = [0, 0, 0, 2, 2, 2, 2, 3, 3, 3, 3]
    want = torch.stack([x[r] @ weights[e].T for r, e in enumerate(owner)])
    assert torch.equal(got[:11], want)
