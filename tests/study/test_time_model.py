"""The time model's traffic split and its EP size: hand-computed routings, an exact oracle,
and the refusals where experts or tokens do not split over the ranks.

``measure_traffic`` puts token ``t`` of a batch of ``B`` tokens on rank ``t // (B / N)``
(contiguous blocks) and expert ``e`` on rank ``e // (E / N)`` (DeepGEMM's and DeepEP's
placement); the busiest rank is the one that sends *or receives* the most remote copies.
Each hand case below is chosen so that one plausible slip (round-robin tokens or experts,
counting only what a rank sends, every token on one rank) gives another answer.
"""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
import torch

from moewire import cli
from moewire.study import StudyConfig, comm, run_study
from moewire.study.comm import INTERCONNECTS, measure_traffic, transfer_us
from moewire.study.errors import StudyArgumentError
from moewire.study.settings import ep_size

TINY = ["study", "--model", "tiny", "--tokens", "16", "--calib-batches", "1",
        "--eval-batches", "1", "--dispatch", "fp8", "--combine", "fp8"]


def _oracle(batches: list[list[list[int]]], num_experts: int, ranks: int):
    """(remote fraction, bottleneck) as exact fractions, by walking every copy."""
    sent, received, total = [0] * ranks, [0] * ranks, 0
    for ids in batches:
        block = len(ids) // ranks
        for t, row in enumerate(ids):
            for e in row:
                if e < 0:
                    continue
                total += 1
                src, dst = t // block, e // (num_experts // ranks)
                if src != dst:
                    sent[src] += 1
                    received[dst] += 1
    remote = sum(sent)
    if remote == 0:
        return Fraction(0), Fraction(1)
    return Fraction(remote, total), Fraction(max(sent + received) * ranks, remote)


@pytest.mark.parametrize(
    "ids, experts, ranks, remote, bottleneck",
    [
        # 4 ranks of one token; every token goes to expert 3 (rank 3). Ranks 0-2 send one
        # copy each, rank 3 keeps its own and receives three: 3 remote copies of 4, mean
        # 3/4 a rank, busiest 3 (received) -> 4. Counting sent copies only gives 4/3.
        ([[3], [3], [3], [3]], 4, 4, Fraction(3, 4), Fraction(4)),
        # 2 ranks of two tokens (tokens 0-1 on rank 0), one expert a rank. Contiguous:
        # tokens 0, 1 and 2 cross, sent [2, 1], received [1, 2]: 3/4 remote, busiest 2 of
        # mean 3/2 -> 4/3. Round-robin tokens (0, 2 on rank 0) give 1/4 and 2; every token
        # on rank 0 (the batch as one rank's block) gives 3/4 and 2.
        ([[1], [1], [0], [1]], 2, 2, Fraction(3, 4), Fraction(4, 3)),
        # 2 ranks, 4 experts (0-1 on rank 0), top-2. Contiguous experts: only token 0's
        # expert 2 crosses: 1/4 remote, sent [1, 0], received [0, 1] -> 2. Round-robin
        # experts (0, 2 on rank 0) give 1/2 and 1.
        ([[1, 2], [2, 3]], 4, 2, Fraction(1, 4), Fraction(2)),
        # 3 ranks (an EP size that is no power of two), 6 experts, 6 tokens; padding slots.
        # Token ranks 0,0,1,1,2,2; expert ranks e // 2. Remote: t0 e5 (0->2), t1 e2 (0->1),
        # t2 e0 (1->0), t4 e1 (2->0), t5 e3 (2->1): 5 of 10 valid; sent [2, 1, 2], received
        # [2, 2, 1] -> busiest 2 of mean 5/3 -> 6/5.
        ([[5, 0], [2, -1], [0, 3], [3, -1], [1, 4], [3, 5]], 6, 3, Fraction(1, 2),
         Fraction(6, 5)),
    ],
    ids=["rank-that-only-receives", "contiguous-tokens", "contiguous-experts", "ep3-padding"],
)
def test_hand_computed_routings(ids, experts, ranks, remote, bottleneck):
    assert _oracle([ids], experts, ranks) == (remote, bottleneck)  # the oracle agrees
    t = measure_traffic([torch.tensor(ids)], experts, ranks, 64)
    assert t.remote_fraction == pytest.approx(float(remote), rel=1e-12)
    assert t.bottleneck == pytest.approx(float(bottleneck), rel=1e-12)
    k = len(ids[0])
    assert t.copies == pytest.approx(64 * k * float(remote * bottleneck), rel=1e-12)


