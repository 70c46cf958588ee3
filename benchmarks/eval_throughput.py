"""``moewire eval`` beside the plain forward it measures: tokens/s per run and peak memory.

In one process, on one random Qwen3-MoE checkpoint (``eval_random_moe.build``; default
Qwen3-30B-A3B's shapes with 8 layers and 64 experts), at each token count:

- plain: the model with transformers' ``experts_implementation="grouped_mm"``, a forward
  over the same windows as the evaluation (logits computed and dropped), tokens/s;
- eval: ``moewire.eval.evaluate`` on the same checkpoint and text; each run's tokens/s is
  its share of the lockstep loop (its forward, the swap of its quantizers and its metrics),
  reported as a fraction of the plain forward's tokens/s; loading, ``prepare`` and the
  calibration forwards are reported apart;
- peak host memory (``VmHWM`` of ``/proc/self/status``, reset before each measurement by
  writing 5 to ``/proc/self/clear_refs``) and peak device memory
  (``torch.cuda.max_memory_allocated``).

Prints a table and writes ``eval_throughput.json`` into ``--out``.

    python benchmarks/eval_throughput.py --out OUT        # on a GPU: 4k..64k tokens
    python benchmarks/eval_throughput.py --device cpu --layers 1 --experts 4 --top-k 2 \\
        --hidden 128 --intermediate 128 --vocab 256 --tokens 64 128 --seq-len 32 \\
        --pairs fp8:nvfp4 --out /tmp/t                     # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval_random_moe import build  # noqa: E402


def reset_host_peak() -> bool:
    """Reset the kernel's peak resident set size of this process (Linux 4.0+); False where
    it cannot (the peak is then the process's since it started)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def host_peak_bytes() -> int:
    """This process's peak resident set size since the last :func:`reset_host_peak`."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _device_peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def text_of(tokens: int) -> str:
    """The embedded calibration text, repeated to at least ``tokens + 1`` bytes (a random
    checkpoint has no tokenizer: moewire eval reads bytes modulo the vocabulary)."""
    import moewire

    base = (Path(moewire.__file__).parent / "data" / "calibration.txt").read_text()
    return base * (tokens // len(base.encode()) + 2)


def plain_forward(model, ids: torch.Tensor, seq_len: int, device: torch.device) -> float:
    """Seconds of the forward over ``ids`` in windows of ``seq_len`` (after one warm-up
    window), the logits of each window computed and dropped."""
    windows = [ids[i : i + seq_len].to(device) for i in range(0, ids.numel() - 1, seq_len)]
    windows = [w for w in windows if w.numel() == seq_len] or windows[:1]
    with torch.no_grad():
        model(windows[0][None], use_cache=False)
        _sync(device)
        started = time.perf_counter()
        for w in windows:
            model(w[None], use_cache=False).logits  # noqa: B018
        _sync(device)
    return time.perf_counter() - started


def measure(path: Path, args: argparse.Namespace, device: torch.device) -> list[dict]:
    import transformers as tf

    from moewire.eval import evaluate, parse_pair

    pairs = [parse_pair(p) for p in args.pairs]
    rows = []
    reset_host_peak()
    plain = tf.AutoModelForCausalLM.from_pretrained(
        path, experts_implementation="grouped_mm", dtype=torch.bfloat16,
        local_files_only=True).to(device)
    plain.eval()
    vocab = int(plain.config.vocab_size)
    for tokens in args.tokens:
        text = text_of(tokens)
        ids = torch.tensor(list(text.encode())[: tokens + 1]) % vocab
        exact = reset_host_peak()
        _device_peak_reset(device)
        seconds = plain_forward(plain, ids, args.seq_len, device)
        counted = (ids.numel() - 1) // args.seq_len * args.seq_len or ids.numel() - 1
        plain_row = {"tokens": tokens, "plain_tokens_per_second": counted / seconds,
                     "plain_host_peak_bytes": host_peak_bytes(),
                     "plain_device_peak_bytes": _device_peak(device),
                     "host_peak_since_reset": exact}
        reset_host_peak()
        _device_peak_reset(device)
        started = time.perf_counter()
        report = evaluate(path, pairs, text=text, max_tokens=tokens, seq_len=args.seq_len,
                          device=str(device), log=lambda s: print(s, file=sys.stderr))
        plain_row.update(
            eval_seconds=time.perf_counter() - started, eval_phases=report["seconds"],
            eval_host_peak_bytes=host_peak_bytes(), eval_device_peak_bytes=_device_peak(device),
            runs=[{"name": r["name"], "tokens_per_second": r["tokens_per_second"],
                   "fraction_of_plain": r["tokens_per_second"]
                   / plain_row["plain_tokens_per_second"], "kl_mean": r["kl_mean"]}
                  for r in report["pairs"]])
        rows.append(plain_row)
    del plain
    return rows


def table(rows: list[dict]) -> str:
    gib = 2**30
    head = (f"{'tokens':>7} {'plain tok/s':>12} {'run':<14}{'eval tok/s':>11}{'/ plain':>9}"
            f"{'host GiB plain/eval':>21}{'device GiB eval':>17}")
    lines = [head]
    for row in rows:
        device = row["eval_device_peak_bytes"]
        for i, run in enumerate(row["runs"]):
            first = i == 0
            lines.append(
                (f"{row['tokens']:>7} {row['plain_tokens_per_second']:>12.0f} " if first
                 else " " * 21)
                + f"{run['name']:<14}{run['tokens_per_second']:>11.0f}"
                + f"{run['fraction_of_plain']:>9.2f}"
                + (f"{row['plain_host_peak_bytes'] / gib:>10.2f} /"
                   f"{row['eval_host_peak_bytes'] / gib:>9.2f}"
                   + (f"{device / gib:>17.2f}" if device is not None else f"{'-':>17}")
                   if first else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--pairs", nargs="+", default=["fp8:fp8", "fp8:nvfp4", "nvfp4:nvfp4"])
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.device = str(device)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        params = build(Path(tmp), args)
        rows = measure(Path(tmp), args, device)
    import transformers

    doc = {
        "shape": {k: getattr(args, k) for k in ("layers", "experts", "top_k", "hidden",
                                                 "intermediate", "vocab")},
        "parameters": params, "seq_len": args.seq_len, "pairs": args.pairs,
        "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or "cpu"),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "rows": rows,
    }
    (args.out / "eval_throughput.json").write_text(json.dumps(doc, indent=1))
    print(table(rows))
    big = [r for r in rows if r["tokens"] >= 16384] or rows
    worst = min(run["fraction_of_plain"] for r in big for run in r["runs"])
    hosts = [r["eval_host_peak_bytes"] for r in rows]
    print(f"slowest run at >= {big[0]['tokens']} tokens: {worst:.2f} of the plain forward's "
          f"tokens/s; eval's peak host memory {min(hosts) / 2**30:.2f} to "
          f"{max(hosts) / 2**30:.2f} GiB over {rows[0]['tokens']} to {rows[-1]['tokens']} tokens")
    print(f"wrote {args.out / 'eval_throughput.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
