"""``moewire eval`` on a random MoE model sized like a small real one, for tokens/s and peak
memory.

Builds a random Qwen3-MoE checkpoint with ``save_pretrained`` (default: Qwen3-30B-A3B's
shapes, H 2048, I 768, top-8, vocabulary 151936, with 8 layers and 64 experts), then runs
``moewire eval`` on it and prints the table; ``--out`` gets ``results.json``, ``kl.png``
and the mixed recipe; ``--keep DIR`` keeps the checkpoint (the docs' tiny checkpoints come
from ``moewire checkpoint``, docs/eval.md).

    python benchmarks/eval_random_moe.py --out OUT            # the GPU run (docs/eval.md: H200)
    python benchmarks/eval_random_moe.py --kernel deepgemm-sm90 --per-layer "" --out OUT
                                              # DeepGEMM's real SM90 fp8_mega_moe (Hopper)
    python benchmarks/eval_random_moe.py --layers 2 --experts 8 --hidden 256 --intermediate 256 \
        --max-tokens 128 --device cpu --out /tmp/e            # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def build(path: Path, args: argparse.Namespace) -> float:
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        intermediate_size=4 * args.intermediate, moe_intermediate_size=args.intermediate,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    started = time.perf_counter()
    torch.manual_seed(0)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with device:
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5 * args.hidden**-0.5 * 8)
            elif "experts" in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"built {path}: {params / 1e9:.2f} B parameters in {time.perf_counter() - started:.0f} s")
    return params


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--pairs", nargs="*", default=["fp8:fp8", "fp8:nvfp4", "nvfp4:nvfp4"])
    p.add_argument("--per-layer", default="nvfp4:nvfp4")
    p.add_argument("--budget", type=float, default=0.01)
    p.add_argument("--kernel", default="stand-in", help="stand-in or deepgemm-sm90")
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="write the checkpoint into DIR and keep it (default: a temporary "
                   "directory, deleted at the end); the docs' small checkpoints come from "
                   "`moewire checkpoint`")
    args = p.parse_args()

    from moewire.eval import evaluate, parse_pair, table

    with tempfile.TemporaryDirectory() as scratch:
        tmp = str(args.keep) if args.keep is not None else scratch
        params = build(Path(tmp), args)
        report = evaluate(
            tmp, [parse_pair(x) for x in args.pairs], max_tokens=args.max_tokens,
            seq_len=args.seq_len, kernel=args.kernel, device=args.device, budget=args.budget,
            per_layer=parse_pair(args.per_layer) if args.per_layer else None, out_dir=args.out,
        )
    report["parameters"] = params
    report["shape"] = {k: getattr(args, k) for k in
                       ("layers", "experts", "top_k", "hidden", "intermediate", "vocab")}
    report["device_name"] = (torch.cuda.get_device_name() if torch.cuda.is_available()
                             else "cpu")
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    peak = report["peak_memory_bytes"]
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        report["device_memory_in_use_bytes"] = total - free  # symmetric memory included
        print(f"device memory in use at the end (torch.cuda.mem_get_info, the symmetric "
              f"buffers included): {(total - free) / 2**30:.2f} GiB")
        (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print(f"budget KL {args.budget:g}: {report['budget']['verdict']}")
    print(f"tokens/s over all runs (calibration and quantize included): "
          f"{report['tokens_per_second']:.0f}; peak memory: "
          + (f"{peak / 2**30:.2f} GiB" if peak else "n/a (CPU)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
