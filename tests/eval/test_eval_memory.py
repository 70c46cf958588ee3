"""Memory given back: once ``evaluate`` returns, or raises from inside a run, nothing holds
the model, with the garbage collector off (no cycle to wait for). On CPU the model and its
parameters are tracked by weak references; on the GPU tier ``torch.cuda.memory_allocated``
is back where it was."""

from __future__ import annotations

import gc
import weakref

import pytest

pytest.importorskip("transformers.integrations.moe")

import torch  # noqa: E402
from eval_helpers import TEXT  # noqa: E402

from moewire.eval import evaluate, metrics, runner  # noqa: E402


@pytest.fixture
def tracked(monkeypatch):
    """Weak references to the model ``evaluate`` loads, its parameters and buffers."""
    refs: list[weakref.ref] = []
    load = runner._load

    def tracking_load(*args, **kwargs):
        model = load(*args, **kwargs)
        refs.append(weakref.ref(model))
        refs.extend(weakref.ref(t) for t in (*model.parameters(), *model.buffers()))
        return model

    monkeypatch.setattr(runner, "_load", tracking_load)
    return refs


@pytest.fixture
def gc_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _failing_add_logits(monkeypatch):
    """``Totals.add_logits`` raising on the second run of the first window: an error inside
    a run, with the model's forward frames below the runner's."""
    real = metrics.Totals.add_logits

    def add_logits(self, run, *args, **kwargs):
        if run == 1:
            raise RuntimeError("boom inside a run")
        return real(self, run, *args, **kwargs)

    monkeypatch.setattr(metrics.Totals, "add_logits", add_logits)


def test_nothing_holds_the_model_after_evaluate_returns(checkpoint, tracked, gc_off):
    report = evaluate(checkpoint("qwen3_moe"), [("fp8", "nvfp4")], text=TEXT, max_tokens=64,
                      seq_len=32, device="cpu", log=lambda s: None)
    assert report["pairs"][1]["kl_mean"] > 0.0
    assert len(tracked) > 10
    assert [r for r in tracked if r() is not None] == []


def test_nothing_holds_the_model_after_an_error_inside_a_run(checkpoint, tracked, gc_off,
                                                              monkeypatch):
    _failing_add_logits(monkeypatch)
    with pytest.raises(RuntimeError, match="boom inside a run") as info:
        evaluate(checkpoint("qwen3_moe"), [("fp8", "nvfp4")], text=TEXT, max_tokens=64,
                 seq_len=32, device="cpu", log=lambda s: None)
    # The caller still holds the exception and its traceback, which names every line.
    assert any(entry.name == "add_logits" for entry in info.traceback)
    assert len(tracked) > 10
    assert [r for r in tracked if r() is not None] == []


def _allocated_after(call) -> tuple[int, int]:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return before, torch.cuda.memory_allocated()


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graphed"])
def test_device_memory_is_back_after_return_and_after_an_error(checkpoint, gc_off,
                                                               monkeypatch, cuda_graph):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path = checkpoint("qwen3_moe")

    def run():
        evaluate(path, [("fp8", "nvfp4")], text=TEXT, max_tokens=64, seq_len=32,
                 device="cuda", cuda_graph=cuda_graph, log=lambda s: None)

    run()  # once first: the process's lasting state (CUDA context, cuBLAS workspaces)
    before, after = _allocated_after(run)
    assert after == before, f"{after - before} bytes still allocated after evaluate returned"
    _failing_add_logits(monkeypatch)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with pytest.raises(RuntimeError, match="boom inside a run") as info:
        run()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    assert info.traceback  # the caller keeps the exception
    assert after == before, f"{after - before} bytes still allocated after the error"
