"""Expert parallelism on GPUs: the stand-in and moewire's quantizers over NCCL.

Run one process per GPU::

    torchrun --nproc-per-node N benchmarks/ep_check.py --out benchmarks/results/ep-h200xN

Each rank builds its share of a Mega-MoE layer (DeepSeek-V4-Flash shapes by default) on
the stand-in kernel over an NCCL group (symmetric-memory buffers where torch offers them),
then checks, on every rank:

1. calibration (``moe_fp8_dispatch_nvfp4_combine``) with the last rank routing nothing
   when N > 1: every rank ends with the same amax, and the dispatch amax equals the max
   of |x| over every routing rank's calibration tokens (an all-reduce of the oracle);
2. the eager layout check passes on every rank, and a corrupted combine row on one rank
   is caught there with a ``RuntimeError``;
3. with one rank (the one-rank path has static shapes), a CUDA graph captured after an
   all-padding warm-up replays new inputs bit-identical to eager;
4. timings (medians over CUDA events): the unquantized layer, the quantized layer, and the
   graph replay.

Rank 0 prints a table and writes ``ep_check.json`` into ``--out``. NVLink multicast stays
off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ[_var] = "0" if _var == "NCCL_NVLS_ENABLE" else "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import moewire  # noqa: E402
from moewire.megamoe import combine_rows, layout_check  # noqa: E402
from moewire.reference import MegaMoEExperts, deep_gemm, forward_context, make_weights  # noqa: E402

RECIPE = "moe_fp8_dispatch_nvfp4_combine"


class Layer(torch.nn.Module):
    def __init__(self, experts: MegaMoEExperts) -> None:
        super().__init__()
        self.experts = experts


def make_batch(args, rank: int, seed: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(seed * 1009 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=g, device=device)
    x[:, :4] *= 16.0  # outlier channels, as real hidden states have
    logits = torch.randn(args.tokens, args.experts, generator=g, device=device)
    w, ids = logits.sigmoid().topk(args.topk, dim=-1)
    return x.bfloat16(), (w / w.sum(-1, keepdim=True)).float(), ids


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def corrupting(real):
    def kernel(y, l1, l2, buf, **kwargs):
        real(y, l1, l2, buf, **kwargs)
        t, s = torch.nonzero(buf.topk_idx[: y.shape[0]] >= 0)[0].tolist()
        combine_rows(buf, deep_gemm.current_flavour(), "fp8_fp4_mega_moe")[s, t, 3] += 1.0

    return kernel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--distinct", type=int, default=16, help="make_weights(distinct=...)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/ep"))
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # gloo: a CPU smoke run
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    group = dist.group.WORLD
    shapes = vars(args) | {"out": str(args.out)}
    result: dict = {"world": world, "backend": dist.get_backend(), "shapes": shapes}

    per_rank = args.experts // world
    local_ids = range(rank * per_rank, (rank + 1) * per_rank)
    weights = make_weights(args.experts, args.hidden, args.intermediate, experts=local_ids,
                           distinct=args.distinct, device=device, seed=0)
    experts = MegaMoEExperts(args.experts, args.topk, args.hidden, args.intermediate,
                             args.tokens, group=group, weights=weights, device=device)
    model = Layer(experts)
    idle = world > 1 and rank == world - 1
    padding = torch.ones(args.tokens, dtype=torch.bool, device=device)

    def forward_loop(m):
        for seed in range(2):
            x, w, ids = make_batch(args, rank, seed, device)
            with forward_context(is_padding=padding if idle else None):
                m.experts(x, w, ids)

    x0, w0, ids0 = make_batch(args, rank, 100, device)  # held out from calibration
    plain = Layer(MegaMoEExperts(args.experts, args.topk, args.hidden, args.intermediate,
                                 args.tokens, group=group, weights=weights, device=device))
    plain.experts(x0, w0, ids0)  # warm-up: the weight cache fills here
    t_plain = median_ms(lambda: plain.experts(x0, w0, ids0), args.reps)
    oracle = torch.zeros((), device=device)
    if not idle:
        for seed in range(2):
            oracle = torch.maximum(oracle, make_batch(args, rank, seed, device)[0].abs().amax())
    dist.all_reduce(oracle, op=dist.ReduceOp.MAX)

    moewire.quantize(model, RECIPE, forward_loop=forward_loop)
    amax = torch.stack([experts.dispatch_quantizer.amax, experts.combine_quantizer.amax])
    gathered = [torch.empty_like(amax) for _ in range(world)]
    dist.all_gather(gathered, amax)
    result["amax"] = [g.tolist() for g in gathered]
    result["amax_equal_on_every_rank"] = all(torch.equal(g, gathered[0]) for g in gathered)
    result["dispatch_amax_equals_oracle"] = bool(
        experts.dispatch_quantizer.amax.float() == oracle.float()
    )

    y = model.experts(x0, w0, ids0)  # the eager layout check runs here
    result["layout_checked"] = layout_check.layout_checked(experts.get_symm_buffer())
    result["y_finite"] = bool(torch.isfinite(y).all())
    t_quant = median_ms(lambda: model.experts(x0, w0, ids0), args.reps)
    result["ms"] = {"unquantized": t_plain, "quantized": t_quant}

    # A corrupted row on rank 0 only must be caught there (fresh check state).
    caught = None
    if rank == 0:
        layout_check.reset_layout_checks()
        real = deep_gemm.fp8_fp4_mega_moe
        deep_gemm.fp8_fp4_mega_moe = corrupting(real)
        try:
            model.experts(x0, w0, ids0)
            caught = False
        except RuntimeError as err:
            caught = "layout" in str(err)
        finally:
            deep_gemm.fp8_fp4_mega_moe = real
    else:
        model.experts(x0, w0, ids0)  # keep the collectives of every rank in step
    result["corrupted_row_caught_on_rank0"] = caught

    if world == 1 and cuda:
        layout_check.reset_layout_checks()
        static = [t.clone() for t in make_batch(args, rank, 10, device)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), forward_context(is_padding=padding):
            model.experts(*static)  # all-padding warm-up: the check waits
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model.experts(*static)
        same = []
        for seed in range(11, 14):
            fresh = make_batch(args, rank, seed, device)
            for s, f in zip(static, fresh, strict=True):
                s.copy_(f)
            graph.replay()
            torch.cuda.synchronize()
            same.append(torch.equal(out.view(torch.int16),
                                    model.experts(*fresh).view(torch.int16)))
        result["graph_replay_equals_eager"] = all(same)
        result["ms"]["graph_replay"] = median_ms(graph.replay, args.reps)

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ep_check.json").write_text(json.dumps(result, indent=2))
        print(f"{'check':40s} value")
        for key, value in result.items():
            if key != "shapes":
                print(f"{key:40s} {value}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
