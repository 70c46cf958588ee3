"""Which runs' metrics differ between eager and graphed ``moewire eval`` on a GPU, and why:
eager twice and graphed twice (is either side itself not reproducible?), graphed against
eager, the runs in reverse order (is it the last run, or a format?), the graphs in separate
memory pools (a pool hazard?), every replay between two synchronizations (a stream race?),
and one more run at the end. One line per comparison, the differing runs by index.

    PYTHONPATH=src:tests/hf_transformers:tests/eval python3 \\
        benchmarks/results/eval-graphs-h100/graph_vs_eager.py
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

from moewire.eval import evaluate  # noqa: E402
from moewire.eval import graphs as eval_graphs  # noqa: E402

PAIRS = [("fp8", "fp8"), ("fp8", "nvfp4"), ("nvfp4", "nvfp4")]
KEYS = ("perplexity", "kl_mean", "kl_p99", "top1_agreement", "layer_rel_l2")


def metrics(path: Path, cuda_graph: bool, pairs=PAIRS) -> list[dict]:
    report = evaluate(path, pairs, text=TEXT, max_tokens=128, seq_len=32, device="cuda",
                      cuda_graph=cuda_graph, log=lambda s: None)
    return [{k: run[k] for k in KEYS} for run in report["pairs"]]


def compare(tag: str, a: list[dict], b: list[dict]) -> None:
    differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    print(f"{tag}: differing runs {differ}", flush=True)


def main() -> None:
    path = _tiny.checkpoint("qwen3_moe", Path(tempfile.mkdtemp()))
    eager = metrics(path, False)
    compare("eager vs eager", eager, metrics(path, False))
    graphed = metrics(path, True)
    compare("graphed vs graphed", graphed, metrics(path, True))
    compare("graphed vs eager", graphed, eager)
    compare("reversed: graphed vs eager", metrics(path, True, PAIRS[::-1]),
            metrics(path, False, PAIRS[::-1]))
    real_graph = torch.cuda.graph
    torch.cuda.graph = lambda g, pool=None, stream=None: real_graph(g, stream=stream)
    compare("separate pools: graphed vs eager", metrics(path, True), eager)
    torch.cuda.graph = real_graph
    replay = eval_graphs.WindowGraphs.replay

    def synced(self, run, inputs):
        torch.cuda.synchronize()
        out = replay(self, run, inputs)
        torch.cuda.synchronize()
        return out

    eval_graphs.WindowGraphs.replay = synced
    compare("synchronized replays: graphed vs eager", metrics(path, True), eager)
    eval_graphs.WindowGraphs.replay = replay
    more = [*PAIRS, ("bf16", "fp8")]
    compare("one more run: graphed vs eager", metrics(path, True, more), metrics(path, False, more))


if __name__ == "__main__":
    main()
