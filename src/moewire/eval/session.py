"""The model with its experts modules converted once, every run's quantizers swapped in
window by window (:class:`Session`), and the runs themselves (:class:`Run`).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moewire.eval.masking import unpacked_windows
from moewire.eval.metrics import Reference, Totals
from moewire.eval.plan import Windows
from moewire.eval.recipe import WireCost, pair_entries
from moewire.eval.settings import BASELINE, ProgressFn

if TYPE_CHECKING:
    from moewire.eval.graphs import WindowGraphs

__all__ = ["Run", "Session", "frames_released"]


@dataclass
class Run:
    """One run: its recipe (``None``: the baseline), its cost, its calibrated quantizers
    (one ``(dispatch, combine)`` per experts module) and its time in the lockstep loop."""

    name: str
    recipe: Any
    cost: WireCost
    quantizers: list[tuple[nn.Module, nn.Module]] = field(default_factory=list)
    seconds: float = 0.0



class Session:
    """The model with its experts modules converted once, swapping each run's quantizers in.

    Forward hooks on the experts modules compare each run's outputs with the baseline's of
    the same window (kept only for that window). :meth:`close` unquantizes the model and
    lets go of it.

    With ``cuda_graph`` (on a CUDA device, one rank), :meth:`measure` captures each run's
    forward over a window once (:class:`moewire.eval.graphs.WindowGraphs`, after the runs'
    calibration, whose eager forwards ran the layout check) and replays it for every window
    of that shape; a shorter last window runs eagerly. The replay runs the eager forward's
    kernels on the same data and adds to the same sums: moewire's kernels are the same, and
    the model's attention gets the same inputs (:func:`moewire.eval.masking.unpacked_windows`).
    Each run's first replay is checked against its eager forward, and the GPU tests compare
    every run's metrics with the eager run's, bit for bit. Under
    several ranks every window runs eagerly (the collectives of expert parallelism are not
    captured).
    """

    def __init__(self, model: nn.Module, modules: list[tuple[str, nn.Module]],
                 first: torch.Tensor, device: torch.device, cuda_graph: bool = False) -> None:
        import torch.distributed as dist

        import moewire

        self.model, self.modules, self.device = model, modules, device
        self._first = first
        self._run: int | None = None
        self._totals: Totals | None = None
        self._reference: dict[int, torch.Tensor] = {}
        self.cuda_graph = (cuda_graph and device.type == "cuda"
                           and not (dist.is_initialized() and dist.get_world_size() > 1))
        #: Seconds spent warming up and capturing the graphs, and the most their memory
        #: pool held beyond the allocator's reserve before a capture.
        self.capture_seconds = 0.0
        self.graph_reserved_bytes = 0
        #: Why the graphs were dropped after their capture (``None``: they were not).
        self.graph_fallback: str | None = None
        # Converts every experts module; each run then brings its own quantizers.
        moewire.quantize(model, {"quant_cfg": pair_entries(*BASELINE)})
        self._handles = [m.register_forward_hook(self._hook(i))
                         for i, (_, m) in enumerate(modules)]

    def _hook(self, layer: int) -> Callable:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if self._run is None or self._totals is None:
                return
            if self._run == 0:
                # The block may add to the experts' output in place afterwards: a copy.
                self._reference[layer] = output.detach().clone()
                self._totals.add_reference_layer(layer, output)
            else:
                self._totals.add_layer(self._run, layer, output, self._reference[layer])
        return hook

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        # One window is one sequence: the same attention inputs eagerly and under capture.
        with torch.no_grad(), unpacked_windows():
            return self.model(inputs[None], use_cache=False).logits[0]

    def _run_forward(self, runs: list[Run], i: int, inputs: torch.Tensor,
                     hooks: bool = True) -> torch.Tensor:
        """Run ``runs[i]``'s forward on ``inputs``, its quantizers installed and the hooks
        adding its sums (unless ``hooks`` is off)."""
        self.install(runs[i])
        self._run = i if hooks else None
        try:
            return self.forward(inputs)
        finally:
            self._run = None

    def calibrate(self, run: Run) -> None:
        """Make ``run``'s quantizers, calibrated on the first window, and keep them."""
        import moewire
        from moewire.quantizer import WireQuantizer

        if run.recipe is None:
            run.quantizers = [
                tuple(WireQuantizer(enable=False, name=f"{name}.{kind}_quantizer")
                      .to(self.device) for kind in ("dispatch", "combine"))
                for name, _ in self.modules]
            return
        moewire.quantize(self.model, run.recipe, lambda m: self.forward(self._first),
                         keep_scales=False)
        run.quantizers = [(m.dispatch_quantizer, m.combine_quantizer) for _, m in self.modules]

    def install(self, run: Run) -> None:
        for (_, module), (dispatch, combine) in zip(self.modules, run.quantizers, strict=True):
            module.dispatch_quantizer = dispatch
            module.combine_quantizer = combine

    def measure(self, runs: list[Run], windows: Windows,
                progress: ProgressFn, stage: str) -> Totals:
        """Every run over every window in lockstep, the baseline (``runs[0]``) first.

        Under CUDA graphs, a run whose first replay does not give its eager forward's logits
        bit for bit (:meth:`moewire.eval.graphs.WindowGraphs.agrees`) drops the graphs: the
        sums start again and every window runs eagerly, and :attr:`graph_fallback` says which
        run differed (the report's ``cuda_graph.fallback``).
        """
        seconds = [run.seconds for run in runs]
        try:
            return self._measure(runs, windows, progress, stage)
        except _GraphsDisagree as exc:
            reason = str(exc)
        # Outside the handler: its traceback (the replay's logits, the graphs' pool) is gone.
        self.cuda_graph, self.graph_fallback = False, reason
        for run, before in zip(runs, seconds, strict=True):
            run.seconds = before
        return self._measure(runs, windows, progress, stage)

    def _measure(self, runs: list[Run], windows: Windows,
                 progress: ProgressFn, stage: str) -> Totals:
        totals = Totals(len(runs), [n for n, _ in self.modules], windows.tokens, self.device)
        self._totals = totals
        graphs = None
        progress(stage, 0, len(windows.inputs))
        try:
            if self.cuda_graph:
                graphs = self._capture(runs, windows.inputs[0])
            for w, (inputs, targets, offset) in enumerate(
                    zip(windows.inputs, windows.targets, windows.offsets, strict=True)):
                ref = None
                for i, run in enumerate(runs):
                    started = time.perf_counter()
                    if graphs is not None and graphs.fits(inputs):
                        logits = graphs.replay(i, inputs)
                        if w == 0 and not graphs.agrees(i, logits):
                            raise _GraphsDisagree(
                                f"the replayed forward of run {run.name} differs from its "
                                "eager forward on the first window; every window ran eagerly")
                    else:
                        logits = self._run_forward(runs, i, inputs)
                    ref = ref if ref is not None else Reference.of(logits)
                    totals.add_logits(i, logits, ref, targets, offset)
                    del logits
                    _synchronize(self.device)
                    run.seconds += time.perf_counter() - started
                if graphs is None:
                    self._reference.clear()
                progress(stage, w + 1, len(windows.inputs))
        finally:
            self._run, self._totals = None, None
            self._reference.clear()
            del graphs
        _check_ranks_agree(totals, [r.name for r in runs])
        return totals

    def _capture(self, runs: list[Run], example: torch.Tensor) -> WindowGraphs:
        """The runs' graphs over windows of ``example``'s shape (their hooks record the
        baseline's experts outputs, which the graphs then hold)."""
        from moewire.eval.graphs import WindowGraphs

        started = time.perf_counter()
        graphs = WindowGraphs(lambda i, inputs, hooks: self._run_forward(runs, i, inputs, hooks),
                              [r.name for r in runs], example)
        graphs.hold(self._reference.values())
        self.capture_seconds += time.perf_counter() - started
        self.graph_reserved_bytes = max(self.graph_reserved_bytes, graphs.reserved_bytes)
        return graphs

    def close(self) -> None:
        """Remove the hooks, unquantize the model and drop every reference to it and to the
        runs' quantizers, so the memory goes back as soon as the caller's references go."""
        import moewire

        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        moewire.unquantize(self.model)
        self._reference.clear()
        self.modules = []
        self._first = torch.empty(0)
        del self.model


