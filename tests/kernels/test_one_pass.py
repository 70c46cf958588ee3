"""The wrapper's one-pass combine: while a buffer is unchecked, the fused
kernel quantizes, re-sums and runs the layout check in one pass over the rows.

On CUDA the wrapper takes this path by itself (``layout_check.one_pass``). Here, without a GPU,
the same code runs on CPU tensors under Triton's interpreter: ``_one_pass`` is patched to
skip its ``is_cuda`` test, everything else is the product's code. Each case is compared
with the torch path of the same layer (``MOEWIRE_DISABLE_KERNELS``-equivalent: the
unpatched gate) and must give the same bits, the same refusals and the same proof of which
stored row is the shared one.
"""

from __future__ import annotations

import pytest
import torch
from tests.megamoe.mm_helpers import SHAPES, Model, batch, region

from bitexact import assert_same_bits

pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("CUDA present: the GPU tier runs the one-pass path itself",
                allow_module_level=True)

from layout_proof import slots_proven
from moewire import kernels  # noqa: E402
from moewire.megamoe import layout_check  # noqa: E402
from moewire.megamoe.convert import convert  # noqa: E402
from moewire.megamoe.layout_check import layout_checked  # noqa: E402
from moewire.quantizer import WireQuantizer  # noqa: E402
from moewire.reference import deep_gemm, forward_context  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

T = 20
HIDDEN = SHAPES["bf16xbf16"][0]


@pytest.fixture(autouse=True)
def fresh_checks():
    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


@pytest.fixture
def one_pass(monkeypatch):
    """Take the one-pass path on CPU (interpreter) and record the kernel and torch calls."""
    calls = {"kernel": [], "resum": 0}
    real_kernel, real_resum = kernels.fused_combine, layout_check.resum

    def gate(quantizer, y):
        fmt = getattr(quantizer, "fmt", None)
        return quantizer.mode == "quantize" and fmt is not None and kernels.supports(fmt.name)

    def kernel(*args, **kwargs):
        calls["kernel"].append((args, kwargs))
        return real_kernel(*args, **kwargs)

    def counted_resum(*args, **kwargs):
        calls["resum"] += 1
        return real_resum(*args, **kwargs)

    monkeypatch.setattr(layout_check, "one_pass", gate)
    monkeypatch.setattr(kernels, "fused_combine", kernel)
    monkeypatch.setattr(layout_check, "resum", counted_resum)
    return calls


def _layer(fused=0, fmt="mxfp4"):
    model = Model(n=1, fused=fused)
    experts = model.layers[0].experts
    convert(experts, "layers.0.experts")
    experts.combine_quantizer = WireQuantizer(fmt, **({"constant_amax": 6.0}
                                                      if fmt in ("fp8", "nvfp4") else {}))
    return experts


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_b128"])
@pytest.mark.parametrize("fused", [0, 1], ids=["no-shared", "fused-shared"])
def test_one_pass_equals_the_torch_path(one_pass, fmt, fused, monkeypatch):
    x, w, ids = batch(T, HIDDEN, seed=40)
    ids[3] = -1  # a padding-like token: proves the shared row when one is fused
    experts = _layer(fused, fmt)
    got = experts(x, w, ids)
    assert len(one_pass["kernel"]) == 1, "check and quantize must be one kernel pass"
    args, kwargs = one_pass["kernel"][0]
    assert args[7] is not None and args[8] is not None, "the kernel did not run the check"
    # No torch re-sum for the check; with a fused shared row, only the alternative
    # readings that prove which stored row is the shared one (k of them) and where it is
    # added (the other end of the sum).
    assert one_pass["resum"] == (5 if fused else 0)
    assert slots_proven(experts.get_symm_buffer()) if fused else layout_checked(
        experts.get_symm_buffer())

    monkeypatch.undo()
    layout_check.reset_layout_checks()
    want = _layer(fused, fmt)(x, w, ids)
    assert_same_bits(got, want, seed=40, what=f"one pass vs torch path, {fmt}")


def test_one_pass_refuses_a_wrong_flavour_with_the_token_count(one_pass):
    experts = _layer()
    x, w, ids = batch(T, HIDDEN, seed=10)
    with deep_gemm.use_flavour("vllm-0.32"), pytest.raises(
        RuntimeError, match=r"layers\.0\.experts: .*layout check failed.*compared tokens differ"
    ):
        experts(x, w, ids)


