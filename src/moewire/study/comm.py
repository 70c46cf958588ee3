"""How long dispatch and combine take on the wire: a communication-time model per format.

For one MoE layer at expert-parallel size ``N``, each rank holds ``T`` tokens (``--ep-tokens``)
and routes each to ``k`` experts. A routed copy whose expert lives on another rank crosses
the interconnect once in the dispatch (the token's row in the dispatch format) and once in
the combine (the expert's output row in the combine format); a copy whose expert is on the
token's own rank stays local. One copy per routed slot, as the Mega-MoE kernels and
DeepEP's low-latency kernels send (DeepEP's normal kernels send one copy per destination
*rank*; the model does not deduplicate). So, for one rank and one direction::

    copies     = T * k * remote_fraction * bottleneck       (the busiest rank's copies)
    time_us    = latency_us + copies * row_bytes / bandwidth(N)

``remote_fraction`` (the share of copies that leave their rank) and ``bottleneck`` (the
busiest rank's copies sent or received over the mean: a dispatch or combine ends when its
slowest rank does) are measured on the study's routing split over ``N`` ranks
(:func:`measure_traffic`); ``row_bytes = wire_bits(H) / 8`` of each format, scales
included. ``bandwidth`` and ``latency_us`` come from a named :class:`Interconnect` whose
every number is derived from a published figure (:data:`FIGURES`); ``tests/study/
test_comm.py`` checks that the model reproduces each figure within its stated margin.

What the model leaves out: overlap with compute (the Mega-MoE kernels and DeepEP's hooks
hide part of the transfer behind the expert GEMMs, so the time a format saves on the wire
is an upper bound of what it saves end to end), congestion and adaptive routing in the
fabric, the imbalance of real routing beyond what the study's router produces, the cost
of casting to and from the format (measured separately on CUDA, ``fake_quant_us``), the
per-token metadata (top-k ids and weights, DeepEP's 16 bytes), DeepEP's per-rank
deduplication, and NVLink-vs-RDMA mixes inside one EP group other than those the figures
themselves contain.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

# No torch at import: the CLI lists the profiles (--help, flag checks) before torch loads.
if TYPE_CHECKING:
    import torch

#: The two collectives a MoE layer runs.
OPS = ("dispatch", "combine")

_LEGACY = "deepseek-ai/DeepEP docs/legacy.md (V1), section Performance"
_V2 = "deepseek-ai/DeepEP README.md (V2), section Performance"


@dataclass(frozen=True)
class Figure:
    """One published DeepEP measurement, in DeepEP's own byte accounting.

    DeepEP's tests (``tests/test_low_latency.py``) count, per rank, every routed copy
    (local ones included) at ``H + H / 128 * 4 + 16`` bytes for an FP8 row (per-128 FP32
    scales and 16 bytes of metadata) and ``2 H`` for a BF16 row, and report
    ``bytes / time`` as the (logical) bandwidth.

    Attributes:
        source: the file and section it is published in.
        table: the table's row, as published.
        profile: the :data:`INTERCONNECTS` entry it sets or checks.
        op: ``"dispatch"`` (FP8) or ``"combine"`` (BF16).
        ep_size: ranks in the EP group.
        tokens_per_rank, hidden, top_k: the benchmark's shape.
        gbps: the published logical bandwidth, GB/s.
        latency_us: the published time, when the table gives one.
    """

    source: str
    table: str
    profile: str
    op: str
    ep_size: int
    tokens_per_rank: int
    hidden: int
    top_k: int
    gbps: float
    latency_us: float | None = None

    @property
    def row_bytes(self) -> float:
        """DeepEP's bytes per copy (FP8 dispatch, BF16 combine)."""
        h = self.hidden
        return h + h / 128 * 4 + 16 if self.op == "dispatch" else 2.0 * h

    @property
    def logical_bytes(self) -> float:
        """Bytes DeepEP divides by the time: every routed copy of the rank's tokens."""
        return self.tokens_per_rank * self.top_k * self.row_bytes


