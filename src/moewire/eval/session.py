"""The model with its experts modules converted once, every run's quantizers swapped in
window by window (:class:`Session`), and the runs themselves (:class:`Run`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moewire.eval.metrics import Reference, Totals
from moewire.eval.plan import Windows
from moewire.eval.recipe import WireCost, pair_entries
from moewire.eval.settings import BASELINE, ProgressFn

__all__ = ["Run", "Session"]


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
    the same window (kept only for that window). :meth:`close` unquantizes the model.
    """

    def __init__(self, model: nn.Module, modules: list[tuple[str, nn.Module]],
                 first: torch.Tensor, device: torch.device) -> None:
        import moewire

        self.model, self.modules, self.device = model, modules, device
        self._first = first
        self._run: int | None = None
        self._totals: Totals | None = None
        self._reference: dict[int, torch.Tensor] = {}
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
        with torch.no_grad():
            return self.model(inputs[None], use_cache=False).logits[0]

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
        """Every run over every window in lockstep, the baseline (``runs[0]``) first."""
        totals = Totals(len(runs), [n for n, _ in self.modules], windows.tokens, self.device)
        self._totals = totals
        progress(stage, 0, len(windows.inputs))
        try:
            for w, (inputs, targets, offset) in enumerate(
                    zip(windows.inputs, windows.targets, windows.offsets, strict=True)):
                ref = None
                for i, run in enumerate(runs):
                    started = time.perf_counter()
                    self.install(run)
                    self._run = i
                    logits = self.forward(inputs)
                    self._run = None
                    ref = ref if ref is not None else Reference.of(logits)
                    totals.add_logits(i, logits, ref, targets, offset)
                    del logits
                    _synchronize(self.device)
                    run.seconds += time.perf_counter() - started
                self._reference.clear()
                progress(stage, w + 1, len(windows.inputs))
        finally:
            self._run, self._totals = None, None
            self._reference.clear()
        _check_ranks_agree(totals, [r.name for r in runs])
        return totals

    def close(self) -> None:
        import moewire

        for handle in self._handles:
            handle.remove()
        moewire.unquantize(self.model)


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
