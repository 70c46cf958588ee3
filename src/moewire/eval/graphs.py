"""CUDA graphs of ``moewire eval``'s window forwards: each run's forward over a window of one
shape is captured once and replayed for every window of that shape.

What one graph holds (run ``i`` of ``n``, a window of ``T`` tokens, vocabulary ``V``):

- the model's forward on the static input ids (int64 ``[T]``, :attr:`WindowGraphs.inputs`,
  which each window's ids are copied into before the baseline's replay), with run ``i``'s
  quantizers installed while it was captured: a run's quantizers are modules of their own
  (their amax tensors, their format's kernels), so every run has its own graph and the swap
  between runs is the choice of the graph to replay, never a recapture;
- the session's forward hooks, which ran while the graph was captured: the baseline's copy of
  each experts layer's output and the per-layer sums, added in place into
  :attr:`moewire.eval.metrics.Totals.buffer` (one tensor for the whole evaluation, so the
  replay adds to the same sums the eager forward would);
- the logits: the baseline's ``[T, V]`` stay where its graph wrote them (the reference of
  the window, read by every later run); the other runs' go to one shared ``[T, V]`` tensor
  (the first of them writes it, every later one copies its logits into it).

The metrics of the logits (:meth:`~moewire.eval.metrics.Totals.add_logits`) run eagerly on
those tensors after each replay: their per-token KL goes to the window's own columns.

All graphs allocate from one memory pool, captured and always replayed in the runs' order
(torch's rule for graphs sharing a pool, ``torch/cuda/graphs.py``, torch 2.11): what one
run's forward frees is what the next one's uses. What the graphs keep beyond one eager
forward is the pool's reserve (one forward's activations, the baseline's experts outputs,
two windows of logits), which :attr:`WindowGraphs.reserved_bytes` gives: device memory
the eager forward would have shared with the metrics' float64 chunks.

Each run's forward runs once eagerly, its hooks off, on the capture stream before the
graphs are captured (the warm-up torch asks for: libraries' lazy set-up, the stream's cuBLAS
workspace). Its logits' :func:`fingerprint` is kept, and the first replay of each run (the
same window) must give the same one (:meth:`WindowGraphs.agrees`): a capture that changed
the numbers is caught on the first window, and the session then runs every window eagerly
(:meth:`moewire.eval.session.Session.measure`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

__all__ = ["WindowGraphs"]

#: One capture stream per device, reused, so the cuBLAS workspace torch keeps per stream is
#: made once per process, not once per evaluation.
_STREAMS: dict[int, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index)
    return _STREAMS[index]


#: Rows of logits turned into float64 at a time by :func:`fingerprint`.
_ROWS = 128


def fingerprint(logits: torch.Tensor) -> torch.Tensor:
    """Exact checksums of the bits of ``logits`` (``[T, V]``, 16- or 32-bit), float64 ``[T, 2]``.

    Row ``t``'s checksums are ``sum_j b[t, j] * w[j, c]`` for ``c`` in 0, 1, where ``b`` is the
    row's bits read as int16 (``[T, V]`` for BF16, ``[T, 2V]`` for FP32) and ``w`` two fixed
    columns of integers in ``[1, 1024]`` (seed 0). Every product and partial sum is an integer
    below ``2^15 * 2^10 * 2^19 = 2^44 < 2^53`` (rows of up to ``2^19`` int16), so the float64
    sums are exact in any order: two rows that differ in one element (one ulp, a sign, a NaN's
    payload) always differ in both checksums; several differences cancel in both only when
    they cancel under two independent random weightings.
    """
    if logits.dim() != 2 or logits.element_size() not in (2, 4):
        raise ValueError(f"fingerprint: logits must be [T, V] of a 16- or 32-bit dtype, got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    bits = logits.contiguous().view(torch.int16)
    if bits.shape[1] > 2**19:
        raise ValueError(f"fingerprint: rows of {bits.shape[1]} int16 exceed 2^19, where the "
                         "float64 checksums stop being exact")
    weights = torch.randint(1, 1025, (bits.shape[1], 2), dtype=torch.float64,
                            generator=torch.Generator().manual_seed(0)).to(logits.device)
    return torch.cat([bits[r:r + _ROWS].to(torch.float64) @ weights
                      for r in range(0, bits.shape[0], _ROWS)])


def _pool_bytes(pool: tuple[int, int] | None) -> int:
    """Bytes of the segments the allocator holds for memory pool ``pool``."""
    return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
               if tuple(segment.get("segment_pool_id", ())) == tuple(pool or ()))


class WindowGraphs:
    """Every run's forward over a window of ``example``'s shape, each captured in a graph.

    Args:
        forward: ``forward(run, inputs)`` installs run ``run``'s quantizers and returns the
            model's logits ``[T, V]`` on ``inputs`` (int64 ``[T]``), the session's hooks on
            (they are recorded in the graph) or off (``hooks=False``, the warm-up).
        names: the runs' names, the baseline first (the refusal names the run).
        example: int64 ``[T]`` on the CUDA device, the first window of the shape.

    Raises:
        RuntimeError: a run's forward cannot be captured; the message names the run and says
            to run eagerly (``cuda_graph=False``, ``--no-cuda-graph``).
    """

    def __init__(self, forward: Callable[..., torch.Tensor], names: Sequence[str],
                 example: torch.Tensor) -> None:
        device = example.device
        stream = _capture_stream(device)
        self.inputs = example.clone()
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._eager = [fingerprint(forward(run, self.inputs, hooks=False))
                           for run in range(len(names))]
        torch.cuda.current_stream(device).wait_stream(stream)
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._logits: list[torch.Tensor] = []
        pool = None
        for run, name in enumerate(names):
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = forward(run, self.inputs, hooks=True)
                    if run >= 2:
                        self._logits[1].copy_(logits)
                        logits = self._logits[1]
            except RuntimeError as exc:
                raise RuntimeError(
                    f"eval: the forward of run {name} cannot be captured in a CUDA graph "
                    f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                    "pass cuda_graph=False (moewire eval --no-cuda-graph) to run every "
                    "window eagerly") from exc
            pool = graph.pool()
            self._graphs.append(graph)
            self._logits.append(logits)
        #: The device memory the graphs' pool holds (its segments, ``torch.cuda.memory_snapshot``):
        #: what the graphs cost beyond one eager forward's transient memory.
        self.reserved_bytes = _pool_bytes(pool)
        self._held: list[torch.Tensor] = []

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Keep ``tensors`` (written by one graph, read by later ones: the baseline's experts
        outputs the hooks copied) alive as long as the graphs, whoever else drops them."""
        self._held.extend(tensors)

    def agrees(self, run: int, logits: torch.Tensor) -> bool:
        """Whether ``logits``, run ``run``'s first replay (on the captured example window),
        have the :func:`fingerprint` of its eager warm-up forward on the same window."""
        return torch.equal(fingerprint(logits), self._eager[run])

    def fits(self, inputs: torch.Tensor) -> bool:
        """Whether ``inputs`` has the captured window's shape (a shorter last window runs
        eagerly)."""
        return inputs.shape == self.inputs.shape

    def replay(self, run: int, inputs: torch.Tensor) -> torch.Tensor:
        """Run ``run``'s graph on ``inputs`` (the runs of a window in their order, the
        baseline first) and return its logits ``[T, V]``, valid until the next replay of a
        run other than the baseline."""
        if run == 0:
            self.inputs.copy_(inputs)
        self._graphs[run].replay()
        return self._logits[run]
