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

Memory: only the routed experts are generated, one at a time, each from its own seeded
generator (``seed``, expert id), so 256 full experts never exist at once. The per-slot
rows (``[T, k, H]`` FP32 per variant) are the only state kept across experts. Unlike
FlashInfer's run the data are drawn by torch's CPU generator, not CUDA's: the same
distributions, not the same numbers; medians over several seeds.

    python benchmarks/flashinfer_4120.py --seeds 5 --out benchmarks/results/flashinfer-4120
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
        idx = torch.bucketize(blocks.abs().div_(bs), _E2M1_BOUNDS)
        q = _E2M1_GRID[idx].mul_(bs).mul_(torch.sign(blocks))
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


def run_seed(seed: int, *, tokens: int, experts: int, top_k: int, hidden: int, inter: int,
             configs: tuple[Config, ...] = CONFIGS, clamp: float = GATE_UP_CLAMP,
             ) -> dict[str, dict[str, float]]:
    """Relative L2 (%) of each configuration and variant against the FP32 dense MoE.

    Returns:
        ``{config name: {"all" | "compute" | "wire": percent}}``.
    """
    x_bf16, topk_w, topk_ids = make_batch(seed, tokens, experts, top_k, hidden)
    x = x_bf16.float()
    keys = [("ref", None)] + [(c.name, v) for c in configs for v in VARIANTS]
    rows = {key: torch.zeros(tokens, top_k, hidden) for key in keys}
    staged = {c.name: qdq(c.dispatch, x) for c in configs}
    for expert in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == expert).nonzero(as_tuple=True)
        w13, w2 = (w.float() for w in make_expert(seed, expert, hidden, inter))
        scale = topk_w[tok, slot].unsqueeze(-1)
        rows["ref", None][tok, slot] = _expert_rows(x[tok], w13, w2, None, clamp) * scale
        quantized: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {None: (w13, w2)}
        for c in configs:
            if c.weights not in quantized:
                quantized[c.weights] = (fast_qdq(c.weights, w13), fast_qdq(c.weights, w2))
            q13, q2 = quantized[c.weights]
            full = _expert_rows(staged[c.name][tok], q13, q2, c.inter, clamp) * scale
            rows[c.name, "all"][tok, slot] = combine_row(c.combine, full)
            rows[c.name, "compute"][tok, slot] = _expert_rows(x[tok], q13, q2, c.inter,
                                                              clamp) * scale
            wire = _expert_rows(staged[c.name][tok], w13, w2, None, clamp) * scale
            rows[c.name, "wire"][tok, slot] = combine_row(c.combine, wire)
        del w13, w2, quantized
    ref = rows["ref", None].sum(1)
    result: dict[str, dict[str, float]] = {}
    for c in configs:
        out = {}
        for v in VARIANTS:
            summed = rows[c.name, v].sum(1)  # FP32, slots in top-k order
            out[v] = relative_l2(summed if v == "compute" else summed.bfloat16(), ref)
        result[c.name] = out
    return result


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2, help="EP ranks (FlashInfer's run: 2)")
    p.add_argument("--tokens-per-rank", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--out", type=Path, default=None, help="directory for flashinfer_4120.json")
    a = p.parse_args(argv)
    shape = dict(tokens=a.ranks * a.tokens_per_rank, experts=a.experts, top_k=a.top_k,
                 hidden=a.hidden, inter=a.intermediate)
    runs = []
    for seed in range(a.seeds):
        start = time.perf_counter()
        runs.append(run_seed(seed, **shape))
        print(f"seed {seed}: {time.perf_counter() - start:.0f} s "
              + ", ".join(f"{n} {r['all']:.3f}" for n, r in runs[-1].items()), flush=True)
        if a.out is not None:  # after every seed: a long run leaves what it has
            a.out.mkdir(parents=True, exist_ok=True)
            record = {"shape": shape, "seeds": len(runs), "published": PUBLISHED,
                      "configs": [c.__dict__ for c in CONFIGS], "runs": runs,
                      "median": medians(runs)}
            (a.out / "flashinfer_4120.json").write_text(json.dumps(record, indent=1) + "\n")
    print(table(medians(runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
