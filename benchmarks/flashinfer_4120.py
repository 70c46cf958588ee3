"""FlashInfer's Mega-MoE accuracy table reproduced on CPU with moewire's formats, and split.

FlashInfer's BF16 Mega-MoE pull request (flashinfer-ai/flashinfer #4120, rebased as #4386)
reports, for its SM100 CuTe DSL megakernels on 2x B200 (EP = DP = 2, 256 experts, top-8,
H 7168, I 2048, 8 tokens per rank), ``acc_loss %``: the relative L2 error of the whole
megakernel's output against an FP32 dense MoE: BF16 0.286, MXFP8 6.371, NVFP4 23.324.
The numbers come from ``bench_moe_ep_mega.py`` of github.com/mhoqueanik/moe_ep_benchmark
(read at ba9f8ac; the accuracy pass since aad6483), with its data from ``bench_common.py``:

- tokens: ``randn(m, H, bf16) / 10`` (BF16 draw, divided in BF16), per rank;
- routing: ``scores = randn(m, E)`` FP32, ``topk_weights, topk_ids = topk(scores, k,
  sorted=False)``: the weights are the raw scores (no softmax, no renormalisation);
- weights: ``w13 = randn(E_local, 2I, H, bf16) / 15`` (``[gate; up]``), ``w2 =
  randn(E_local, H, I, bf16) / 15``, handed to FlashInfer as BF16
  (``MegaConfig(preprocess_weights=True)``: FlashInfer quantizes them itself);
- reference (``compute_dense_moe_reference``): FP32 over the BF16 values, ``gate =
  min(x w_gate, c)``, ``up = clamp(x w_up, -c, c)``, ``c = 10`` (``--gate-up-clamp``),
  ``y = sum_k s_k * w2 (silu(gate) * up)``;
- ``acc_loss = 100 * sqrt(sum (y - y_ref)^2 / sum y_ref^2)`` over every token of every rank.

What each kernel does with those inputs, read from flashinfer-python 0.7.2.post1 (PyPI
wheel), ``moe_ep/``:

- weights: MXFP8 E4M3 per 32 along K, UE8M0 scale ``2^ceil(log2(amax * fl(1/448)))``
  (``backends/mega/kernel/sm100/mxfp8_mxfp8_bf16_cutedsl/weights.py`` ->
  ``kernel_src/sm100/cutedsl_megamoe/src/common/host_utils.py``,
  ``mxfp8_quantize_per_block_32``), or NVFP4 per 16 along K with ``norm_const = 1``, no
  global scale: E4M3 scale ``e4m3(amax * fl(1/6))``, elements E2M1 of ``x * rcp(scale)``
  (``nvfp4_nvfp4_bf16_cutedsl/weights.py`` -> ``src/moe_nvfp4_swapab/runner_common.py``,
  ``nvfp4_quantize_per_block_16``);
- the tokens are staged in the kernel's activation format by the same rules (MXFP8:
  byte-identical to DeepGEMM's ``per_token_cast_to_fp8(use_ue8m0=True, gran_k=32)``, as
  ``fp8_fp4_bf16_deepgemm/staging.py`` says; NVFP4 with ``input_norm_const = 1``): this is
  the dispatch wire;
- the SwiGLU output is requantized in the same format before FC2 (NVFP4 with
  ``fc1_norm_const = 1``); the BF16 kernel rounds it to BF16;
- the combine wire is BF16 in all three rows (the benchmark's default
  ``MEGA_COMBINE_DTYPE=bf16``), reduced over the top-k slots in FP32 with one BF16 rounding.

moewire's stand-ins of those steps, the formats' reference definitions: MXFP8 is
``fp8_b32_ue8m0`` (DeepGEMM's cast; FlashInfer's 1e-30 amax floor and rounded ``log2`` vs
moewire's 1e-4 floor and exact exponent differ on no block of these data), NVFP4 with
``norm_const = 1`` is ``nvfp4`` at amax 2688 (global scale ``2688 * fl(1/2688) = 1``
exactly; moewire divides by the decoded block scale where FlashInfer multiplies by
``rcp.approx`` of it: the two can differ only at E2M1 midpoints), BF16 is ``bf16``, and
the two quantized combines FlashInfer's NVFP4 megakernel offers (``combine_dtype``) are
``flashinfer_mxfp8`` and ``flashinfer_nvfp4``.

The split, which FlashInfer's table cannot make (each row is one megakernel):

- ``all``: every step as the kernel does it (FlashInfer's number);
- ``compute``: the weights and the SwiGLU output as the kernel has them, the wire exact
  (the tokens as given, the per-slot rows and their sum in FP32);
- ``wire``: exact weights and an FP32 SwiGLU output, the tokens in the kernel's dispatch
  format, the per-slot rows in its combine format, the sum rounded to BF16.

Memory and time: only the routed experts are generated, one at a time, each from a
generator of its own (the model seed, the expert id): one model for every batch, as
FlashInfer's benchmark has one; the seeds vary the tokens and the routing. Each expert is
drawn and quantized once for all batches, and the per-slot rows (``[T, k, H]`` FP32 per
batch and variant) are the only state kept across experts. ``--shard i/n`` runs the experts
``e % n == i`` only (n processes on a CPU of several cores), ``--merge`` adds the shards'
rows up. Unlike FlashInfer's run the data are drawn by torch's CPU generator, not CUDA's:
the same distributions, not the same numbers; medians over the batches.

    for i in 0 1 2 3 4 5; do
        python benchmarks/flashinfer_4120.py --seeds 3 --shard $i/6 --out DIR &
    done; wait
    python benchmarks/flashinfer_4120.py --merge --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moewire import formats  # noqa: E402

#: FlashInfer's published acc_loss % (flashinfer-ai/flashinfer #4120, 2x B200, TOKENS=8).
PUBLISHED = {"bf16": 0.286, "mxfp8": 6.371, "nvfp4": 23.324}
#: ``bench_common.py``'s divisors of the standard normal draws.
HIDDEN_SCALE, WEIGHT_SCALE = 10.0, 15.0
#: ``--gate-up-clamp`` default of ``bench_moe_ep_mega.py``.
GATE_UP_CLAMP = 10.0
#: The amax at which moewire's ``nvfp4`` has global scale 1 (FlashInfer's norm_const 1).
NVFP4_UNIT_AMAX = 2688.0
VARIANTS = ("all", "compute", "wire")
#: One model for every batch, as FlashInfer's benchmark has one (its weights are seeded by
#: rank alone); the seeds vary the tokens and the routing.
MODEL_SEED = 0


@dataclass(frozen=True)
class Config:
    """One megakernel configuration: the moewire format of each step (``None`` = exact).

    Attributes:
        name: the row name.
        weights: the format of ``w13`` and ``w2`` along K.
        dispatch: the format of the staged tokens along H.
        inter: the format of the SwiGLU output along I (FC2's input).
        combine: the format of each per-(token, slot) row along H.
    """

    name: str
    weights: str | None
    dispatch: str | None
    inter: str | None
    combine: str


CONFIGS = (
    Config("bf16", None, None, "bf16", "bf16"),
    Config("mxfp8", "fp8_b32_ue8m0", "fp8_b32_ue8m0", "fp8_b32_ue8m0", "bf16"),
    Config("nvfp4", "nvfp4", "nvfp4", "nvfp4", "bf16"),
    Config("nvfp4, combine mxfp8", "nvfp4", "nvfp4", "nvfp4", "flashinfer_mxfp8"),
    Config("nvfp4, combine nvfp4", "nvfp4", "nvfp4", "nvfp4", "flashinfer_nvfp4"),
)


def qdq(name: str | None, x: torch.Tensor) -> torch.Tensor:
    """``x`` FP32 ``[..., K]`` through format ``name`` along its last dim, FP32 back;
    ``None`` leaves it exact. ``nvfp4`` runs at global scale 1 (FlashInfer's
    ``norm_const = 1``)."""
    if name is None:
        return x
    fmt = formats.get(name)
    amax = NVFP4_UNIT_AMAX if fmt.needs_amax else None
    return fmt.qdq(x, amax).float()


_RCP_448 = torch.tensor(1 / 448, dtype=torch.float32)
#: E2M1's rounding boundaries; where a tie rounds up, the FP32 value just below the
#: midpoint, so one ``bucketize`` (strictly-below count) gives RNE.
_E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_BOUNDS[[1, 3, 5]] = torch.nextafter(_E2M1_BOUNDS[[1, 3, 5]], torch.tensor(0.0))
_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def fast_qdq(name: str | None, x: torch.Tensor) -> torch.Tensor:
    """:func:`qdq` of the weight formats in fewer passes, for the 44M-element experts on
    CPU: ``fp8_b32_ue8m0`` and ``nvfp4`` at global scale 1 (finite input; an all-zero block
    and ``nvfp4``'s ``bs < 1e-5`` fallback never occur in these data). Equal to the
    formats' references value for value (``tests/benchmarks/test_flashinfer_4120.py``);
    other formats go to :func:`qdq`."""
    if name == "fp8_b32_ue8m0":
        blocks = x.reshape(*x.shape[:-1], -1, 32)
        sf = blocks.abs().amax(-1, keepdim=True).clamp_(min=1e-4).mul_(_RCP_448)
        mant, exp = torch.frexp(sf)
        scale = torch.ldexp(torch.ones_like(sf), exp - (mant == 0.5).int())
        q = (blocks / scale).to(torch.float8_e4m3fn).float().mul_(scale)
        return q.reshape(x.shape)
    if name == "nvfp4":
        blocks = x.reshape(*x.shape[:-1], -1, 16)
        bs = blocks.abs().amax(-1, keepdim=True).div_(6.0).clamp_(max=448.0)
        bs = bs.to(torch.float8_e4m3fn).float()
        idx = torch.bucketize(blocks.abs().div_(bs), _E2M1_BOUNDS, out_int32=True)
        q = _E2M1_GRID[idx].mul_(bs).copysign_(blocks)
        return q.reshape(x.shape)
    return qdq(name, x)


def combine_row(name: str | None, row: torch.Tensor) -> torch.Tensor:
    """A per-slot FP32 row as the combine wire carries it: ``None`` exact; else the BF16
    row the epilogue writes, through format ``name`` (``bf16`` is that rounding alone)."""
    if name is None:
        return row
    return formats.get(name).qdq(row.bfloat16()).float()


def relative_l2(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``100 * sqrt(sum (y - ref)^2 / sum ref^2)``, in float64 (FlashInfer's acc_loss %)."""
    y, ref = y.double(), ref.double()
    return 100.0 * float(((y - ref).square().sum() / ref.square().sum()).sqrt())


def make_batch(seed: int, tokens: int, experts: int, top_k: int, hidden: int):
    """Tokens and routing as ``bench_common.make_problem`` draws them (CPU generator).

    Returns:
        ``x`` BF16 ``[T, H]``, ``topk_weights`` FP32 ``[T, k]`` (raw scores),
        ``topk_ids`` int64 ``[T, k]``.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, generator=g) / HIDDEN_SCALE
    scores = torch.randn(tokens, experts, dtype=torch.float32, generator=g)
    topk_weights, topk_ids = torch.topk(scores, top_k, dim=-1, largest=True, sorted=False)
    return x, topk_weights, topk_ids


def make_expert(seed: int, expert: int, hidden: int, inter: int):
    """One expert's BF16 weights as ``bench_common.make_expert_weights`` draws them, from a
    generator of its own: ``w13`` ``[2I, H]`` (``[gate; up]``), ``w2`` ``[H, I]``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + expert)
    w13 = torch.randn(2 * inter, hidden, dtype=torch.bfloat16, generator=g) / WEIGHT_SCALE
    w2 = torch.randn(hidden, inter, dtype=torch.bfloat16, generator=g) / WEIGHT_SCALE
    return w13, w2


def _expert_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, inter_fmt: str | None,
                 clamp: float) -> torch.Tensor:
    """FC2's FP32 output ``[R, H]`` of tokens ``x`` FP32 ``[R, H]`` through FP32 weights."""
    inter = w2.shape[1]
    g1 = x @ w13.t()
    gate, up = g1[:, :inter].clamp(max=clamp), g1[:, inter:].clamp(-clamp, clamp)
    act = qdq(inter_fmt, F.silu(gate) * up)
    return act @ w2.t()


