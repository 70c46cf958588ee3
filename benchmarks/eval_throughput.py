"""``moewire eval`` beside the plain forward it measures: tokens/s per run and peak memory.

In one process, on one random Qwen3-MoE checkpoint (``eval_random_moe.build``; default
Qwen3-30B-A3B's shapes with 8 layers and 64 experts), at each token count:

- plain: the model with transformers' ``experts_implementation="grouped_mm"``, a forward
  over the same windows as the evaluation (logits computed and dropped), tokens/s;
- eval: ``moewire.eval.evaluate`` on the same checkpoint and text, eagerly and (on CUDA)
  with every run's window forward replayed from a CUDA graph (``cuda_graph``); each run's
  tokens/s is its share of the lockstep loop (its forward, the swap of its quantizers and
  its metrics), reported as a fraction of the plain forward's tokens/s; loading, ``prepare``,
  the calibration forwards and the capture are reported apart, and end to end (the whole
  ``evaluate`` call: tokens over its seconds, as a fraction of the plain forward's);
- the metrics of one window alone (``moewire.eval.metrics``: the baseline's reference and
  one run's sums, on random logits), so the rest of a run's time is its forward;
- peak host memory (``VmHWM`` of ``/proc/self/status``, reset before each measurement by
  writing 5 to ``/proc/self/clear_refs``) and peak device memory
  (``torch.cuda.max_memory_allocated``).

Prints a table and writes ``eval_throughput.json`` into ``--out``. ``--kernel
deepgemm-sm90`` evaluates on DeepGEMM's real SM90 kernel (the plain forward stays
``grouped_mm``).

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


def metrics_ms(seq_len: int, vocab: int, device: torch.device, iters: int = 5) -> dict:
    """Milliseconds of one window's metrics (``moewire.eval.metrics``) on random logits:
    the baseline's :class:`~moewire.eval.metrics.Reference` and one run's
    :meth:`~moewire.eval.metrics.Totals.add_logits` (median of ``iters``, after one)."""
    import statistics

    from moewire.eval.metrics import Reference, Totals

    g = torch.Generator(device).manual_seed(0)
    logits = [torch.randn(seq_len, vocab, device=device, generator=g).bfloat16()
              for _ in range(2)]
    targets = torch.randint(0, vocab, (seq_len,), device=device, generator=g)
    totals = Totals(2, [], seq_len, device)

    def timed(fn) -> float:
        times = []
        for _ in range(iters + 1):
            _sync(device)
            started = time.perf_counter()
            fn()
            _sync(device)
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times[1:])

    ref = Reference.of(logits[0])
    return {"reference_ms": timed(lambda: Reference.of(logits[0])),
            "add_logits_ms": timed(lambda: totals.add_logits(1, logits[1], ref, targets, 0))}


def run_eval(path: Path, pairs, text: str, tokens: int, args: argparse.Namespace,
             device: torch.device, cuda_graph: bool, plain_tps: float) -> dict:
    """One ``evaluate`` (eager or graphed): its phases, peaks, and each run's tokens/s."""
    from moewire.eval import evaluate

    reset_host_peak()
    _device_peak_reset(device)
    started = time.perf_counter()
    report = evaluate(path, pairs, text=text, max_tokens=tokens, seq_len=args.seq_len,
                      device=str(device), kernel=args.kernel, cuda_graph=cuda_graph,
                      log=lambda s: print(s, file=sys.stderr))
    seconds = time.perf_counter() - started
    return {
        "cuda_graph": report["cuda_graph"]["used"],
        "graph_pool_bytes": report["cuda_graph"]["pool_bytes"],
        "graph_fallback": report["cuda_graph"]["fallback"],
        "eval_seconds": seconds, "eval_phases": report["seconds"],
        "end_to_end_tokens_per_second": tokens / seconds,
        "end_to_end_fraction": tokens / seconds / plain_tps,
        "eval_host_peak_bytes": host_peak_bytes(), "eval_device_peak_bytes": _device_peak(device),
        "runs": [{"name": r["name"], "tokens_per_second": r["tokens_per_second"],
                  "fraction_of_plain": r["tokens_per_second"] / plain_tps,
                  "kl_mean": r["kl_mean"]} for r in report["pairs"]],
    }


