"""The study's verdict: the Pareto front under the noise tolerance, the cheapest pair within
a budget, the labelled frontier plot, and ``--from`` re-timing a finished sweep."""

import json
import math
from pathlib import Path

import pytest

from internal_refs import INTERNAL_REFERENCE
from moewire import cli
from moewire.study import report
from moewire.study.verdict import (
    COST_RTOL,
    ERROR_RTOL,
    Budget,
    cheapest,
    dominates,
    front_marks,
    pareto,
)

TINY = ["study", "--model", "tiny", "--tokens", "16", "--calib-batches", "1",
        "--eval-batches", "1", "--dispatch", "fp8,mxfp8", "--combine", "nvfp4,mxfp8"]


@pytest.mark.parametrize(
    "points, want",
    [
        # 0.7% cheaper is a tie on cost: the more accurate pair alone is the front.
        ([(100.0, 0.05, "cheap"), (100.7, 0.03, "accurate")], ["accurate"]),
        # 2% cheaper is not a tie: both are on the front.
        ([(100.0, 0.05, "cheap"), (102.0, 0.03, "accurate")], ["cheap", "accurate"]),
        # 1% less error is a tie on error: the cheaper pair alone.
        ([(100.0, 0.0500, "cheap"), (110.0, 0.0495, "accurate")], ["cheap"]),
        # 4% less error is not a tie.
        ([(100.0, 0.0500, "cheap"), (110.0, 0.0480, "accurate")], ["cheap", "accurate"]),
        # Tied on both: neither dominates, both stay.
        ([(100.0, 0.05, "a"), (100.5, 0.0505, "b")], ["a", "b"]),
        # The exact pair (zero error) is on the front at its cost.
        ([(118.7, 0.0, "bf16/bf16"), (101.3, 0.0175, "bf16/fp8")], ["bf16/fp8", "bf16/bf16"]),
    ],
    ids=["cost-tie", "cost-apart", "error-tie", "error-apart", "tie-both", "exact"],
)
def test_ties_within_the_noise_are_not_a_front(points, want):
    assert [tag for _, _, tag in pareto(points)] == want


def test_the_tolerances_are_the_documented_ones():
    assert (COST_RTOL, ERROR_RTOL) == (0.01, 0.02)
    edge = 100.0 * (1 + COST_RTOL)
    assert dominates((100.0, 0.03), (edge * 0.999, 0.05))  # inside the tolerance: a tie
    assert not dominates((edge * 1.001, 0.03), (100.0, 0.05))  # outside: a real cost


def _result(d, c, rel_l2, us, nbytes):
    return {"dispatch": d, "combine": c, "rel_l2": rel_l2,
            "sqnr_db": math.inf if rel_l2 == 0 else -20 * math.log10(rel_l2),
            "comm_us": us, "time_ratio_to_bf16": us / 120.0,
            "bytes_per_token": nbytes, "ratio_to_bf16": nbytes / 98304}


DOC = {"results": [
    _result("bf16", "bf16", 0.0, 120.0, 98304),
    _result("bf16", "fp8", 0.0175, 101.3, 73728),
    _result("fp8", "fp8", 0.0499, 83.3, 49152),
    _result("mxfp8", "fp8", 0.0333, 83.9, 49920),
    _result("nvfp4", "nvfp4", 0.117, 67.9, 27648),
]}


@pytest.mark.parametrize(
    "budget, key, want",
    [
        (Budget("rel_l2", 0.05), "comm_us", ("mxfp8", "fp8")),  # 83.3 vs 83.9 us: a tie
        (Budget("rel_l2", 0.05), "bytes_per_token", ("fp8", "fp8")),
        (Budget("rel_l2", 0.02), "comm_us", ("bf16", "fp8")),
        (Budget("rel_l2", 0.2), "comm_us", ("nvfp4", "nvfp4")),
        (Budget("rel_l2", 0.01), "comm_us", ("bf16", "bf16")),
        (Budget("sqnr_db", 29.0), "bytes_per_token", ("mxfp8", "fp8")),
    ],
    ids=["time-tie-to-accurate", "bytes", "tight", "loose", "only-bf16", "sqnr"],
)
def test_the_cheapest_pair_within_the_budget(budget, key, want):
    best = cheapest(DOC, budget, key)
    assert (best["dispatch"], best["combine"]) == want