def test_one_pass_sees_a_corrupted_row(one_pass, monkeypatch):
    experts = _layer()
    real = deep_gemm.bf16_mega_moe

    def corrupting(y, l1, l2, buf, **kwargs):
        real(y, l1, l2, buf, **kwargs)
        t, s = torch.nonzero(buf.topk_idx[: y.shape[0]] >= 0)[0].tolist()
        region(buf)[s, t, 3] += 1.0

    monkeypatch.setattr(deep_gemm, "bf16_mega_moe", corrupting)
    x, w, ids = batch(T, HIDDEN, seed=13)
    with pytest.raises(RuntimeError, match=r"\(1 of \d+ compared tokens differ\)"):
        experts(x, w, ids)
    assert not layout_checked(experts.get_symm_buffer())


def test_one_pass_keeps_the_blind_spot_closed(one_pass, monkeypatch):
    """All-valid batches do not prove which stored row is the shared one; a token with the
    shared row only does (through the one-pass path)."""
    experts = _layer(fused=1)
    buf = experts.get_symm_buffer()
    x, w, ids = batch(T, HIDDEN, seed=31, masked=0.0)
    experts(x, w, ids)
    assert not layout_checked(buf)
    pad = torch.zeros(T, dtype=torch.bool)
    pad[3] = True
    with forward_context(is_padding=pad):
        experts(x, w, ids)
    assert slots_proven(buf)


def test_one_pass_compares_tokens_that_have_only_the_shared_row(one_pass, monkeypatch):
    """With a fused shared expert every token is compared, also one without a routed row:
    a wrong shared row there must fail the kernel's check as it fails the torch check."""
    experts = _layer(fused=1)
    real = deep_gemm.bf16_mega_moe

    def corrupt_shared_only_token(y, l1, l2, buf, **kwargs):
        real(y, l1, l2, buf, **kwargs)
        rows = region(buf)
        rows[-1, 3, 5] += 1.0

    monkeypatch.setattr(deep_gemm, "bf16_mega_moe", corrupt_shared_only_token)
    x, w, ids = batch(T, HIDDEN, seed=35)
    ids[3] = -1
    with pytest.raises(RuntimeError, match=r"\(1 of \d+ compared tokens differ\)"):
        experts(x, w, ids)


def test_the_gate_follows_resum(monkeypatch):
    """``_one_pass`` takes CUDA outputs with a quantize-mode quantizer whose format has a
    kernel, and nothing else."""
    monkeypatch.setattr(kernels, "available", lambda: True)
    cpu = torch.empty(2, 128, dtype=torch.bfloat16)
    assert not layout_check.one_pass(WireQuantizer("mxfp4"), cpu)

    class Cuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    y = cpu.as_subclass(Cuda)
    assert layout_check.one_pass(WireQuantizer("mxfp4"), y)
    assert not layout_check.one_pass(WireQuantizer("logfmt10"), y)
    assert not layout_check.one_pass(WireQuantizer("mxfp4", enable=False), y)
    calibrating = WireQuantizer("mxfp4")
    with calibrating.calibrating():
        assert not layout_check.one_pass(calibrating, y)
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert not layout_check.one_pass(WireQuantizer("mxfp4"), y)




def test_a_kernel_check_the_torch_check_does_not_confirm_is_reported(one_pass, monkeypatch):
    """If the fused kernel counts mismatches that the torch check does not find, the wrapper
    says so (a moewire bug) instead of replacing ``y`` or marking the buffer checked."""
    experts = _layer()
    recording = kernels.fused_combine

    def miscounting(*args, **kwargs):
        out = recording(*args, **kwargs)
        args[8].add_(3)  # check_flag
        return out

    monkeypatch.setattr(kernels, "fused_combine", miscounting)
    x, w, ids = batch(T, HIDDEN, seed=41)
    with pytest.raises(RuntimeError, match=r"counted 3 mismatching elements, but the torch "
                       r"check found none: a moewire bug; set MOEWIRE_DISABLE_KERNELS=1"):
        experts(x, w, ids)
    assert not layout_checked(experts.get_symm_buffer())