@pytest.mark.parametrize(
    "experts, ranks, tokens, batches",
    [(6, 3, 6, 2), (12, 4, 8, 3), (12, 6, 12, 2), (10, 5, 15, 2), (16, 8, 24, 1)],
    ids=["E6-N3", "E12-N4", "E12-N6", "E10-N5", "E16-N8"],
)
def test_random_uneven_routings_match_the_exact_oracle(experts, ranks, tokens, batches):
    g = torch.Generator().manual_seed(experts * 100 + ranks)
    ids = [torch.randint(0, experts, (tokens, 3), generator=g) for _ in range(batches)]
    ids[0][1, 2] = -1  # a padding slot
    want = _oracle([i.tolist() for i in ids], experts, ranks)
    t = measure_traffic(ids, experts, ranks, tokens // ranks)
    assert (t.remote_fraction, t.bottleneck) == pytest.approx(tuple(map(float, want)))


def test_the_time_is_the_busiest_ranks_bytes_over_the_link():
    """rank-that-only-receives at 64 tokens a rank, FP8 rows of 512 bytes, 100 GB/s, 5 us:
    64 x 1 x 3/4 x 4 = 192 copies -> 5 + 192 x 512 / 1e5 us."""
    link = comm.custom_interconnect(INTERCONNECTS["rdma-cx7"], 100.0, 5.0)
    t = measure_traffic([torch.tensor([[3], [3], [3], [3]])], 4, 4, 64)
    assert transfer_us(link, "dispatch", t, 512.0) == pytest.approx(5 + 192 * 512 / 1e5)


@pytest.mark.parametrize(
    "experts, ranks, tokens, match",
    [(6, 4, 8, "6 experts do not split over 4 ranks"),
     (8, 4, 6, "a batch of 6 tokens does not split over 4 ranks")],
    ids=["experts", "tokens"],
)
def test_measure_traffic_refuses_uneven_splits(experts, ranks, tokens, match):
    with pytest.raises(ValueError, match=f"^measure_traffic: {match}"):
        measure_traffic([torch.zeros(tokens, 2, dtype=torch.int64)], experts, ranks, 8)


# -- the EP size: the default (8) fits, or the study refuses with the sizes that would -----


@pytest.mark.parametrize(
    "changes, experts, message",
    [
        ({"tokens": 16}, 17, "the time estimate's default EP size 8 does not split 17 experts "
         "(experts and tokens sit on ranks in equal blocks); no EP size above 1 splits both; "
         "use --experts 16 or 24"),
        ({"tokens": 12}, 16, "does not split --tokens 12 (experts and tokens sit on ranks in "
         "equal blocks); pass --ep-size 2 or 4 (the nearest sizes that split both), or use "
         "--tokens 16"),
        ({"tokens": 16}, 12, "does not split 12 experts (experts and tokens sit on ranks in "
         "equal blocks); pass --ep-size 2 or 4 (the nearest sizes that split both), or use "
         "--experts 8 or 16"),
        ({"tokens": 40, "interconnect": "rdma-cx7"}, 20, "pass --ep-size 5 or 10 (the "
         "nearest sizes that split both), or use --experts 16 or 24"),
        ({"tokens": 12}, 6, "does not split 6 experts and --tokens 12 (experts and tokens sit "
         "on ranks in equal blocks); pass --ep-size 3 or 6 (the nearest sizes that split "
         "both), or use --experts 8 with --tokens 16"),
    ],
    ids=["experts-17", "tokens-12", "experts-12", "experts-20-rdma", "both"],
)
def test_a_default_ep_size_that_does_not_fit_is_refused(changes, experts, message):
    cfg = StudyConfig(model="tiny", **changes)
    with pytest.raises(StudyArgumentError, match=re.escape(message)):
        ep_size(cfg, experts)


def test_an_explicit_ep_size_is_kept_and_checked_against_the_layer():
    assert ep_size(StudyConfig(model="tiny", tokens=12, ep_size=4), 12) == 4
    with pytest.raises(StudyArgumentError, match="^--ep-size: 12 experts do not split over 8"):
        ep_size(StudyConfig(model="tiny", tokens=16, ep_size=8), 12)


def test_experts_17_is_refused_before_the_layer_is_built(tmp_path, capsys):
    """It used to run with the time estimate at EP 1 (no traffic), saying nothing."""
    code = cli.main([*TINY, "--experts", "17", "--out", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--ep-size: the time estimate's default EP size 8 does not split 17 experts" in err
    assert not (tmp_path / "o" / "results.json").exists()


def test_the_estimate_uses_the_tokens_of_one_rank_of_the_study(tmp_path):
    """--ranks 4 of --tokens 16: the estimate is for 4 tokens a rank, not the batch's 16,
    measured at the default EP size 8."""
    doc = run_study(StudyConfig(model="tiny", tokens=16, ranks=4, calib_batches=1,
                                eval_batches=1, dispatch=("bf16",), combine=("bf16",)))
    ep = doc["routing"]["ep"]
    assert ep["ep_size"] == 8 and ep["tokens_per_rank"] == 4
    assert doc["routing"]["tokens_per_rank"] == 4
    assert ep["bottleneck_copies"] == pytest.approx(
        4 * 4 * ep["remote_fraction"] * ep["bottleneck"])