def _ll(ep: int, d_us: float, d_gbps: float, c_us: float, c_gbps: float) -> tuple[Figure, ...]:
    table = "Low-latency kernels with pure RDMA (H800, CX7 400 Gb/s)"
    profile = "nvlink-h800" if ep == 8 else "rdma-cx7"
    return (Figure(_LEGACY, table, profile, "dispatch", ep, 128, 7168, 8, d_gbps, d_us),
            Figure(_LEGACY, table, profile, "combine", ep, 128, 7168, 8, c_gbps, c_us))


#: Every figure the profiles are built from, as published (written once, here).
FIGURES: tuple[Figure, ...] = (
    # H800 normal kernels, 4096 tokens, 7168 hidden, top-8, FP8 dispatch, BF16 combine.
    Figure(_LEGACY, "Normal kernels with NVLink and RDMA forwarding: Intranode",
           "nvlink-h800", "dispatch", 8, 4096, 7168, 8, 153.0),
    Figure(_LEGACY, "Normal kernels with NVLink and RDMA forwarding: Intranode",
           "nvlink-h800", "combine", 8, 4096, 7168, 8, 158.0),
    # H800 low-latency kernels, 128 tokens, 7168 hidden, top-8. EP 8 is one 8-GPU node:
    # its 98 / 127 GB/s are more than one 400 Gb/s NIC per GPU carries, so it moves over
    # NVLink and sets the NVLink profiles' latency.
    *_ll(8, 77, 98, 114, 127),
    *_ll(16, 118, 63, 195, 74),
    *_ll(32, 155, 48, 273, 53),
    *_ll(64, 173, 43, 314, 46),
    *_ll(128, 192, 39, 369, 39),
    *_ll(256, 194, 39, 360, 40),
    # B200 (SM100) V2 kernels, one node, 8192 tokens, 64 SMs ("Max perf").
    Figure(_V2, "SM100, EP 8, NVLink, 64 SMs", "nvlink-b200", "dispatch", 8, 8192, 7168, 8,
           726.0),
    Figure(_V2, "SM100, EP 8, NVLink, 64 SMs", "nvlink-b200", "combine", 8, 8192, 7168, 8,
           740.0),
)

#: How closely the model must reproduce each figure (relative), and why this much: the
#: published latencies and bandwidths are rounded to 2-3 digits and disagree with each
#: other by up to 2.5% (DeepEP averages them separately); one latency per profile and, for
#: RDMA, one bandwidth per EP size for both directions leave residuals of up to 4%.
MARGIN = 0.06


