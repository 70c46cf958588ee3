"""The streaming metrics of ``moewire eval``: per window, on the model's device.

Each window runs the baseline first, then every other run on the same tokens
(:mod:`moewire.eval.runner`); the baseline's logits and experts outputs live only until the
window ends. What stays is one float64 tensor, :attr:`Totals.buffer` ``[runs, F + N]``:

- ``F`` sums per run: the KL sum, the NLL sum, the top-1 agreements, the tokens, and per
  experts layer the squared error ``sum (y - y0)^2`` and the reference ``sum y0^2``;
- ``N`` per-token KLs, token ``t`` of the evaluation at column ``F + t`` (8 bytes per token
  and run), so the 99th percentile is exact, not a sketch.

Host and device memory hold one window of logits and experts outputs whatever the number
of tokens, plus these 8 bytes per token and run.

Expert parallelism (several ranks under ``torchrun``): transformers' ``MegaMoeEP`` needs
every rank of the EP group to hold the same batch, so every rank runs every window and gets
the same logits (the TP all-reduces and the all-gathers leave the same values on every
rank); each rank adds the same sums. Nothing is reduced: :meth:`Totals.differing_runs`
checks, after the windows, that the buffer is the same on every rank, bit for bit.

Where float64 is needed, and where not:

- the log-softmax and the KL sum are float64: a small KL is a sum of differences of
  nearly equal log-probabilities (at a vocabulary of 152k a log-probability is about -12,
  and FP32's relative 6e-8 of it, 7e-7, is above a KL of 1e-6); the NLL is read from the
  same float64 log-probabilities;
- the squared errors of the experts outputs are summed in float64 (a layer adds millions of
  terms per window);
- top-1 compares the argmax of the model's own logits (exact in any dtype);
- the logits are turned to float64 a chunk of rows at a time (:data:`CHUNK_ELEMENTS`), so a
  window's float64 copies never exceed a few hundred MB.

On CUDA (with moewire's kernels available, :func:`fused`) the logits' sums take one fused
kernel instead (:mod:`moewire.kernels.logit_metrics`): it reads both runs' logits in place
(two passes over each row, about 2.5 GB per window of 2048 tokens at a vocabulary of
151936, against some twenty float64 passes) and forms the KL from FP64 terms of the size
of the log-probability differences themselves (FP32 exponentials), summed in FP64, so it
keeps the float64 KL's relative precision (the tests hold it to 1e-5 per token from a KL
of 1e-9 up, the NLL to 1e-6). It is the same kernel eagerly and under CUDA graphs, so it
adds no difference between graphed and eager evaluations; ``MOEWIRE_DISABLE_KERNELS=1``
takes the float64 path on CUDA too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CHUNK_ELEMENTS", "Reference", "Totals", "fused", "quantile"]

#: Elements of the float64 log-probabilities computed at once (2^25: 256 MiB each).
CHUNK_ELEMENTS = 1 << 25
#: The per-run sums ahead of the per-layer ones, in this order.
_KL, _NLL, _AGREE, _TOKENS = range(4)
_SCALARS = 4


def quantile(values: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of a 1-D tensor, linearly interpolated between order statistics
    (numpy's and ``torch.quantile``'s default), without ``torch.quantile``'s size limit."""
    ordered = values.sort().values
    pos = q * (ordered.numel() - 1)
    low = int(pos)
    high = min(low + 1, ordered.numel() - 1)
    return float(ordered[low] + (pos - low) * (ordered[high] - ordered[low]))


def rows_per_chunk(vocab: int) -> int:
    """Rows of ``vocab`` logits turned to float64 at once (:data:`CHUNK_ELEMENTS`)."""
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def fused(logits: torch.Tensor) -> bool:
    """Whether the metrics of ``logits`` take the fused kernel
    (:mod:`moewire.kernels.logit_metrics`): on CUDA with the kernels available."""
    from moewire import kernels

    return logits.is_cuda and kernels.available()


@dataclass
class Reference:
    """The baseline of one window: its logits, their float64 log-normalisers and argmax.

    Attributes:
        logits: ``[T, V]`` in the model's dtype.
        lse: float64 ``[T]``, ``logsumexp`` of each row; ``None`` where the fused kernel
            reads the logits themselves (:func:`fused`).
        top1: int64 ``[T]``; ``None`` with ``lse``.
    """

    logits: torch.Tensor
    lse: torch.Tensor | None
    top1: torch.Tensor | None

    @classmethod
    def of(cls, logits: torch.Tensor) -> Reference:
        if fused(logits):
            return cls(logits, None, None)
        rows = rows_per_chunk(logits.shape[-1])
        lse = torch.cat([logits[i : i + rows].double().logsumexp(-1)
                         for i in range(0, logits.shape[0], rows)])
        return cls(logits, lse, logits.argmax(-1))


