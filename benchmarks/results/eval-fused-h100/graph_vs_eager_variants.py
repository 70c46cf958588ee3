"""Which setting makes a graphed ``moewire eval`` equal the eager one: each variant runs one
eager and one graphed evaluation of the tiny Qwen3-MoE of the tests (pairs fp8:fp8,
nvfp4:nvfp4, bf16:fp8, fp8:nvfp4; 4 windows of 32 tokens) with that setting in both, and
prints the runs whose metrics differ (0 is the baseline).

Variants: ``eager-on-capture-stream`` (the eager forwards on the capture stream),
``head-eager`` (the LM head outside the graph, after each replay), ``no-reduced-precision``
(``allow_bf16_reduced_precision_reduction = False``), and SDPA's backends:
``no-cudnn-sdp``, ``flash-only``, ``efficient-only``, ``math-sdp``.

    PYTHONPATH=src python3 benchmarks/results/eval-fused-h100/graph_vs_eager_variants.py VARIANT
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests" / "hf_transformers"), str(ROOT / "tests" / "eval")]

import _tiny  # noqa: E402
from eval_helpers import TEXT  # noqa: E402

from moewire.eval import evaluate, graphs, metrics  # noqa: E402
from moewire.eval import session as eval_session  # noqa: E402

PAIRS = [("fp8", "fp8"), ("nvfp4", "nvfp4"), ("bf16", "fp8"), ("fp8", "nvfp4")]
KEYS = ("perplexity", "kl_mean", "kl_p99", "top1_agreement", "layer_rel_l2")
#: SDPA backends left on per variant (cuDNN, flash, memory-efficient); math is always on.
SDPA = {"no-cudnn-sdp": (False, True, True), "flash-only": (False, True, False),
        "efficient-only": (False, False, True), "math-sdp": (False, False, False)}


def _eager_on_capture_stream() -> None:
    run_forward = eval_session.Session._run_forward

    def on_stream(self, runs, i, inputs, hooks=True):
        stream = graphs._capture_stream(inputs.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = run_forward(self, runs, i, inputs, hooks)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    eval_session.Session._run_forward = on_stream


def _head_eager() -> None:
    model: dict = {}
    init, of, add = (eval_session.Session.__init__, metrics.Reference.of.__func__,
                     metrics.Totals.add_logits)

    def keep(self, m, *args, **kwargs):
        model["m"] = m
        init(self, m, *args, **kwargs)

    def body(self, inputs):
        with torch.no_grad():
            return self.model.model(inputs[None], use_cache=False).last_hidden_state[0]

    def head(hidden):
        with torch.no_grad():
            return model["m"].lm_head(hidden)

    eval_session.Session.__init__, eval_session.Session.forward = keep, body
    metrics.Reference.of = classmethod(lambda cls, h: of(cls, head(h)))
    metrics.Totals.add_logits = lambda self, run, h, ref, t, off: add(self, run, head(h), ref,
                                                                      t, off)


def main(variant: str) -> None:
    if variant == "eager-on-capture-stream":
        _eager_on_capture_stream()
    elif variant == "head-eager":
        _head_eager()
    elif variant == "no-reduced-precision":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    elif variant in SDPA:
        cudnn, flash, efficient = SDPA[variant]
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        torch.backends.cuda.enable_flash_sdp(flash)
        torch.backends.cuda.enable_mem_efficient_sdp(efficient)
    path = _tiny.checkpoint("qwen3_moe", Path(tempfile.mkdtemp()))
    found = {}
    for graphed in (False, True):
        report = evaluate(path, PAIRS, text=TEXT, max_tokens=128, seq_len=32, device="cuda",
                          cuda_graph=graphed, log=lambda s: None)
        found[graphed] = [{k: run[k] for k in KEYS} for run in report["pairs"]]
    print(variant, "differing runs",
          [i for i, (a, b) in enumerate(zip(found[False], found[True], strict=True)) if a != b])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "none")
