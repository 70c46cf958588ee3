"""Where `moewire eval`'s loading time goes (the 57% of its end-to-end time in this folder's
throughput run): on the same random Qwen3-MoE (Qwen3-30B-A3B shapes, 8 layers), median of 2
after one warm-up, each step alone:

- safetensors: every tensor of the checkpoint read to the GPU (``safetensors.torch.load_file``
  with ``device="cuda"``), the I/O floor;
- from_pretrained: transformers' load with moewire's experts implementation, straight to the
  GPU (what ``moewire.eval.runner._load`` does before ``prepare``);
- prepare: ``moewire.integrations.transformers.prepare`` on that model, per kernel.

    bash .real-kernel/run.sh benchmarks/results/eval-graphs-default/load_profile.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eval_random_moe import build  # noqa: E402


def timed(fn, repeats: int = 2) -> float:
    fn()
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - started)
    return statistics.median(out)


def main() -> int:
    import safetensors.torch
    import transformers as tf

    import moewire.integrations.transformers as mt

    args = argparse.Namespace(layers=8, experts=64, top_k=8, hidden=2048, intermediate=768,
                              vocab=151936, device="cuda")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build(path, args)
        files = sorted(path.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)

        def raw():
            for f in files:
                safetensors.torch.load_file(f, device="cuda")

        rows.append(("safetensors to cuda", timed(raw)))
        mt.register()

        def load():
            return tf.AutoModelForCausalLM.from_pretrained(
                path, experts_implementation=mt.IMPLEMENTATION, dtype=torch.bfloat16,
                local_files_only=True, device_map="cuda").eval()

        rows.append(("from_pretrained (moewire experts)", timed(load)))

        def prepare_seconds(kernel: str) -> float:
            model = load()
            torch.cuda.synchronize()
            started = time.perf_counter()
            mt.prepare(model, None, max_num_tokens=2048, kernel=kernel)
            torch.cuda.synchronize()
            return time.perf_counter() - started

        for kernel in ("stand-in", "deepgemm-sm90"):
            try:
                prepare_seconds(kernel)  # warm-up
                rows.append((f"prepare, {kernel}",
                             statistics.median(prepare_seconds(kernel) for _ in range(2))))
            except Exception as exc:  # noqa: BLE001 - the row says why
                rows.append((f"prepare, {kernel}: {type(exc).__name__}: {exc}"[:120], float("nan")))
    print(f"checkpoint {size / 1e9:.2f} GB, {torch.cuda.get_device_name()}")
    for name, seconds in rows:
        print(f"{name:<40} {seconds:8.3f} s" + (f"  ({size / seconds / 1e9:.1f} GB/s)"
                                                   if seconds == seconds else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