Rows = dict[tuple[str, str | None], torch.Tensor]


def seed_rows(seeds: list[int], *, tokens: int, experts: int, top_k: int, hidden: int,
              inter: int, configs: tuple[Config, ...] = CONFIGS,
              clamp: float = GATE_UP_CLAMP, model_seed: int | None = None,
              shard: tuple[int, int] = (0, 1)) -> dict[int, Rows]:
    """The per-(token, slot) rows of every seed's batch, FP32 ``[T, k, H]`` per
    ``("ref", None)`` and per ``(config, variant)``, for the routed experts of this shard
    (``expert % n == i`` for ``shard = (i, n)``; rows of other experts stay zero, so the
    shards' rows add up). Each expert is drawn once per model seed (``model_seed``, else the
    batch's own seed) and quantized once per weight format.
    """
    index, count = shard
    batches = {s: make_batch(s, tokens, experts, top_k, hidden) for s in seeds}
    keys = [("ref", None)] + [(c.name, v) for c in configs for v in VARIANTS]
    rows = {s: {key: torch.zeros(tokens, top_k, hidden) for key in keys} for s in seeds}
    staged = {s: {c.dispatch: qdq(c.dispatch, batches[s][0].float()) for c in configs}
              | {None: batches[s][0].float()} for s in seeds}
    routed = sorted(set().union(*(torch.unique(b[2]).tolist() for b in batches.values())))
    for expert in (e for e in routed if e % count == index):
        drawn: dict[int, dict[str | None, tuple[torch.Tensor, torch.Tensor]]] = {}
        for s in seeds:
            topk_w, topk_ids = batches[s][1], batches[s][2]
            tok, slot = (topk_ids == expert).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            weights = drawn.setdefault(s if model_seed is None else model_seed, {})
            if not weights:
                w13, w2 = make_expert(s if model_seed is None else model_seed, expert, hidden,
                                      inter)
                weights[None] = (w13.float(), w2.float())
            for c in configs:
                if c.weights not in weights:
                    weights[c.weights] = tuple(fast_qdq(c.weights, w) for w in weights[None])
            scale = topk_w[tok, slot].unsqueeze(-1)
            memo: dict[tuple[str | None, str | None, str | None], torch.Tensor] = {}

            def fc2(w_fmt, x_fmt, inter_fmt, tok=tok, weights=weights, s=s, memo=memo,
                    scale=scale):
                key = (w_fmt, x_fmt, inter_fmt)
                if key not in memo:
                    memo[key] = _expert_rows(staged[s][x_fmt][tok], *weights[w_fmt], inter_fmt,
                                             clamp)
                return memo[key] * scale

            out = rows[s]
            out["ref", None][tok, slot] = fc2(None, None, None)
            for c in configs:
                out[c.name, "all"][tok, slot] = combine_row(c.combine,
                                                            fc2(c.weights, c.dispatch, c.inter))
                out[c.name, "compute"][tok, slot] = fc2(c.weights, None, c.inter)
                out[c.name, "wire"][tok, slot] = combine_row(c.combine,
                                                             fc2(None, c.dispatch, None))
        del drawn
    return rows