def test_the_table_marks_the_fronts():
    marks = dict(zip([(r["dispatch"], r["combine"]) for r in DOC["results"]],
                     front_marks(DOC), strict=True))
    assert marks == {("bf16", "bf16"): "time+bytes", ("bf16", "fp8"): "time+bytes",
                     ("fp8", "fp8"): "bytes", ("mxfp8", "fp8"): "time+bytes",
                     ("nvfp4", "nvfp4"): "time+bytes"}


# 1.0 against 1.01005 with the 1% cost tolerance: they differ by 0.995% of the larger value
# (a tie) and by 1.005% of the smaller (not a tie); 1.0202 is the same edge for the 2% error
# tolerance; 1.0102 lies beyond the cost tolerance whichever value it is taken from.
COST_EDGE, ERROR_EDGE, COST_APART = 1.01005, 1.0202, 1.0102


@pytest.mark.parametrize(
    "points, want",
    [
        # A tie on cost: the more accurate pair alone (with the tolerance taken from the
        # smaller cost, the cheaper pair would stay too).
        ([(100.0, 0.05, "cheap"), (100.0 * COST_EDGE, 0.03, "accurate")], ["accurate"]),
        # A tie on cost and equal errors: neither is better, both stay (with the tolerance
        # taken from the first value of each comparison, the cheaper pair would win).
        ([(100.0, 0.03, "a"), (100.0 * COST_EDGE, 0.03, "b")], ["a", "b"]),
        # Beyond the tolerance: a real cost, both on the front.
        ([(100.0, 0.05, "cheap"), (100.0 * COST_APART, 0.03, "accurate")],
         ["cheap", "accurate"]),
        # A tie on error: the cheaper pair alone.
        ([(100.0, 0.03 * ERROR_EDGE, "cheap"), (110.0, 0.03, "accurate")], ["cheap"]),
    ],
    ids=["cost-edge", "cost-edge-equal-error", "cost-apart", "error-edge"],
)
def test_the_tolerance_is_relative_to_the_larger_value(points, want):
    """|a - b| <= rtol * max(|a|, |b|): at the edge the larger value decides, in either
    order of the points."""
    assert [tag for _, _, tag in pareto(points)] == want
    assert [tag for _, _, tag in pareto(points[::-1])] == want


def test_the_cheapest_pair_takes_the_cost_tie_from_the_larger_cost():
    """101.005 us ties 100 us (0.995% of 101.005): the more accurate pair is the cheapest."""
    doc = {"results": [_result("fp8", "fp8", 0.04, 100.0, 49152),
                       _result("mxfp8", "fp8", 0.03, 100.0 * COST_EDGE, 49920)]}
    best = cheapest(doc, Budget("rel_l2", 0.05), "comm_us")
    assert (best["dispatch"], best["combine"]) == ("mxfp8", "fp8")


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("verdict") / "sweep"
    assert cli.main([*TINY, "--out", str(out)]) == 0
    return out


def test_budget_prints_the_verdict_under_the_table(tiny_sweep, tmp_path, capsys):
    capsys.readouterr()
    out = tmp_path / "judged"
    # 4096 tokens per rank: the bytes, not the fixed latency, decide the time.
    assert cli.main(["study", "--from", str(tiny_sweep / "results.json"), "--out", str(out),
                     "--budget", "0.5", "--ep-tokens", "4096"]) == 0
    text = capsys.readouterr().out
    table, _, tail = text.partition("front: T = on the Pareto front")
    assert " front " in table.splitlines()[1]
    assert "verdict for rel L2 <= 0.5:" in tail
    doc = json.loads((out / "results.json").read_text())
    for key, name in (("comm_us", "estimated time"), ("bytes_per_token", "bytes")):
        best = doc["verdict"][key]
        want = cheapest(doc, Budget("rel_l2", 0.5), key)
        assert (best["dispatch"], best["combine"]) == (want["dispatch"], want["combine"])
        assert (best["dispatch"], best["combine"]) != ("bf16", "bf16")
        assert (f"cheapest by {name}: dispatch {best['dispatch']} x combine "
                f"{best['combine']}:") in tail
    assert INTERNAL_REFERENCE.search(text) is None


