"""The metrics of one window of 2048 tokens at a vocabulary of 151936 (``eval_throughput``'s
``metrics_ms``: the baseline's reference and one run's ``add_logits``), with moewire's kernels
off (the float64 torch path) and on (the fused kernel), in one process.

    PYTHONPATH=src python3 benchmarks/results/eval-fused-h100/metrics_time.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eval_throughput import metrics_ms  # noqa: E402


def main() -> None:
    device = torch.device("cuda")
    for disable in ("1", "0"):
        os.environ["MOEWIRE_DISABLE_KERNELS"] = disable
        what = "kernels disabled" if disable == "1" else "fused kernel"
        print(what, metrics_ms(2048, 151936, device))


if __name__ == "__main__":
    main()