def errors(rows: Rows, configs: tuple[Config, ...] = CONFIGS) -> dict[str, dict[str, float]]:
    """Relative L2 (%) of each configuration and variant against the FP32 dense MoE: the
    slots summed in FP32 in top-k order, then BF16 (``compute``: kept FP32)."""
    ref = rows["ref", None].sum(1)
    result: dict[str, dict[str, float]] = {}
    for c in configs:
        out = {}
        for v in VARIANTS:
            summed = rows[c.name, v].sum(1)
            out[v] = relative_l2(summed if v == "compute" else summed.bfloat16(), ref)
        result[c.name] = out
    return result


def run_seed(seed: int, *, tokens: int, experts: int, top_k: int, hidden: int, inter: int,
             configs: tuple[Config, ...] = CONFIGS, clamp: float = GATE_UP_CLAMP,
             model_seed: int | None = None) -> dict[str, dict[str, float]]:
    """Relative L2 (%) of each configuration and variant against the FP32 dense MoE.

    Returns:
        ``{config name: {"all" | "compute" | "wire": percent}}``.
    """
    rows = seed_rows([seed], tokens=tokens, experts=experts, top_k=top_k, hidden=hidden,
                     inter=inter, configs=configs, clamp=clamp, model_seed=model_seed)
    return errors(rows[seed], configs)