class Totals:
    """The running sums of every run over the windows (module docstring).

    Args:
        runs: the number of runs.
        layers: the experts layers' names, in order.
        tokens: the tokens of the whole evaluation (the per-token KL columns).
        device: where the sums live (the model's device).
    """

    def __init__(self, runs: int, layers: list[str], tokens: int,
                 device: torch.device) -> None:
        self.layers = list(layers)
        self.tokens = tokens
        self._fields = _SCALARS + 2 * len(self.layers)
        self.buffer = torch.zeros(runs, self._fields + tokens, dtype=torch.float64,
                                  device=device)

    def add_logits(self, run: int, logits: torch.Tensor, ref: Reference,
                   targets: torch.Tensor, offset: int) -> None:
        """Add one window of one run.

        Args:
            run: the run's row.
            logits: ``[T, V]``, the run's logits of the window.
            ref: the baseline's :class:`Reference` of the same window.
            targets: int64 ``[T]``, the next tokens.
            offset: the window's first token in the evaluation.
        """
        row = self.buffer[run]
        start = self._fields + offset
        if ref.lse is None:
            from moewire.kernels.logit_metrics import logit_sums

            sums = logit_sums(logits, ref.logits, targets)
            row[start : start + logits.shape[0]] = sums.kl
            row[_KL] += sums.kl.sum()
            row[_NLL] += sums.nll.sum()
            row[_AGREE] += sums.agree.sum()
            row[_TOKENS] += logits.shape[0]
            return
        assert ref.top1 is not None
        rows = rows_per_chunk(logits.shape[-1])
        for i in range(0, logits.shape[0], rows):
            part = slice(i, i + rows)
            # Both as z - logsumexp(z), chunked as Reference.of: the baseline against itself
            # gives KL 0 bit for bit.
            z = logits[part].double()
            logp = z - z.logsumexp(-1, keepdim=True)
            logp0 = ref.logits[part].double() - ref.lse[part, None]
            # KL >= 0; rounding of nearly equal distributions may leave -1e-17.
            kl = (logp0.exp() * (logp0 - logp)).sum(-1).clamp(min=0.0)
            row[start + i : start + i + kl.shape[0]] = kl
            row[_KL] += kl.sum()
            row[_NLL] -= logp.gather(-1, targets[part, None]).sum()
        row[_AGREE] += (logits.argmax(-1) == ref.top1).sum()
        row[_TOKENS] += logits.shape[0]

    def add_reference_layer(self, layer: int, y0: torch.Tensor) -> None:
        """Add the baseline's ``sum y0^2`` of one experts layer to every run's row."""
        self.buffer[:, _SCALARS + 2 * layer + 1] += y0.double().square().sum()

    def add_layer(self, run: int, layer: int, y: torch.Tensor, y0: torch.Tensor) -> None:
        """Add one experts layer's squared error ``sum (y - y0)^2`` (``y0``: the baseline's
        output of the same window, same shape)."""
        self.buffer[run, _SCALARS + 2 * layer] += (y.double() - y0.double()).square().sum()

    def differing_runs(self, group=None) -> list[int]:
        """The runs whose sums are not the same, bit for bit, on every rank of ``group``
        (empty when they agree). A sum that is NaN on every rank agrees; NaN on some ranks
        and a number on others differs. Every rank calls it: a MAX and a MIN all-reduce of a
        copy of the buffer, and a SUM of its NaN mask.
        """
        import torch.distributed as dist

        # gloo's MAX and MIN keep the number beside a NaN (std::max and std::min compare
        # false with NaN), so the NaNs are counted apart and the numbers compared without them.
        nan = self.buffer.isnan()
        values = torch.where(nan, 0.0, self.buffer)
        high, low, count = values.clone(), values, nan.double()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
        world = dist.get_world_size(group)
        same = torch.where(count == 0, high == low, count == world)
        return [run for run, ok in enumerate(same.all(dim=1).tolist()) if not ok]

    def token_kl(self, run: int) -> torch.Tensor:
        """The run's KL of every token of the evaluation, float64 ``[N]`` (a view)."""
        return self.buffer[run, self._fields :]

    def result(self, run: int) -> dict[str, float | dict[str, float]]:
        """The run's metrics: ``perplexity``, ``kl_mean``, ``kl_p99``, ``top1_agreement``
        and ``layer_rel_l2`` (``||y - y0|| / ||y0||`` per experts layer)."""
        row = self.buffer[run].cpu()
        count = float(row[_TOKENS])
        layers = row[_SCALARS : self._fields].view(-1, 2).tolist()
        return {
            "perplexity": float(torch.exp(row[_NLL] / count)),
            "kl_mean": float(row[_KL] / count),
            "kl_p99": quantile(self.token_kl(run).cpu(), 0.99),
            "top1_agreement": float(row[_AGREE] / count),
            "layer_rel_l2": {name: (err / ref) ** 0.5 if ref > 0 else 0.0
                             for name, (err, ref) in zip(self.layers, layers, strict=True)},
        }