class _GraphsDisagree(Exception):
    """A run's first replay differs from its eager forward (:meth:`Session.measure`)."""


@contextmanager
def frames_released() -> Iterator[None]:
    """Clear the locals of the finished frames of an exception leaving the block (and of
    the exceptions it chains), then let it propagate.

    A traceback holds every frame it passes through, and their locals hold the model (the
    forward's ``self``, the runner's ``model``): as long as the caller keeps the exception,
    the model's memory would stay allocated. The traceback still names every file and line;
    only the locals (a debugger's post-mortem view) go.
    """
    try:
        yield
    except BaseException as exc:
        seen: set[int] = set()
        chained: BaseException | None = exc
        while chained is not None and id(chained) not in seen:
            seen.add(id(chained))
            traceback.clear_frames(chained.__traceback__)
            chained = chained.__cause__ or chained.__context__
        raise


def _check_ranks_agree(totals: Totals, names: list[str]) -> None:
    """Under several ranks, fail unless every rank holds the same sums (``moewire.eval.runner``)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    differ = totals.differing_runs()
    if differ:
        raise RuntimeError(
            f"eval: the metrics of {[names[i] for i in differ]} differ between the "
            f"{dist.get_world_size()} ranks, which must run the same windows through the same "
            "model; launch every rank with the same arguments and files (torchrun "
            "--nproc-per-node N -m moewire eval ...)")



def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