def medians(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """The per-(configuration, variant) median over seeds."""
    return {name: {v: statistics.median(r[name][v] for r in runs) for v in VARIANTS}
            for name in runs[0]}


def table(med: dict[str, dict[str, float]]) -> str:
    """The side-by-side table (Markdown)."""
    lines = ["| configuration | FlashInfer #4120 (B200) | moewire, all | compute only "
             "(weights + SwiGLU out) | wire only (dispatch + combine) |",
             "|---|---|---|---|---|"]
    for name, m in med.items():
        pub = PUBLISHED.get(name)
        lines.append(f"| {name} | {'-' if pub is None else f'{pub:.3f}'} | {m['all']:.3f} | "
                     f"{m['compute']:.3f} | {m['wire']:.3f} |")
    return "\n".join(lines)


def _record(shape: dict, seeds: list[int], runs: list[dict]) -> dict:
    return {"shape": shape, "seeds": seeds, "model_seed": MODEL_SEED, "published": PUBLISHED,
            "configs": [c.__dict__ for c in CONFIGS], "runs": runs, "median": medians(runs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5, help="batches (tokens and routing)")
    p.add_argument("--ranks", type=int, default=2, help="EP ranks (FlashInfer's run: 2)")
    p.add_argument("--tokens-per-rank", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--shard", default="0/1",
                   help="i/n: only experts e with e %% n == i; writes shard-i-of-n.pt to --out "
                        "for --merge (run the n shards as n processes)")
    p.add_argument("--merge", action="store_true",
                   help="add up the shard files in --out and write flashinfer_4120.json")
    p.add_argument("--out", type=Path, default=None, help="directory for flashinfer_4120.json")
    a = p.parse_args(argv)
    shape = dict(tokens=a.ranks * a.tokens_per_rank, experts=a.experts, top_k=a.top_k,
                 hidden=a.hidden, inter=a.intermediate)
    seeds = list(range(a.seeds))
    index, count = (int(v) for v in a.shard.split("/"))
    if a.merge or count > 1:
        if a.out is None:
            p.error("--shard i/n with n > 1 and --merge need --out")
        a.out.mkdir(parents=True, exist_ok=True)
    if a.merge:
        parts = [torch.load(f) for f in sorted(a.out.glob("shard-*-of-*.pt"))]
        wanted = {int(f.split("-")[1]) for f in (str(x.name) for x in a.out.glob("shard-*"))}
        total = parts[0]["count"] if parts else 0
        if not parts or wanted != set(range(total)) or any(
                q["shape"] != parts[0]["shape"] or q["seeds"] != parts[0]["seeds"]
                for q in parts):
            p.error(f"--merge: {a.out} needs the shard files of one run, all n of them")
        shape, seeds = parts[0]["shape"], parts[0]["seeds"]
        rows = {s: {k: sum(q["rows"][s][k] for q in parts) for k in parts[0]["rows"][s]}
                for s in seeds}
    else:
        start = time.perf_counter()
        rows = seed_rows(seeds, **shape, model_seed=MODEL_SEED, shard=(index, count))
        print(f"shard {index}/{count}: {time.perf_counter() - start:.0f} s", flush=True)
        if count > 1:
            torch.save({"shape": shape, "seeds": seeds, "count": count, "rows": rows},
                       a.out / f"shard-{index}-of-{count}.pt")
            return 0
    runs = [errors(rows[s]) for s in seeds]
    for s, r in zip(seeds, runs, strict=True):
        print(f"seed {s}: " + ", ".join(f"{n} {v['all']:.3f}" for n, v in r.items()))
    print(table(medians(runs)))
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        record = _record(shape, seeds, runs)
        (a.out / "flashinfer_4120.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
