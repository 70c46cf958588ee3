"""Where a graphed ``moewire eval`` first differs from the eager one: every run's logits of
every window (host copies, compared element by element), the evaluation's sum buffer column
by column (0 KL, 1 NLL, 2 top-1, 3 tokens, then per experts layer the squared error and the
baseline's square, then one KL per token), and which path ``reference._kernel._grouped_matmul``
took eagerly and under capture. The tiny Qwen3-MoE of the tests (2 layers, vocabulary 256),
4 windows of 32 tokens.

    PYTHONPATH=src python3 benchmarks/results/eval-fused-h100/graph_vs_eager_tokens.py
"""

from __future__ import annotations

import collections
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests" / "hf_transformers"), str(ROOT / "tests" / "eval")]

import _tiny  # noqa: E402
from eval_helpers import TEXT  # noqa: E402

from moewire.eval import evaluate, metrics  # noqa: E402
from moewire.eval import session as eval_session  # noqa: E402
from moewire.reference import _kernel  # noqa: E402

PAIRS = [("fp8", "fp8"), ("nvfp4", "nvfp4"), ("bf16", "fp8")]
PATHS: collections.Counter = collections.Counter()
LOGITS: dict[tuple[str, int, int], torch.Tensor] = {}
BUFFERS: dict[str, torch.Tensor] = {}
MODE = ["eager"]


def _patch() -> None:
    masked, grouped = _kernel._masked_grouped_matmul, _kernel._grouped_matmul
    add_logits, measure = metrics.Totals.add_logits, eval_session.Session.measure

    def count_masked(*args, **kwargs):
        PATHS["masked"] += 1
        return masked(*args, **kwargs)

    def count_grouped(x, experts, ends, out_dtype=None):
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        PATHS[("capture" if capturing else "eager", str(out_dtype),
               experts.dense is not None)] += 1
        return grouped(x, experts, ends, out_dtype)

    def keep_logits(self, run, logits, ref, targets, offset):
        LOGITS[(MODE[0], run, offset)] = logits.float().cpu().clone()
        return add_logits(self, run, logits, ref, targets, offset)

    def keep_buffer(self, *args, **kwargs):
        totals = measure(self, *args, **kwargs)
        BUFFERS[MODE[0]] = totals.buffer.cpu().clone()
        return totals

    _kernel._masked_grouped_matmul, _kernel._grouped_matmul = count_masked, count_grouped
    metrics.Totals.add_logits, eval_session.Session.measure = keep_logits, keep_buffer


def main() -> None:
    _patch()
    path = _tiny.checkpoint("qwen3_moe", Path(tempfile.mkdtemp()))
    for MODE[0], graphed in (("eager", False), ("graphed", True)):
        PATHS.clear()
        evaluate(path, PAIRS, text=TEXT, max_tokens=128, seq_len=32, device="cuda",
                 cuda_graph=graphed, log=lambda s: None)
        print(MODE[0], dict(PATHS))
    for key in sorted(k for k in LOGITS if k[0] == "eager"):
        a, b = LOGITS[key], LOGITS[("graphed", *key[1:])]
        print("run", key[1], "offset", key[2], "logits equal", torch.equal(a, b), "maxdiff",
              (a - b).abs().max().item())
    eager, graphed = BUFFERS["eager"], BUFFERS["graphed"]
    for run in range(eager.shape[0]):
        differ = (eager[run] != graphed[run]).nonzero().flatten().tolist()
        print("run", run, "differing columns", differ[:20], len(differ), "of", eager.shape[1])


if __name__ == "__main__":
    main()
