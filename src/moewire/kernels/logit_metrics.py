"""One fused pass over a window's logits for ``moewire eval``'s metrics: per token, the KL
of a run's next-token distribution from the baseline's, the run's NLL of the target and
whether both argmaxes agree, reading the BF16 logits in place.

Math, per row (``z``: the run's logits, ``z0``: the baseline's, ``t``: the target; the
exponentials in FP32, ``u`` and every product and sum in FP64)::

    m = max z,  m0 = max z0
    u_i = (z0_i - z_i) - (m0 - m)                      # log p0_i - log p_i + log(S0 / S)
    S  = sum exp(z_i - m),  S0 = sum exp(z0_i - m0)
    A  = sum exp(z0_i - m0) * u_i
    B  = sum exp(z0_i - m0) * expm1(-u_i)              # = S - S0, without the cancellation
    KL  = max(A / S0 + log1p(B / S0), 0)               # = sum p0_i (log p0_i - log p_i)
    NLL = m + log(S) - z_t
    agree = argmax z == argmax z0                      # first index of the maximum

``KL = A / S0 + log(S / S0)``, and ``S / S0 = 1 + B / S0`` because
``exp(z0_i - m0) * exp(-u_i) = exp(z_i - m)``. Why this form keeps the float64 KL's
precision while reading BF16 logits once per pass:

- nothing is of the size of a log-probability (about -12 at a vocabulary of 152k, where
  FP32's relative 6e-8 is an absolute 7e-7, above a typical KL): ``z0_i - z_i`` is exact in
  FP32 where the runs are close (Sterbenz), so ``u`` is rounded once, relative to itself;
- ``A / S0`` and ``log1p(B / S0)`` are both about ``E[u]`` and cancel to ``Var(u) / 2``; in
  FP64 that cancellation costs nothing;
- ``expm1(-u)`` is a Taylor polynomial where ``|u| < 0.5`` and
  ``exp(z_i - m) - exp(z0_i - m0)`` elsewhere (two values at most 1, no overflow);
- the FP32 exponentials are the weights of both ``A`` and ``B`` alike: their rounding
  perturbs ``p0`` a little, not the cancellation, so the KL moves by a relative 1e-7-ish.

The baseline against itself gives ``u = 0`` and ``KL = 0`` exactly.

Special values: a row holding NaN gives NaN KL and NLL; its argmax is its first NaN
(``torch.argmax``'s rule).

This is :class:`moewire.eval.metrics.Totals`' fast path on CUDA; the float64 torch path
there is the definition, and the tests compare the two (relative error of the KL below
1e-5 per token where it is above 1e-9, of the NLL below 1e-6).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moewire.kernels.launch import _check_device, _impl

__all__ = ["LogitSums", "logit_sums"]

#: Columns of a row one program reads at a time.
_BLOCK = 2048


class LogitSums(NamedTuple):
    """The per-row results of :func:`logit_sums` (float64 ``[T]`` unless said).

    Attributes:
        kl: ``KL(p0 || p)`` per row, >= 0.
        nll: ``-log p(t)`` per row.
        agree: bool ``[T]``, the argmaxes agree.
    """

    kl: torch.Tensor
    nll: torch.Tensor
    agree: torch.Tensor


def logit_sums(logits: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> LogitSums:
    """The metrics of one window in one kernel launch (module docstring).

    Args:
        logits: ``[T, V]`` BF16/FP16/FP32, the run's logits (rows may be strided, columns
            contiguous).
        ref: ``[T, V]``, the baseline's logits of the same tokens, same dtype.
        targets: int64 ``[T]``, the next tokens (each in ``[0, V)``).

    Returns:
        A :class:`LogitSums`.
    """
    _check_device(logits, "logits")
    if logits.dim() != 2 or ref.shape != logits.shape or targets.shape != logits.shape[:1]:
        raise ValueError(
            "moewire.kernels.logit_sums: logits and ref must be [T, V] of one shape and "
            f"targets [T]; got {list(logits.shape)}, {list(ref.shape)} and "
            f"{list(targets.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if ref.stride(-1) != 1:
        ref = ref.contiguous()
    _impl()  # Triton importable, or the error that says how to install it
    from moewire.kernels import _triton_logits

    rows, vocab = logits.shape
    dev = logits.device
    f32 = torch.empty((rows, 2), dtype=torch.float32, device=dev)
    f64 = torch.empty((rows, 4), dtype=torch.float64, device=dev)
    i32 = torch.empty((rows, 2), dtype=torch.int32, device=dev)
    if rows:
        _triton_logits.logit_sums_kernel[(rows,)](
            logits, ref, targets.contiguous(), f32, f64, i32, vocab, logits.stride(0),
            ref.stride(0), BLOCK=_BLOCK, num_warps=8)
    m, zt = f32.double().unbind(1)
    s, s0, a, b = f64.unbind(1)
    kl = (a / s0 + torch.log1p(b / s0)).clamp(min=0.0)
    nll = m + s.log() - zt
    return LogitSums(kl, nll, i32[:, 0] == i32[:, 1])