def test_the_verdict_can_name_a_shipped_combine(tmp_path, capsys):
    """FlashInfer's and MoRI's combines run in the sweep like any format, with their bytes
    (``flashinfer_nvfp4``: 4 bits an element and a BF16 amax per 16; MoRI's blockwise FP8:
    8 bits and an FP32 scale per 128), and the verdict names one when it is the cheapest."""
    capsys.readouterr()
    argv = ["study", "--model", "tiny", "--tokens", "16", "--calib-batches", "1",
            "--eval-batches", "1", "--dispatch", "bf16",
            "--combine", "mori_fp8_blockwise_fnuz,flashinfer_nvfp4", "--budget", "0.5",
            "--out", str(tmp_path / "shipped")]
    assert cli.main(argv) == 0
    doc = json.loads((tmp_path / "shipped" / "results.json").read_text())
    by_pair = {(r["dispatch"], r["combine"]): r for r in doc["results"]}
    hidden, k = doc["layer"]["hidden"], doc["layer"]["top_k"]
    assert by_pair["bf16", "flashinfer_nvfp4"]["bytes_per_token"] == k * (
        hidden * 2 + (hidden * 4 + hidden // 16 * 16) / 8)
    assert by_pair["bf16", "mori_fp8_blockwise_fnuz"]["bytes_per_token"] == k * (
        hidden * 2 + hidden + hidden // 128 * 4)
    assert doc["verdict"]["bytes_per_token"]["combine"] == "flashinfer_nvfp4"
    assert "cheapest by bytes: dispatch bf16 x combine flashinfer_nvfp4:" in capsys.readouterr().out


def test_from_equals_a_fresh_sweep_at_the_new_interconnect(tiny_sweep, tmp_path, capsys):
    """Re-timing reproduces, number for number, a sweep run at the new settings."""
    time_flags = ["--interconnect", "rdma-cx7", "--ep-size", "16", "--ep-tokens", "64"]
    assert cli.main(["study", "--from", str(tiny_sweep / "results.json"), "--out",
                     str(tmp_path / "retimed"), *time_flags]) == 0
    assert cli.main([*TINY, "--out", str(tmp_path / "fresh"), *time_flags]) == 0
    retimed = json.loads((tmp_path / "retimed" / "results.json").read_text())
    fresh = json.loads((tmp_path / "fresh" / "results.json").read_text())
    original = json.loads((tiny_sweep / "results.json").read_text())
    for doc in (retimed, fresh):
        doc["settings"].pop("out")
    assert retimed == fresh
    assert retimed["routing"]["ep"]["ep_size"] == 16 != original["routing"]["ep"]["ep_size"]
    assert [r["rel_l2"] for r in retimed["results"]] == [r["rel_l2"] for r in
                                                         original["results"]]
    assert [r["comm_us"] for r in retimed["results"]] != [r["comm_us"] for r in
                                                          original["results"]]


def test_rdma_defaults_to_where_its_figures_start(tiny_sweep, tmp_path):
    assert cli.main(["study", "--from", str(tiny_sweep / "results.json"), "--out",
                     str(tmp_path / "r"), "--interconnect", "rdma-cx7"]) == 0
    doc = json.loads((tmp_path / "r" / "results.json").read_text())
    assert doc["routing"]["ep"]["ep_size"] == 16


def test_from_without_out_writes_beside_the_sweep_never_over_it(tiny_sweep, capsys):
    """The sweep's own files stay as they were; the re-timed ones go to a new directory
    beside it, named for the new time estimate."""
    before = {f.name: f.read_bytes() for f in tiny_sweep.iterdir()}
    assert cli.main(["study", "--from", str(tiny_sweep / "results.json"), "--interconnect",
                     "rdma-cx7"]) == 0
    assert {f.name: f.read_bytes() for f in tiny_sweep.iterdir()} == before
    beside = tiny_sweep.with_name(f"{tiny_sweep.name}-rdma-cx7-ep16")
    doc = json.loads((beside / "results.json").read_text())
    assert doc["interconnect"]["name"] == "rdma-cx7"
    wrote = capsys.readouterr().out.splitlines()[-1]
    assert Path(wrote.removeprefix("wrote ").split(", ")[0]).resolve() == beside / "results.json"


def test_from_refuses_to_write_over_its_own_sweep(tiny_sweep, capsys):
    code = cli.main(["study", "--from", str(tiny_sweep / "results.json"), "--out",
                     str(tiny_sweep), "--interconnect", "rdma-cx7"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moewire study: error: --out: {tiny_sweep} is the directory of "
                          "--from's results.json, whose results and plots it would overwrite")


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--model", "tiny"], "--model changes the error sweep"),
        (["--dispatch", "fp8", "--seed", "1"], "--dispatch, --seed change the error sweep"),
        (["--ep-size", "3"], "--ep-size"),
    ],
    ids=["sweep-flag", "formats", "bad-ep-size"],
)
def test_from_refuses_what_it_cannot_do(tiny_sweep, tmp_path, capsys, extra, needle):
    code = cli.main(["study", "--from", str(tiny_sweep / "results.json"), "--out",
                     str(tmp_path / "x"), *extra])
    assert code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "does not exist"),
        ("not json", "is not JSON"),
        (json.dumps({"schema": "moewire.study/1"}), "schema 'moewire.study/1'"),
        (json.dumps({"schema": "moewire.study/2", "routing": {}}), "older moewire"),
    ],
    ids=["missing", "not-json", "old-schema", "no-routing"],
)
def test_from_refuses_a_file_it_cannot_read(tmp_path, capsys, content, needle):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    assert cli.main(["study", "--from", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--from" in err and needle in err


def _doc_of(sweep):
    from moewire.study.retime import read_results

    return read_results(sweep / "results.json")


#: The demo's pairs (seed 0): (dispatch, combine, rel L2, comm us, bytes per token). Its
#: clusters (pairs 0.5 us and 1% of error apart) are where labels collide.
DEMO = [
    ("bf16", "bf16", 0.0, 118.7, 98304), ("bf16", "fp8", 0.01752, 101.3, 73728),
    ("bf16", "mxfp8", 0.01978, 101.8, 74496), ("bf16", "nvfp4", 0.06218, 93.7, 62976),
    ("bf16", "logfmt10", 0.00235, 106.2, 80640), ("fp8", "bf16", 0.04678, 100.7, 73728),
    ("fp8", "fp8", 0.04985, 83.3, 49152), ("fp8", "mxfp8", 0.05068, 83.9, 49920),
    ("fp8", "nvfp4", 0.07762, 75.7, 38400), ("fp8", "logfmt10", 0.04680, 88.2, 56064),
    ("mxfp8", "bf16", 0.02851, 101.3, 74496), ("mxfp8", "fp8", 0.03327, 83.9, 49920),
    ("mxfp8", "mxfp8", 0.03473, 84.4, 50688), ("mxfp8", "nvfp4", 0.06811, 76.3, 39168),
    ("mxfp8", "logfmt10", 0.02855, 88.8, 56832), ("nvfp4", "bf16", 0.09911, 92.9, 62976),
    ("nvfp4", "fp8", 0.10061, 75.5, 38400), ("nvfp4", "mxfp8", 0.10071, 76.0, 39168),
    ("nvfp4", "nvfp4", 0.11695, 67.9, 27648), ("nvfp4", "logfmt10", 0.09911, 80.4, 45312),
    ("mxfp4", "bf16", 0.12879, 92.3, 62208), ("mxfp4", "fp8", 0.12987, 74.9, 37632),
    ("mxfp4", "mxfp8", 0.13038, 75.5, 38400), ("mxfp4", "nvfp4", 0.14218, 67.3, 26880),
    ("mxfp4", "logfmt10", 0.12880, 79.8, 44544),
]


def _demo_doc() -> dict:
    return {
        "settings": {"model": "demo", "dispatch": ["bf16", "fp8", "mxfp8", "nvfp4", "mxfp4"],
                     "combine": ["bf16", "fp8", "mxfp8", "nvfp4", "logfmt10"]},
        "interconnect": {"name": "nvlink-h200"},
        "routing": {"ep": {"ep_size": 8, "tokens_per_rank": 128}},
        "results": [{"dispatch": d, "combine": c, "rel_l2": e, "comm_us": us,
                     "bf16_comm_us": 118.7, "bytes_per_token": b, "ratio_to_bf16": b / 98304}
                    for d, c, e, us, b in DEMO],
    }


@pytest.mark.parametrize("source", ["demo", "tiny-sweep"])
def test_the_front_is_labelled_at_its_own_place_without_collisions_or_crossings(source,
                                                                              request):
    """Every pair is a marker of its dispatch's colour and its combine's shape; each pair on
    the front is labelled (bold), pointing at its own marker; no label overlaps another or
    covers another pair's marker, and no leader line crosses another or runs through a
    label."""
    import matplotlib.pyplot as plt
    from matplotlib.text import Annotation, Text

    doc = _demo_doc() if source == "demo" else _doc_of(request.getfixturevalue("tiny_sweep"))
    fig = report.frontier_figure(doc)
    styles = report.point_styles(doc)
    try:
        renderer = fig.canvas.get_renderer()
        assert len(set(styles.values())) == len(styles)  # every pair told apart
        for ax, key in zip(fig.axes[:2], ("comm_us", "bytes_per_token"), strict=True):
            measured, _ = report.frontier_points(doc, key)
            front = {tag for _, _, tag in pareto(measured)}
            labels = {a.get_text(): a for a in ax.texts if isinstance(a, Annotation)
                      and not a.get_text().endswith(": exact")}
            assert sorted(labels) == sorted(front)
            assert all(a.get_fontweight() == "bold" for a in labels.values())
            for x, y, tag in measured:
                if tag in labels:
                    assert labels[tag].xy == (x, y), tag  # the label points at its own pair
            # The text of each label (an Annotation's own extent adds its leader line).
            for a in labels.values():
                a.update_positions(renderer)
            boxes = {t: tuple(Text.get_window_extent(a, renderer).extents)
                     for t, a in labels.items()}
            leaders = {}
            for t, a in labels.items():
                px, py = ax.transData.transform(a.xy)
                leaders[t] = ((px, py), report._anchor(boxes[t], px, py))
            assert min(b[0] for b in boxes.values()) > 50  # display coordinates, not offsets
            names = list(boxes)
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    overlap = (min(boxes[a][2], boxes[b][2]) > max(boxes[a][0], boxes[b][0])
                               and min(boxes[a][3], boxes[b][3]) > max(boxes[a][1],
                                                                       boxes[b][1]))
                    assert not overlap, (a, b)
                    assert not report._crosses(leaders[a], leaders[b]), (a, b)
                for b in names:
                    assert a == b or not report._hits_box(leaders[a], boxes[b]), (a, b)
                for x, y, tag in measured:  # no label covers another pair's marker
                    px, py = ax.transData.transform((x, y))
                    box = boxes[a]
                    inside = box[0] < px < box[2] and box[1] < py < box[3]
                    assert tag == a or not inside, (a, tag)
    finally:
        plt.close(fig)


@pytest.mark.parametrize(
    ("a", "b", "crosses"),
    [
        (((0, 0), (2, 2)), ((0, 2), (2, 0)), True),
        (((0, 0), (1, 1)), ((2, 2), (3, 0)), False),
        (((0, 0), (2, 0)), ((0, 1), (2, 1)), False),
        (((0, 0), (2, 2)), ((2, 2), (3, 0)), False),
    ],
    ids=["x", "apart", "parallel", "touching-ends"],
)
def test_segments_cross(a, b, crosses):
    assert report._crosses(a, b) is crosses


@pytest.mark.parametrize(
    ("box", "leader", "count"),
    [
        ((20, 20, 30, 25), ((5, 5), (20, 20)), 0),          # clear of everything placed
        ((20, 0, 30, 5), ((0, 10), (20, 2)), 1),            # crosses the placed line
        ((-5, 2, 5, 8), ((40, 0), (5, 2)), 1),              # the placed line runs through
        ((40, -10, 50, -5), ((30, 30), (45, -5)), 1),       # runs through the placed label
    ],
    ids=["clear", "crosses-a-line", "line-through-it", "through-a-label"],
)
def test_a_label_is_scored_by_what_it_crosses(box, leader, count):
    """Placed: a leader line from (0, 0) to (10, 10) and a label at (35, 10)-(50, 20)."""
    placed_leaders = [((0, 0), (10, 10))]
    placed_labels = [(35, 10, 50, 20)]
    assert report.crossings(box, leader, placed_leaders, placed_labels) == count


def test_the_budget_is_a_line_on_both_panels(tiny_sweep):
    import matplotlib.pyplot as plt

    from moewire.study.verdict import Budget, judge

    for budget, want in ((Budget("rel_l2", 0.05), 0.05), (Budget("sqnr_db", 20.0), 0.1)):
        doc = judge(_doc_of(tiny_sweep), budget)
        fig = report.frontier_figure(doc)
        try:
            for ax in fig.axes[:2]:
                ys = [tuple(line.get_ydata()) for line in ax.get_lines()
                      if line.get_label().startswith("budget")]
                assert ys == [(pytest.approx(want), pytest.approx(want))]
        finally:
            plt.close(fig)


def test_the_heatmap_colour_scale_is_fixed_and_shows_the_cost(tiny_sweep, tmp_path):
    doc = _doc_of(tiny_sweep)
    costs, what = report.heatmap_costs(doc)
    by_pair = {(r["dispatch"], r["combine"]): r for r in doc["results"]}
    d, c = doc["settings"]["dispatch"], doc["settings"]["combine"]
    assert costs[1, 2] == by_pair[d[1], c[2]]["time_ratio_to_bf16"]
    assert "time" in what
    assert report.SQNR_SCALE_DB == (0.0, 60.0)
    assert report.plot_heatmap(doc, tmp_path / "h.png").stat().st_size > 1000


def _priced(dispatch: str, combine: str, rel_l2: float, bytes_per_token: float) -> dict:
    return {"dispatch": dispatch, "combine": combine, "rel_l2": rel_l2,
            "bytes_per_token": bytes_per_token, "ratio_to_bf16": bytes_per_token / 1000}


@pytest.mark.parametrize(("cost", "tied"), [(995.0, True), (980.0, False)],
                         ids=["within-1%", "2%-apart"])
def test_the_verdict_says_when_the_tie_rule_chose(cost, tied):
    """fp8 x nvfp4 costs ``cost`` bytes, mxfp8 x fp8 1000 with a lower error: within 1% the
    lower error is named and the line under it names the cheaper pair it tied with."""
    from moewire.study.verdict import verdict, verdict_lines

    doc = {"results": [_priced("bf16", "bf16", 0.0, 2000.0), _priced("fp8", "nvfp4", 0.04, cost),
                       _priced("mxfp8", "fp8", 0.01, 1000.0), _priced("nvfp4", "nvfp4", 0.2, 1.0)]}
    doc["verdict"] = verdict(doc, Budget("rel_l2", 0.05))
    best = doc["verdict"]["bytes_per_token"]
    assert (best["dispatch"], best["combine"]) == (("mxfp8", "fp8") if tied else ("fp8", "nvfp4"))
    lines = [line for line in verdict_lines(doc) if "tied within 1% by bytes" in line]
    if tied:
        assert best["tied"] == [{"dispatch": "fp8", "combine": "nvfp4", "rel_l2": 0.04,
                                 "bytes_per_token": cost}]
        assert lines == ["    tied within 1% by bytes with fp8 x nvfp4 (rel L2 4.00e-02), "
                         "also within budget; the lowest rel L2 decided"]
    else:
        assert best["tied"] == [] and lines == []


def test_many_tied_pairs_make_one_line():
    """Ten pairs within 1% of the cheapest: one line names three and counts the rest."""
    from moewire.study.verdict import verdict, verdict_lines

    doc = {"results": [_priced("bf16", "bf16", 0.0, 2000.0)]
           + [_priced("fp8", f"c{i}", 0.02 + i * 1e-3, 1000.0 + i) for i in range(11)]}
    doc["verdict"] = verdict(doc, Budget("rel_l2", 0.05))
    lines = [line for line in verdict_lines(doc) if "tied within 1% by bytes" in line]
    assert len(lines) == 1
    assert "fp8 x c1 (rel L2 2.10e-02), fp8 x c2" in lines[0]
    assert lines[0].endswith("and 7 more, also within budget; the lowest rel L2 decided")

