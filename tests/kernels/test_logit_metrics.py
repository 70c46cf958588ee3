"""The fused metrics kernel of ``moewire eval`` (``moewire.kernels.logit_metrics``) against
float64 torch: the KL per token to a relative 1e-5 from 1e-9 up (FP32 terms, FP64 sums),
the NLL to 1e-6, the argmax's first index, NaN rows, the baseline against itself giving 0
exactly; and ``Totals`` taking it on CUDA."""

from __future__ import annotations

import pytest
import torch
from cases import DEVICES

from moewire.kernels.logit_metrics import logit_sums


def oracle(z: torch.Tensor, z0: torch.Tensor, t: torch.Tensor):
    """float64 ``sum p0 (log p0 - log p)``, ``-log p(t)`` and torch's argmaxes."""
    logp = z.double().log_softmax(-1)
    logp0 = z0.double().log_softmax(-1)
    kl = (logp0.exp() * (logp0 - logp)).sum(-1).clamp(min=0.0)
    return kl, -logp.gather(-1, t[:, None])[:, 0], z.argmax(-1) == z0.argmax(-1)


def window(vocab: int, dtype, gen: torch.Generator, scales=(0.0, 1e-4, 1e-3, 3e-2, 1.0, 4.0)):
    """Baseline logits of a realistic spread and, per row, a run that differs from it by
    noise of a given scale (0: the same logits, KL exactly 0)."""
    rows = len(scales)
    z0 = torch.randn(rows, vocab, generator=gen) * 2.5
    z0[:, :40] += 8.0  # a head of likely tokens, as a trained model's
    noise = torch.randn(rows, vocab, generator=gen)
    z = z0 + noise * torch.tensor(scales)[:, None]
    t = torch.randint(0, vocab, (rows,), generator=gen)
    return z.to(dtype), z0.to(dtype), t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [4099, 151936], ids=["tail", "qwen3-vocab"])
def test_the_sums_equal_float64_torch(device, dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    z, z0, t = window(vocab, dtype, gen)
    kl, nll, agree = oracle(z, z0, t)
    got = logit_sums(z.to(device), z0.to(device), t.to(device))
    assert got.kl.dtype == got.nll.dtype == torch.float64
    got_kl, got_nll = got.kl.cpu(), got.nll.cpu()
    assert got_kl[0] == 0.0 and kl[1:].min() > 1e-9  # the data spans 0 and 1e-9..1
    assert torch.allclose(got_kl, kl, rtol=1e-5, atol=0.0), (got_kl, kl)
    assert torch.allclose(got_nll, nll, rtol=1e-6, atol=0.0), (got_nll, nll)
    assert torch.equal(got.agree.cpu(), agree)


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_kls_keep_their_relative_precision(device):
    """KLs of 1e-9..1e-7 at a vocabulary of 151936, where a naive FP32 log-softmax's
    absolute error (about 7e-7) would exceed the KL itself."""
    gen = torch.Generator().manual_seed(1)
    z, z0, t = window(151936, torch.float32, gen, scales=(3e-5, 1e-4, 3e-4))
    kl, _, _ = oracle(z, z0, t)
    assert kl.max() < 1e-6
    got = logit_sums(z.to(device), z0.to(device), t.to(device)).kl.cpu()
    assert torch.allclose(got, kl, rtol=1e-5, atol=0.0), (got, kl)
    naive = (z0.log_softmax(-1).exp() * (z0.log_softmax(-1) - z.log_softmax(-1))).sum(-1)
    assert not torch.allclose(naive.double(), kl, rtol=1e-2, atol=0.0)  # the data shows it


@pytest.mark.parametrize("device", DEVICES)
def test_ties_shifts_nan_and_strided_rows(device):
    vocab = 3000
    gen = torch.Generator().manual_seed(2)
    z0 = torch.randn(5, vocab, generator=gen).bfloat16()
    z = z0.clone()
    z[0, [7, 2055]] = 40.0          # a tie (one block of 2048 apart: the same lane of the
    z0[0, [2055]] = 40.0            # kernel): the first index is the argmax; the baseline's
    #                                 maximum only at the later one
    z[1] = z0[1] + 96.0             # a constant shift: the same distribution (exact in BF16
    z0[1] = z0[1].float().round().bfloat16()  # where the values are integers)
    z[1] = z0[1] + 96.0
    z[2, 11] = float("nan")         # NaN: KL and NLL NaN, argmax the first NaN
    z[2, 40] = float("nan")
    t = torch.tensor([7, 3, 11, 0, 2999])
    wide = torch.zeros(5, vocab + 64, dtype=torch.bfloat16)
    wide[:, :vocab] = z
    got = logit_sums(wide[:, :vocab].to(device), z0.to(device), t.to(device))
    kl, nll, agree = oracle(z, z0, t)
    got_kl, got_nll = got.kl.cpu(), got.nll.cpu()
    assert got.agree.cpu().tolist() == [False, True, False, True, True] == agree.tolist()
    assert got_kl[1] == 0.0 and got_kl[3] == 0.0 and got_kl[4] == 0.0
    assert got_kl[2].isnan() and got_nll[2].isnan()
    keep = [0, 1, 3, 4]
    assert torch.allclose(got_kl[keep], kl[keep], rtol=1e-5, atol=1e-12)
    assert torch.allclose(got_nll[keep], nll[keep], rtol=1e-6, atol=0.0)


def test_shapes_are_refused_with_what_they_were():
    z = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"logits and ref must be \[T, V\].*\[4, 8\], \[4, 9\]"):
        logit_sums(z, torch.zeros(4, 9), torch.zeros(4, dtype=torch.long))


def test_totals_take_the_kernel_and_equal_the_float64_path(monkeypatch):
    """``Totals.add_logits`` through the fused kernel (here under the interpreter, as on CUDA)
    against its float64 torch path on the same windows: every sum, the per-token KLs, and the
    baseline's own row exactly 0."""
    from moewire.eval import metrics

    gen = torch.Generator().manual_seed(3)
    vocab, cuts = 3001, [(0, 5), (5, 9)]
    z, z0, t = window(vocab, torch.bfloat16, gen, scales=(0.0, 1e-2, 0.1, 1.0, 3.0) * 2)
    z, z0, t = z[:9], z0[:9], t[:9]
    results = []
    for use_kernel in (False, True):
        monkeypatch.setattr(metrics, "fused", lambda logits, on=use_kernel: on)
        totals = metrics.Totals(2, [], 9, torch.device("cpu"))
        for lo, hi in cuts:
            ref = metrics.Reference.of(z0[lo:hi])
            assert (ref.lse is None) == use_kernel
            totals.add_logits(0, z0[lo:hi], ref, t[lo:hi], lo)
            totals.add_logits(1, z[lo:hi], ref, t[lo:hi], lo)
        results.append(totals)
    slow, fast = results
    assert fast.buffer[0, 0] == 0.0 and torch.equal(fast.token_kl(0), torch.zeros(9,
                                                                          dtype=torch.float64))
    assert torch.allclose(fast.buffer, slow.buffer, rtol=1e-6, atol=0.0)
    assert fast.result(1)["top1_agreement"] == slow.result(1)["top1_agreement"] < 1.0
    assert fast.buffer[1, 3] == slow.buffer[1, 3] == 9  # the tokens
