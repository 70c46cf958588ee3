"""Eval's forwards give the attention the same inputs eagerly and under CUDA stream capture
(``moewire.eval.masking``): transformers 5.23 builds a materialised causal mask under
capture unless the packed-sequence probe is told the window is one sequence.

Capture is simulated on CPU by making transformers' ``is_cuda_stream_capturing`` answer
yes (what ``is_tracing`` reads, ``utils/import_utils.py`` in 5.23.0); a spy on
``F.scaled_dot_product_attention`` records what each attention call got."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.integrations.moe")

import torch  # noqa: E402
from eval_helpers import TEXT  # noqa: E402

from moewire.eval import evaluate  # noqa: E402
from moewire.eval.masking import unpacked_windows  # noqa: E402


@pytest.fixture
def sdpa_calls(monkeypatch) -> list[tuple[bool, bool]]:
    """``(attn_mask is None, is_causal)`` of every SDPA call."""
    calls: list[tuple[bool, bool]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask is None, bool(is_causal)))
        return real(*args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def _capturing(monkeypatch) -> None:
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", lambda: True)


def _model(sliding_window: int | None = None):
    """A tiny random Qwen3-MoE on SDPA, every layer on a sliding window if one is given."""
    import _tiny
    import transformers as tf

    config = _tiny.config("qwen3_moe")
    config.sliding_window = sliding_window
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return tf.AutoModelForCausalLM.from_config(config).eval()


def _forward(model, tokens: int) -> torch.Tensor:
    ids = torch.arange(tokens)[None] % 200
    with torch.no_grad():
        return model(ids, use_cache=False).logits[0]


def test_under_capture_transformers_masks_what_the_eager_forward_does_not(sdpa_calls,
                                                                          monkeypatch):
    """The premise, on transformers 5.23's own code: without the fix the two forwards call
    SDPA differently (if transformers stops doing so, this fails and the fix can go)."""
    model = _model()
    _forward(model, 32)
    eager = list(sdpa_calls)
    sdpa_calls.clear()
    _capturing(monkeypatch)
    _forward(model, 32)
    assert eager == [(True, True)] * 2
    assert sdpa_calls == [(False, False)] * 2


@pytest.mark.parametrize("window", [None, 16], ids=["full-attention", "sliding-window"])
def test_inside_unpacked_windows_capture_calls_sdpa_as_the_eager_forward(
        sdpa_calls, monkeypatch, window):
    """Break: drop the patch (or patch another name than the one ``_preprocess_mask_arguments``
    calls): the captured calls get a mask. A sliding window (16) shorter than the window of
    tokens (32) keeps its mask, in both modes alike."""
    model = _model(window)
    tokens = 32
    with unpacked_windows():
        eager_logits = _forward(model, tokens)
    eager = list(sdpa_calls)
    sdpa_calls.clear()
    _capturing(monkeypatch)
    with unpacked_windows():
        captured_logits = _forward(model, tokens)
    assert sdpa_calls == eager
    assert eager == ([(True, True)] if window is None else [(False, False)]) * 2
    assert torch.equal(captured_logits, eager_logits)


def test_eval_forwards_run_inside_unpacked_windows(checkpoint, sdpa_calls, monkeypatch):
    """Break: call the model in ``Session.forward`` without :func:`unpacked_windows`: under
    (simulated) capture the calls get a materialised mask."""
    _capturing(monkeypatch)
    evaluate(checkpoint("qwen3_moe"), [("fp8", "nvfp4")], text=TEXT, max_tokens=64,
             seq_len=32, device="cpu", log=lambda s: None)
    assert sdpa_calls and set(sdpa_calls) == {(True, True)}


def test_the_probe_comes_back_after_the_block_error_or_not():
    from transformers import masking_utils

    probe = masking_utils.find_packed_sequence_indices
    with unpacked_windows():
        assert masking_utils.find_packed_sequence_indices(torch.tensor([[0, 1, 0, 1]])) is None
    assert masking_utils.find_packed_sequence_indices is probe
    with pytest.raises(ValueError), unpacked_windows():
        raise ValueError("inside")
    assert masking_utils.find_packed_sequence_indices is probe
    assert probe(torch.tensor([[0, 1, 0, 1]])) is not None
