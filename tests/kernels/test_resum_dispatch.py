"""``resum``'s dispatch to the fused Triton kernel, exercised on CPU.

``resum`` takes the kernel path only for CUDA rows, so CI (no GPU) never ran it. Here the
rows are a CPU tensor labelled CUDA (a tensor subclass whose ``is_cuda`` is True) and
``kernels.available()`` answers True; ``kernels.fused_combine`` is wrapped by a recorder that
checks the arguments ``resum`` passes and then runs the real kernel under Triton's
interpreter. The result must equal the torch path bit for bit.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from bitexact import assert_same_bits, seed_of
from order_cases import make_case, stored_rows

pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("CUDA present: the GPU tier runs the real dispatch", allow_module_level=True)

from moewire import kernels  # noqa: E402
from moewire.megamoe.resum import resum  # noqa: E402
from moewire.quantizer import WireQuantizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


class LabelledCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: ``resum`` then takes its kernel branch."""

    @property
    def is_cuda(self) -> bool:
        return True


@pytest.fixture
def recorder(monkeypatch):
    """Record every ``kernels.fused_combine`` call (bound arguments), then run the kernel."""
    real = kernels.fused_combine
    calls = []

    def fused_combine(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)
        calls.append(dict(bound.arguments))
        plain = [a.as_subclass(torch.Tensor) if isinstance(a, LabelledCuda) else a for a in args]
        return real(*plain, **kwargs)

    monkeypatch.setattr(kernels, "available", lambda: True)
    monkeypatch.setattr(kernels, "fused_combine", fused_combine)
    return calls


CASES = {
    "fp8": dict(constant_amax=20.0),
    "nvfp4": dict(constant_amax=30.0),
    "mxfp4": {},
}


@pytest.mark.parametrize("weighted", [False, True], ids=["weighted-rows", "fma-weights"])
@pytest.mark.parametrize(
    "position", [None, "first", "last"], ids=["no-shared", "shared-first", "shared-last"]
)
@pytest.mark.parametrize("fmt", CASES)
def test_resum_dispatches_to_the_kernel_with_the_quantizers_amax(
    recorder, fmt, position, weighted
):
    seed = seed_of("dispatch", fmt, position, weighted)
    routed, shared, idx, t = make_case(seed, hidden=256)
    rows = stored_rows(routed, shared, position)
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(idx.shape, generator=gen) if weighted else None
    quantizer = WireQuantizer(fmt, **CASES[fmt])
    want = resum(
        rows, idx, t, shared_position=position, weights=weights, row_quantizer=quantizer
    )
    assert recorder == [], "plain CPU rows must take the torch path"

    out = torch.full((t, rows.shape[2]), float("nan"), dtype=torch.bfloat16)
    got = resum(
        rows.as_subclass(LabelledCuda), idx, t, shared_position=position, weights=weights,
        row_quantizer=quantizer, out=out,
    )
    assert len(recorder) == 1, "resum did not call the fused kernel for CUDA rows"
    call = recorder[0]
    assert call["fmt"] is quantizer.fmt.facts, "resum passes the format's row of the table"
    assert call["shared_position"] == position
    assert call["weights"] is weights
    assert call["out"] is out and got is out
    assert call["num_tokens"] == t and call["topk_idx"] is idx
    if quantizer.fmt.needs_amax:
        assert call["amax"] is quantizer.static_amax, "the quantizer's amax was not passed"
    else:
        assert call["amax"] is None
    assert_same_bits(out, want, seed=seed, what=f"kernel path vs torch path, {fmt} {position}")


@pytest.mark.parametrize(
    "row_quantizer",
    [
        None,
        lambda r: r * 2,
        WireQuantizer("logfmt10"),
        WireQuantizer("fp8", constant_amax=4.0, enable=False),
    ],
    ids=["no-quantizer", "plain-callable", "no-kernel-format", "disabled"],
)
def test_resum_keeps_the_torch_path_where_the_kernel_does_not_apply(recorder, row_quantizer):
    routed, shared, idx, t = make_case(seed_of("no-dispatch"), hidden=256)
    rows = stored_rows(routed, shared, None)
    want = resum(rows, idx, t, row_quantizer=row_quantizer)
    got = resum(rows.as_subclass(LabelledCuda), idx, t, row_quantizer=row_quantizer)
    assert recorder == []
    assert_same_bits(got.as_subclass(torch.Tensor), want, seed=None, what="torch path")
