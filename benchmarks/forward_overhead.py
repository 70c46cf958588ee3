"""What the wire quantizers cost a transformers forward: transformers' ``grouped_mm``, the
``"moewire"`` experts implementation plain and quantized, on the stand-in kernel and on
DeepGEMM's real SM90 ``fp8_mega_moe``, side by side in one process.

A random Qwen3-MoE model (default: Qwen3-30B-A3B's expert shapes, H 2048, I 768, 64 experts,
top-8, vocabulary 151936, 8 layers) runs one forward of ``--batch x --seq`` tokens, eager and
(``"moewire"`` rows) replayed from a CUDA graph captured by hand (``torch.cuda.graph`` around
the whole forward, after the layout check has run eagerly). Each row is the median of
``--iters`` timed forwards (CUDA events); the ratios are each quantized row over its plain
row on the same kernel, and every row over ``grouped_mm``.

    python benchmarks/forward_overhead.py --out forward.json            # a CUDA GPU
    python benchmarks/forward_overhead.py --profile --out forward.json  # + torch.profiler
    python benchmarks/forward_overhead.py --device cpu --layers 1 --experts 8 --hidden 256 \\
        --intermediate 256 --vocab 512 --seq 16 --iters 1 --out /tmp/f.json  # a CPU smoke run

The real kernel rows run when ``moewire.integrations.deepgemm_sm90.available()`` (a Hopper
GPU with DeepGEMM's SM90 Mega-MoE package; docs/real-kernel.md). ``--profile`` prints, per
``"moewire"`` row, the ten operators with the most device time and the number of kernel
launches a forward makes, and writes ``profile_<row>.txt`` beside ``--out``.

JSON (``--out``): ``{"config": ..., "rows": [{"row", "kernel", "quantized", "graph", "ms",
"x_plain", "x_grouped_mm", "launches"}]}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

RECIPE = "moe_fp8_dispatch_nvfp4_combine"


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        intermediate_size=4 * args.intermediate, moe_intermediate_size=args.intermediate,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5 * args.hidden**-0.5 * 8)
            elif "experts" in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], iters: int, device: str) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graphed(forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The forward captured once in a CUDA graph (static input); replays it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph.replay


def launches(fn: Callable[[], object], device: str) -> tuple[int, str]:
    """Kernel launches of one call of ``fn``, and the profiler's table of the top operators."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    fn()
    _sync(device)
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    events = prof.events()
    count = sum(1 for e in events if getattr(e, "device_type", None) is not None
                and str(e.device_type).endswith("CUDA"))
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return count, prof.key_averages().table(sort_by=sort, row_limit=12)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-real", action="store_true", help="skip the real SM90 kernel rows")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import moewire
    from moewire.integrations import deepgemm_sm90
    from moewire.integrations import transformers as mt

    mt.register()
    model = build_model(args)
    tokens = args.batch * args.seq
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(1))
    calib = [torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device,
                           generator=torch.Generator(args.device).manual_seed(2 + i))
             for i in range(2)]

    @torch.no_grad()
    def forward() -> torch.Tensor:
        return model(input_ids=ids).logits

    @torch.no_grad()
    def forward_loop(m: torch.nn.Module) -> None:
        for c in calib:
            m(input_ids=c)

    rows: list[dict] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def run(row: str, kernel: str, quantized: bool) -> None:
        entry = {"row": row, "kernel": kernel, "quantized": quantized, "graph": False}
        entry["ms"] = time_ms(forward, args.iters, args.device)
        if args.profile:
            entry["launches"], table = launches(forward, args.device)
            (out.parent / f"profile_{row.replace('/', '_')}.txt").write_text(table)
            print(f"-- {row}: {entry['launches']} kernel launches a forward\n{table}")
        rows.append(entry)
        if args.device == "cuda" and kernel != "grouped_mm":
            graph = {**entry, "row": row + "+graph", "graph": True}
            try:
                graph["ms"] = time_ms(graphed(forward), args.iters, args.device)
            except RuntimeError as exc:  # a forward that cannot be captured: say why
                graph["ms"], graph["error"] = float("nan"), str(exc).splitlines()[0][:200]
                print(f"-- {row}: no CUDA graph: {graph['error']}")
            rows.append(graph)

    model.set_experts_implementation("grouped_mm")
    run("grouped_mm", "grouped_mm", False)
    kernels = [("stand-in", None)]
    if not args.no_real and deepgemm_sm90.available()[0]:
        kernels.append(("deepgemm-sm90", "fp8xfp8"))
    for kernel, mma in kernels:
        model.set_experts_implementation(mt.IMPLEMENTATION)
        mt.prepare(model, mma, kernel=kernel, max_num_tokens=tokens)
        run(f"moewire/{kernel}", kernel, False)
        moewire.quantize(model, RECIPE, forward_loop=forward_loop)
        forward()  # the first routed batch: the layout check, eagerly
        run(f"moewire/{kernel}/{RECIPE}", kernel, True)
        moewire.unquantize(model)

    base = next(r["ms"] for r in rows if r["row"] == "grouped_mm")
    for r in rows:
        r["x_grouped_mm"] = r["ms"] / base
        if r["quantized"]:
            plain = next(q["ms"] for q in rows if q["kernel"] == r["kernel"]
                         and not q["quantized"] and q["graph"] == r["graph"])
            r["x_plain"] = r["ms"] / plain
    config = {k: getattr(args, k) for k in ("layers", "experts", "top_k", "hidden",
                                            "intermediate", "vocab", "batch", "seq", "iters",
                                            "device")}
    if args.device == "cuda":
        config["gpu"] = torch.cuda.get_device_name()
    out.write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    print(f"\n{tokens} tokens, {args.layers} layers, H {args.hidden}, {args.experts} experts "
          f"top-{args.top_k}; median of {args.iters}")
    print(f"{'row':<55}{'ms':>9}{'x plain':>9}{'x grouped_mm':>14}")
    for r in rows:
        plain = f"{r['x_plain']:.2f}" if "x_plain" in r else "-"
        print(f"{r['row']:<55}{r['ms']:>9.2f}{plain:>9}{r['x_grouped_mm']:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