def measure(path: Path, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Per token count: the plain forward, then ``evaluate`` eagerly and (on CUDA) under
    CUDA graphs. The row's ``runs`` and peaks are its last evaluation's (graphed on CUDA);
    ``evals`` holds each."""
    import transformers as tf

    from moewire.eval import parse_pair

    pairs = [parse_pair(p) for p in args.pairs]
    modes = [False, True] if device.type == "cuda" else [False]
    rows = []
    reset_host_peak()
    plain = tf.AutoModelForCausalLM.from_pretrained(
        path, experts_implementation="grouped_mm", dtype=torch.bfloat16,
        local_files_only=True).to(device)
    plain.eval()
    vocab = int(plain.config.vocab_size)
    texts = {}
    for tokens in args.tokens:
        text = texts[tokens] = text_of(tokens)
        ids = torch.tensor(list(text.encode())[: tokens + 1]) % vocab
        exact = reset_host_peak()
        _device_peak_reset(device)
        seconds = plain_forward(plain, ids, args.seq_len, device)
        counted = (ids.numel() - 1) // args.seq_len * args.seq_len or ids.numel() - 1
        rows.append({"tokens": tokens, "plain_tokens_per_second": counted / seconds,
                     "plain_host_peak_bytes": host_peak_bytes(),
                     "plain_device_peak_bytes": _device_peak(device),
                     "host_peak_since_reset": exact})
    del plain
    _device_peak_reset(device)
    for row in rows:
        row["evals"] = [run_eval(path, pairs, texts[row["tokens"]], row["tokens"], args,
                                 device, mode, row["plain_tokens_per_second"])
                        for mode in modes]
        row.update({k: row["evals"][-1][k] for k in (
            "eval_seconds", "eval_phases", "eval_host_peak_bytes", "eval_device_peak_bytes",
            "runs")})
    return rows


def table(rows: list[dict]) -> str:
    gib = 2**30
    head = (f"{'tokens':>7} {'plain tok/s':>12} {'mode':<8}{'run':<14}{'eval tok/s':>11}"
            f"{'/ plain':>9}{'end to end':>12}{'host GiB plain/eval':>21}{'device GiB':>12}")
    lines = [head]
    for row in rows:
        first_row = True
        for ev in row.get("evals", [row]):
            device = ev["eval_device_peak_bytes"]
            mode = "graphed" if ev.get("cuda_graph") else "eager"
            for i, run in enumerate(ev["runs"]):
                first = i == 0
                lines.append(
                    (f"{row['tokens']:>7} {row['plain_tokens_per_second']:>12.0f} "
                     if first and first_row else " " * 21)
                    + (f"{mode:<8}" if first else " " * 8)
                    + f"{run['name']:<14}{run['tokens_per_second']:>11.0f}"
                    + f"{run['fraction_of_plain']:>9.2f}"
                    + (f"{ev.get('end_to_end_fraction', float('nan')):>12.2f}"
                       + f"{row['plain_host_peak_bytes'] / gib:>10.2f} /"
                       f"{ev['eval_host_peak_bytes'] / gib:>9.2f}"
                       + (f"{device / gib:>12.2f}" if device is not None else f"{'-':>12}")
                       if first else ""))
            first_row = False
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
    p.add_argument("--kernel", default="stand-in", choices=["stand-in", "deepgemm-sm90"],
                   help="the experts kernel of the evaluation (deepgemm-sm90: a Hopper GPU "
                        "with DeepGEMM's SM90 Mega-MoE package)")
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.device = str(device)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        params = build(Path(tmp), args)
        rows = measure(Path(tmp), args, device)
    window = metrics_ms(args.seq_len, args.vocab, device)
    import transformers

    doc = {
        "shape": {k: getattr(args, k) for k in ("layers", "experts", "top_k", "hidden",
                                                 "intermediate", "vocab")},
        "parameters": params, "seq_len": args.seq_len, "pairs": args.pairs,
        "kernel": args.kernel, "metrics_per_window": window, "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else platform.processor() or "cpu"),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "rows": rows,
    }
    (args.out / "eval_throughput.json").write_text(json.dumps(doc, indent=1))
    print(table(rows))
    big = [r for r in rows if r["tokens"] >= 16384] or rows
    hosts = [r["eval_host_peak_bytes"] for r in rows]
    for ev_index, ev in enumerate(big[0]["evals"]):
        mode = "graphed" if ev["cuda_graph"] else "eager"
        worst = min(run["fraction_of_plain"] for r in big for run in r["evals"][ev_index]["runs"])
        last = rows[-1]["evals"][ev_index]
        print(f"{mode}: slowest run at >= {big[0]['tokens']} tokens: {worst:.2f} of the plain "
              f"forward's tokens/s; end to end at {rows[-1]['tokens']} tokens: "
              f"{last['end_to_end_fraction']:.2f} ({last['eval_seconds']:.1f} s: "
              + ", ".join(f"{k} {v:.1f}" for k, v in last["eval_phases"].items()) + ")")
    for row in rows:
        for ev in row["evals"]:
            if ev.get("graph_fallback"):
                print(f"{row['tokens']} tokens: CUDA graphs dropped: {ev['graph_fallback']}")
    print(f"metrics of one window of {args.seq_len} tokens: {window['add_logits_ms']:.1f} ms a "
          f"run, the baseline's reference {window['reference_ms']:.1f} ms more; the plain "
          f"forward of one window: {args.seq_len / rows[-1]['plain_tokens_per_second'] * 1e3:.1f}"
          " ms")
    print(f"eval's peak host memory {min(hosts) / 2**30:.2f} to "
          f"{max(hosts) / 2**30:.2f} GiB over {rows[0]['tokens']} to {rows[-1]['tokens']} tokens")
    print(f"wrote {args.out / 'eval_throughput.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
