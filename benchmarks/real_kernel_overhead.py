"""moewire's cost on a real fused kernel: DeepGEMM's SM90 Mega-MoE (PR #323) on a Hopper GPU.

For each kernel (``fp8_mega_moe``, ``fp8_fp4_mega_moe``) at DeepSeek-V4-Flash's routed
layer (256 experts on one GPU, top-6, H 4096, I 2048) and each token count, it times the
experts module's forward (staging + the fused kernel) alone, then with moewire's FP8
dispatch quantizer and a combine quantizer in bf16 / fp8 / nvfp4 / mxfp8 (constant amaxes,
the layout check passed eagerly first), eager (a loop between CUDA events) and inside a
CUDA graph (``reps`` forwards captured in one graph). ``added %`` is moewire's time over the
forward alone. Prints a table; ``--out`` writes the rows as JSON.

    python benchmarks/real_kernel_overhead.py --out overhead.json   (deep_gemm on PYTHONPATH)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _bench import print_table, time_graph, time_loop  # noqa: E402

import moewire  # noqa: E402
from moewire import formats  # noqa: E402
from moewire.integrations import deepgemm_sm90 as sm90  # noqa: E402

SHAPE = dict(experts=256, top_k=6, hidden=4096, inter=2048)  # V4-Flash (SPEC 1.4)
TOKENS = (128, 1024, 4096, 8192)
COMBINES = ("bf16", "fp8", "nvfp4", "mxfp8")
COLUMNS = [
    ("kernel", "kernel", ""), ("tokens", "T", ""), ("mode", "moewire", ""),
    ("eager_us", "eager us", ".1f"), ("eager_added_pct", "added %", ".1f"),
    ("graph_us", "graph us", ".1f"), ("graph_added_pct", "added %", ".1f"),
]


def _group():
    import torch.distributed as dist

    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1,
                            rank=0, device_id=torch.device("cuda:0"))
    return dist.new_group([0])


def _gen(tag: str) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(zlib.crc32(tag.encode()))


def _weights(kernel: str):
    g = _gen("weights")
    e, h, i = SHAPE["experts"], SHAPE["hidden"], SHAPE["inter"]
    bf16 = dict(generator=g, device="cuda", dtype=torch.bfloat16)
    l1 = torch.randn(e, 2 * i, h, **bf16).mul_(h**-0.5)
    l2 = torch.randn(e, h, i, **bf16).mul_(i**-0.5)
    return sm90.quantize_weights(l1, l2, kernel)


def _batch(tokens: int):
    g = _gen(f"batch{tokens}")
    x = torch.randn(tokens, SHAPE["hidden"], generator=g, device="cuda").bfloat16()
    w, ids = torch.randn(tokens, SHAPE["experts"], generator=g, device="cuda").topk(
        SHAPE["top_k"], dim=-1)
    return x, w.softmax(-1), ids


def _recipe(combine: str, x_amax: float, row_amax: float) -> dict:
    cfg = {"format": combine}
    if formats.get(combine).needs_amax:
        cfg["constant_amax"] = row_amax
    return {"quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer",
         "cfg": {"format": "fp8", "constant_amax": x_amax}},
        {"quantizer_name": "*combine_quantizer", "cfg": cfg},
    ]}


def _caller(module, x, w, ids):
    return lambda i: module(x, w, ids)


def run(kernels: tuple[str, ...], tokens: tuple[int, ...], reps: int, group,
        out: Path | None, meta: dict) -> list[dict]:
    rows = []
    for kernel in kernels:
        w1, w2 = _weights(kernel)
        for t in tokens:
            buf = sm90.deep_gemm.get_symm_buffer_for_sm90_mega_moe(
                group, SHAPE["experts"], t, SHAPE["top_k"], SHAPE["hidden"], SHAPE["inter"])
            x, w, ids = _batch(t)
            plain = sm90.SM90MegaMoEExperts(w1, w2, buf, kernel)
            with torch.no_grad():
                plain(x, w, ids)
                k, tmax, h = SHAPE["top_k"], buf.num_max_tokens_per_rank, SHAPE["hidden"]
                region = buf.buffer[buf.buffer.numel() - k * tmax * h * 2:]
                row_amax = float(region.view(torch.bfloat16).view(k, tmax, h)[:, :t]
                                 .float().abs().max())
                x_amax = float(x.float().abs().max())
                modules = {"none (kernel)": plain}
                for combine in COMBINES:
                    m = sm90.SM90MegaMoEExperts(w1, w2, buf, kernel)
                    modules[f"fp8 + {combine}"] = moewire.quantize(
                        m, _recipe(combine, x_amax, row_amax))
                base = None
                for mode, m in modules.items():
                    m(x, w, ids)  # JIT, and the eager layout check
                    call = _caller(m, x, w, ids)
                    eager = time_loop(call, reps)
                    graph = time_graph(call, reps)
                    base = base or (eager, graph)
                    row = dict(kernel=kernel, tokens=t, mode=mode, eager_us=eager, graph_us=graph,
                               eager_added_pct=100 * (eager - base[0]) / base[0],
                               graph_added_pct=100 * (graph - base[1]) / base[1])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if out:  # after every row: a run stopped early keeps what it measured
                        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            buf.destroy()
            del plain, modules, buf
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--kernels", nargs="*", default=list(sm90.KERNELS),
                        choices=list(sm90.KERNELS))
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    ok, why = sm90.available()
    if not ok:
        sys.exit(f"real_kernel_overhead: the real SM90 kernel cannot run here: {why}")
    group = _group()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                deep_gemm=getattr(sm90.deep_gemm, "__version__", "?"), shape=SHAPE,
                reps=args.reps)
    rows = run(tuple(args.kernels), tuple(args.tokens), args.reps, group, args.out, meta)
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