@dataclass(frozen=True)
class Interconnect:
    """A named interconnect: per-GPU bandwidth for remote copies and a fixed latency.

    Attributes:
        name: ``--interconnect`` name.
        description: one line.
        latency_us: the fixed cost of one dispatch or one combine (launch, signalling,
            the slowest first byte), microseconds.
        dispatch_gbps, combine_gbps: ``{EP size: GB/s}`` of remote payload one GPU moves
            in one direction (10^9 bytes per second). Between listed EP sizes the bandwidth
            is interpolated in ``log2(N)``; outside, the nearest listed one is used.
        max_ep_size: the largest EP group the interconnect spans (an NVLink domain is one
            8-GPU node here), or ``None``.
        source: how the numbers follow from :data:`FIGURES` (or the command line).
    """

    name: str
    description: str
    latency_us: float
    dispatch_gbps: dict[int, float]
    combine_gbps: dict[int, float]
    max_ep_size: int | None
    source: str

    def bandwidth_gbps(self, op: str, ep_size: int) -> float:
        """GB/s of remote payload per GPU for ``op`` at EP size ``ep_size``."""
        table = self.dispatch_gbps if op == "dispatch" else self.combine_gbps
        sizes = sorted(table)
        if ep_size <= sizes[0]:
            return table[sizes[0]]
        if ep_size >= sizes[-1]:
            return table[sizes[-1]]
        hi = next(s for s in sizes if s >= ep_size)
        lo = max(s for s in sizes if s <= ep_size)
        if hi == lo:
            return table[lo]
        t = (math.log2(ep_size) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return table[lo] + t * (table[hi] - table[lo])

    def as_dict(self) -> dict:
        d = asdict(self)
        for key in ("dispatch_gbps", "combine_gbps"):
            d[key] = {str(k): v for k, v in d[key].items()}
        return d


def _remote(gbps: float, ep: int) -> float:
    """DeepEP's logical bandwidth counts the ``1/N`` of copies that stay on their rank
    (uniform routing); the link carries the other ``(N-1)/N``."""
    return gbps * (ep - 1) / ep


#: One latency for every NVLink profile: the low-latency EP 8 row of FIGURES with the
#: H800's normal-kernel bandwidth (77 us dispatch and 114 us combine leave 27 and 21 us
#: beside the bytes; 24 us splits them). No figure gives the B200's or H200's own.
_NVLINK_LATENCY_US = 24.0
#: NVLink bandwidth per direction from the data sheets: H100/H200 SXM 900 GB/s (18 NVLink 4
#: links), H800 SXM 400 GB/s (8 links). No DeepEP figure exists for H100/H200 NVLink; the
#: H800's measured rates are scaled by this ratio.
_H200_OVER_H800 = 900.0 / 400.0
#: The low-latency RDMA rows (EP 16-256) fitted with one latency for every EP size and one
#: bandwidth per EP size for both directions, least squares on the relative error of the
#: ten latencies (largest residual 2.8%). At EP 16 half of a rank's peers sit in its own node
#: (NVLink), hence more than the NIC's 50 GB/s.
_RDMA_LATENCY_US = 25.0
_RDMA_GBPS = {16: 79.0, 32: 57.0, 64: 50.2, 128: 43.7, 256: 44.2}


def _figure(profile: str, op: str, ep: int, tokens: int) -> Figure:
    return next(f for f in FIGURES if (f.profile, f.op, f.ep_size, f.tokens_per_rank)
                == (profile, op, ep, tokens))


def _h800(op: str) -> float:
    return _remote(_figure("nvlink-h800", op, 8, 4096).gbps, 8)


def _b200(op: str) -> float:
    return _remote(_figure("nvlink-b200", op, 8, 8192).gbps, 8)


INTERCONNECTS: dict[str, Interconnect] = {
    p.name: p
    for p in (
        Interconnect(
            "nvlink-h200", "NVLink 4 inside one 8-GPU H100/H200 node (450 GB/s per direction)",
            _NVLINK_LATENCY_US,
            {8: _h800("dispatch") * _H200_OVER_H800}, {8: _h800("combine") * _H200_OVER_H800},
            8,
            "derived, not measured: DeepEP's H800 NVLink rates (legacy.md, intranode EP 8: 153 "
            "/ 158 GB/s) x 900/400 (the H200 / H800 NVLink data-sheet ratio); latency from the "
            "H800 low-latency EP 8 row",
        ),
        Interconnect(
            "nvlink-h800", "NVLink inside one 8-GPU H800 node (DeepEP's test machine)",
            _NVLINK_LATENCY_US, {8: _h800("dispatch")}, {8: _h800("combine")}, 8,
            "DeepEP legacy.md: intranode EP 8 normal kernels 153 / 158 GB/s (bandwidth), "
            "low-latency EP 8 77 / 114 us (latency)",
        ),
        Interconnect(
            "nvlink-b200", "NVLink 5 inside one 8-GPU B200 node (900 GB/s per direction)",
            _NVLINK_LATENCY_US, {8: _b200("dispatch")}, {8: _b200("combine")}, 8,
            "DeepEP README (V2): SM100 EP 8 NVLink 726 / 740 GB/s (bandwidth); latency "
            "borrowed from the H800 low-latency EP 8 row (none published for B200)",
        ),
        Interconnect(
            "rdma-cx7", "InfiniBand scale-out, one CX7 400 Gb/s NIC per H800 (8 GPUs a node)",
            _RDMA_LATENCY_US, dict(_RDMA_GBPS), dict(_RDMA_GBPS), None,
            "DeepEP legacy.md: low-latency kernels EP 16-256 (latency and bandwidth), fitted",
        ),
    )
}
DEFAULT_INTERCONNECT = "nvlink-h200"
DEFAULT_EP_SIZE = 8


def custom_interconnect(base: Interconnect, link_gbps: float | None,
                        latency_us: float | None) -> Interconnect:
    """``base`` with ``--link-gbps`` (every EP size, both directions) and/or
    ``--link-latency-us`` replaced; unchanged when both are ``None``."""
    if link_gbps is None and latency_us is None:
        return base
    parts = []
    if link_gbps is not None:
        parts.append(f"--link-gbps {link_gbps:g}")
    if latency_us is not None:
        parts.append(f"--link-latency-us {latency_us:g}")
    return Interconnect(
        f"{base.name}+custom", base.description + " (overridden)",
        base.latency_us if latency_us is None else float(latency_us),
        base.dispatch_gbps if link_gbps is None else {1: float(link_gbps)},
        base.combine_gbps if link_gbps is None else {1: float(link_gbps)},
        base.max_ep_size, f"command line ({', '.join(parts)}); the rest: {base.source}",
    )


@dataclass(frozen=True)
class Traffic:
    """Where the routed copies of one rank go, at EP size ``ep_size``.

    Attributes:
        ep_size: ranks in the EP group.
        tokens_per_rank: tokens each rank dispatches per step.
        top_k: copies per token.
        remote_fraction: share of copies whose expert is on another rank.
        bottleneck: the busiest rank's remote copies (sent or received, whichever is more)
            over the mean rank's sent ones; 1 for perfectly even routing.
    """

    ep_size: int
    tokens_per_rank: int
    top_k: int
    remote_fraction: float
    bottleneck: float

    @property
    def copies(self) -> float:
        """Remote copies the busiest rank moves in one direction."""
        return self.tokens_per_rank * self.top_k * self.remote_fraction * self.bottleneck

    def as_dict(self) -> dict:
        return {**asdict(self), "bottleneck_copies": self.copies}


def uniform_traffic(ep_size: int, tokens_per_rank: int, top_k: int) -> Traffic:
    """Evenly spread routing (as DeepEP's benchmarks draw it): ``(N-1)/N`` of the copies
    leave their rank and every rank moves the same."""
    return Traffic(ep_size, tokens_per_rank, top_k, (ep_size - 1) / ep_size, 1.0)


def measure_traffic(topk_ids: list[torch.Tensor], num_experts: int, ep_size: int,
                    tokens_per_rank: int) -> Traffic:
    """The study's routing split over ``ep_size`` ranks.

    Each batch's tokens are split into ``ep_size`` equal blocks (token ``t`` on rank
    ``t // (T / N)``) and experts as DeepGEMM splits them (expert ``e`` on rank
    ``e // (E / N)``); copies are counted over all batches together.

    Args:
        topk_ids: int64 ``[T, k]`` per batch (ids ``< 0`` are padding, not counted); ``T``
            divisible by ``ep_size``.
        num_experts: ``E``, divisible by ``ep_size``.
        ep_size: ``N``.
        tokens_per_rank: the tokens per rank the estimate is for (the returned
            ``Traffic.tokens_per_rank``; the ratios do not depend on it).

    Returns:
        :class:`Traffic` with the measured ``remote_fraction`` and ``bottleneck``.

    Raises:
        ValueError: ``ep_size`` does not divide ``num_experts`` or a batch's token count.
    """
    import torch

    if num_experts % ep_size:
        raise ValueError(
            f"measure_traffic: {num_experts} experts do not split over {ep_size} ranks "
            "(DeepGEMM and DeepEP place num_experts / num_ranks experts on each rank); use an "
            "EP size that divides the expert count"
        )
    for ids in topk_ids:
        if ids.shape[0] % ep_size:
            raise ValueError(
                f"measure_traffic: a batch of {ids.shape[0]} tokens does not split over "
                f"{ep_size} ranks in equal blocks; use batches of a multiple of {ep_size} "
                "tokens"
            )
    top_k = int(topk_ids[0].shape[1])
    if ep_size == 1:
        return Traffic(1, tokens_per_rank, top_k, 0.0, 1.0)
    sent = torch.zeros(ep_size, dtype=torch.int64)
    received = torch.zeros(ep_size, dtype=torch.int64)
    total = 0
    for ids in topk_ids:
        ids = ids.cpu()
        valid = ids >= 0
        token_rank = (torch.arange(ids.shape[0]) // (ids.shape[0] // ep_size)).unsqueeze(1)
        expert_rank = ids.clamp(min=0) // (num_experts // ep_size)
        remote = (expert_rank != token_rank) & valid
        sent += torch.bincount(token_rank.expand_as(ids)[remote], minlength=ep_size)
        received += torch.bincount(expert_rank[remote], minlength=ep_size)
        total += int(valid.sum())
    remote_copies = int(sent.sum())
    if remote_copies == 0:
        return Traffic(ep_size, tokens_per_rank, top_k, 0.0, 1.0)
    mean = remote_copies / ep_size
    busiest = int(torch.maximum(sent, received).max())
    return Traffic(ep_size, tokens_per_rank, top_k, remote_copies / total, busiest / mean)


def transfer_us(link: Interconnect, op: str, traffic: Traffic, row_bytes: float) -> float:
    """Estimated microseconds of one ``op`` moving ``row_bytes`` per copy; 0 when no copy
    leaves its rank (one rank: no collective at all)."""
    copies = traffic.copies
    if copies == 0:
        return 0.0
    gbps = link.bandwidth_gbps(op, traffic.ep_size)
    return link.latency_us + copies * row_bytes / (gbps * 1e3)


@dataclass(frozen=True)
class CommTime:
    """Estimated time of one layer's dispatch and combine for one format pair (us)."""

    dispatch_us: float
    combine_us: float
    comm_us: float
    bf16_comm_us: float
    saved_us: float
    time_ratio_to_bf16: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def comm_time(link: Interconnect, traffic: Traffic, dispatch: str, combine: str,
              hidden: int) -> CommTime:
    """Dispatch and combine time of a format pair and what it saves against BF16 both ways.

    ``time_ratio_to_bf16`` is 1 with one rank (nothing crosses the interconnect).
    """
    from moewire.study.wire import format_bits

    d = transfer_us(link, "dispatch", traffic, format_bits(dispatch, hidden) / 8)
    c = transfer_us(link, "combine", traffic, format_bits(combine, hidden) / 8)
    bf16 = (transfer_us(link, "dispatch", traffic, 2.0 * hidden)
            + transfer_us(link, "combine", traffic, 2.0 * hidden))
    return CommTime(d, c, d + c, bf16, bf16 - (d + c), (d + c) / bf16 if bf16 else 1.0)


def predict(figure: Figure) -> tuple[float, float]:
    """The model's ``(time us, logical GB/s)`` at a figure's benchmark: uniform routing,
    DeepEP's row bytes, the figure's profile."""
    link = INTERCONNECTS[figure.profile]
    traffic = uniform_traffic(figure.ep_size, figure.tokens_per_rank, figure.top_k)
    t = transfer_us(link, figure.op, traffic, figure.row_bytes)
    return t, figure.logical_bytes / (t * 1e3)
