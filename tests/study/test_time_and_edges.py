"""The time estimate end to end, and the rough edges a new user met (the exact
pair drawn at an invented error, a progress counter that labelled the pair about to start,
flag conflicts refused only after the build began), each with a test."""

import io
import json
import math
import re

import pytest
import torch

from moewire import cli
from moewire.reference import make_weights
from moewire.study import StudyConfig, report, run_study
from moewire.study import layer as study_layer
from moewire.study.comm import INTERCONNECTS
from moewire.study.errors import StudyArgumentError
from moewire.study.settings import validate

TINY = ["study", "--model", "tiny", "--tokens", "16", "--calib-batches", "1",
        "--eval-batches", "1", "--dispatch", "fp8", "--combine", "nvfp4"]


def _doc(base_error=0.0):
    """A small results document: bf16/bf16 with ``base_error`` (0: exact), three measured."""
    rows = [("bf16", "bf16", base_error, 100.0, 8.0), ("bf16", "fp8", 0.02, 75.0, 6.5),
            ("fp8", "bf16", 0.05, 75.0, 6.4), ("fp8", "fp8", 0.06, 50.0, 5.0)]
    results = []
    for d, c, err, nbytes, us in rows:
        results.append({
            "dispatch": d, "combine": c, "rel_l2": err,
            "sqnr_db": math.inf if err == 0 else -20 * math.log10(err), "cosine": 1.0,
            "max_abs_err": err, "bytes_per_token": nbytes, "ratio_to_bf16": nbytes / 100.0,
            "dispatch_us": us / 2, "combine_us": us / 2, "comm_us": us, "bf16_comm_us": 8.0,
            "saved_us": 8.0 - us, "time_ratio_to_bf16": us / 8.0, "fake_quant_us": None,
        })
    return {
        "settings": {"model": "tiny", "dispatch": ["bf16", "fp8"], "combine": ["bf16", "fp8"]},
        "layer": {"num_experts": 16, "top_k": 4, "hidden": 512, "mma": "fp8xfp4"},
        "routing": {"eval_tokens": 16, "ep": {"ep_size": 8, "tokens_per_rank": 16}},
        "interconnect": INTERCONNECTS["nvlink-h200"].as_dict(),
        "results": results,
    }


# -- (a) the exact pair is shown as exact ---------------------------------------------------


def test_frontier_points_keep_the_exact_pair_out_of_the_measured_ones():
    measured, exact = report.frontier_points(_doc(), "comm_us")
    assert exact == [(8.0, "bf16/bf16")]
    assert [tag for _, _, tag in measured] == ["bf16/fp8", "fp8/bf16", "fp8/fp8"]
    assert "bf16/bf16" not in [tag for _, _, tag in report.pareto(measured)]


@pytest.mark.parametrize("base_error", [0.0, 1e-3], ids=["exact", "kernel-noise"])
def test_the_frontier_draws_no_invented_error(base_error):
    """Every point and every frontier vertex drawn in data coordinates is a measured error;
    an exact pair sits on the bottom edge (axes coordinates) at its own time and bytes. The
    old plot drew bf16/bf16 at min(error) / 3 in data coordinates and fails this. A
    bf16/bf16 with an error (the real kernel's run-to-run noise) is a measurement, drawn so."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import PathCollection

    doc = _doc(base_error)
    errors = {r["rel_l2"] for r in doc["results"] if r["rel_l2"] > 0}
    fig = report.frontier_figure(doc)
    try:
        panels = [ax for ax in fig.axes if ax.get_yscale() == "log"]
        assert len(panels) == 2  # time and bytes
        for ax, x_key in zip(panels, ("comm_us", "bytes_per_token"), strict=True):
            data_y, edge_x = [], []
            for coll in ax.collections:
                if not isinstance(coll, PathCollection) or not len(coll.get_offsets()):
                    continue
                (x, y), = coll.get_offsets().tolist()
                if coll.get_offset_transform() == ax.transData:
                    data_y.append(y)
                else:
                    edge_x.append(x)
                    assert y == 0.0  # the bottom edge, in axes coordinates
            assert set(data_y) == errors
            assert edge_x == ([doc["results"][0][x_key]] if base_error == 0 else [])
            front = next(line for line in ax.get_lines()
                         if line.get_label().startswith("Pareto"))
            assert set(front.get_ydata()) <= errors
        assert all("drawn at" not in ax.get_title() for ax in fig.axes)
    finally:
        plt.close(fig)


def test_a_sweep_of_the_baseline_alone_plots(tmp_path):
    """Only bf16/bf16: nothing measured, the exact marker alone, no log-scale error."""
    doc = _doc()
    doc["results"] = doc["results"][:1]
    doc["settings"].update(dispatch=["bf16"], combine=["bf16"])
    assert report.plot_frontier(doc, tmp_path / "f.png").stat().st_size > 1000
    assert report.plot_heatmap(doc, tmp_path / "h.png").stat().st_size > 1000


def test_the_heatmap_does_not_colour_the_exact_cell():
    """The exact cell is masked (grey, labelled), a noisy baseline is not. Masking only NaN
    (the exact cell coloured at the scale's top, as before) fails it."""
    shown = report.heatmap_values(_doc())
    assert shown.mask.tolist() == [[True, False], [False, False]]
    assert shown[1, 1] == pytest.approx(-20 * math.log10(0.06))
    noisy = report.heatmap_values(_doc(1e-3))
    assert not noisy.mask.any()


# -- (b) honest progress ----------------------------------------------------------------------


def test_progress_lines_count_pairs_done_and_the_build(tmp_path, capsys):
    """Without a terminal: the build reports experts built of total as it goes, and each
    pair line counts the pairs done including the one it names (the old counter printed
    `[0/?] building`, then `[1/8]` over the pair about to start, and skipped numbers)."""
    assert cli.main([*TINY, "--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("building the layer (16 experts")
    built = [tuple(map(int, m.groups())) for line in lines
             if (m := re.fullmatch(r"  built (\d+)/(\d+) experts", line))]
    assert built[0] == (0, 16) and built[-1] == (16, 16)
    assert [d for d, _ in built] == sorted(d for d, _ in built) and len(built) > 2
    pairs = [(int(m[1]), int(m[2]), m[3]) for line in lines
             if (m := re.fullmatch(r"\[(\d+)/(\d+) pairs done\] (.*)", line))]
    want = [f"dispatch {d} x combine {c}" for d in ("bf16", "fp8") for c in ("bf16", "nvfp4")]
    assert pairs == [(i + 1, 4, label) for i, label in enumerate(want)]
    assert not any("?" in line for line in lines if line.startswith("["))


def test_the_terminal_bar_counts_what_is_done():
    from rich.console import Console
    from rich.progress import Progress as RichProgress

    bar = RichProgress(console=Console(file=io.StringIO()))
    hooks = cli._rich_hooks(bar)
    hooks.phase("building the layer")
    hooks.build(0, 16)
    hooks.build(8, 16)
    build = bar.tasks[0]
    assert (build.completed, build.total) == (8, 16)
    hooks.pair_start(0, 4, "dispatch bf16 x combine bf16")
    pairs = bar.tasks[1]
    assert (pairs.completed, pairs.total) == (0, 4)
    hooks.pair_done(1, 4, "dispatch bf16 x combine bf16")
    hooks.pair_start(1, 4, "dispatch bf16 x combine fp8")
    assert pairs.completed == 1 and pairs.description == "dispatch bf16 x combine fp8"


@pytest.mark.parametrize("mma", ["fp8xfp4", "bf16xbf16", "nvfp4", "fp4xfp4"])
def test_the_chunked_build_is_the_one_call_build(mma):
    """Building in chunks (to report progress) changes no bit of the weights."""
    cfg = StudyConfig(model="tiny", mma=mma)
    seen = []
    got = study_layer.synthetic_kernel_weights(cfg, 16, 512, 512, torch.device("cpu"),
                                               lambda d, t: seen.append((d, t)))
    if mma == "nvfp4":
        from moewire.reference import make_nvfp4_weights

        want = make_nvfp4_weights(16, 512, 512, seed=0)
    elif mma == "fp4xfp4":
        from moewire.reference.fp4_fp4.weights import make_fp4_fp4_weights

        want = make_fp4_fp4_weights(16, 512, 512, seed=0)
    else:
        want = make_weights(16, 512, 512, mma_type=mma, seed=0)
    assert got.experts == want.experts == tuple(range(16))
    for name in ("l1", "l2", "l1_raw", "l2_raw", "l1_global_scale", "l2_global_scale",
                 "l1_alphas", "l2_alphas"):
        if not hasattr(want, name):
            continue
        a, b = getattr(got, name), getattr(want, name)
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,),
                        strict=True):
            assert torch.equal(x, y), name
    assert seen[0] == (0, 16) and seen[-1] == (16, 16) and len(seen) == 9


# -- (c) flag conflicts before any work -------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kernel", "deepgemm-sm90"], "--device: --kernel deepgemm-sm90 runs on the GPU"),
        (["--kernel", "deepgemm-sm90", "--mma", "bf16xbf16"], "--mma: --kernel deepgemm-sm90"),
        (["--ep-size", "16"], "--ep-size: nvlink-h200 spans one 8-GPU node, not 16 ranks"),
        (["--interconnect", "rdma-cx7", "--ep-size", "32"],
         "--ep-size: the routing is measured on batches of --tokens 16"),
        (["--tokens", "64", "--interconnect", "rdma-cx7", "--ep-size", "32"],
         "--ep-size: 16 experts do not split over 32 ranks"),
        (["--link-gbps", "0"], "--link-gbps: must be a finite number > 0, got 0"),
        (["--link-latency-us", "-1"], "argument --link-latency-us: must be"),
        (["--interconnect", "nvlink-h100x"], "argument --interconnect: invalid choice"),
    ],
    ids=["sm90-on-cpu", "sm90-bf16-mma", "ep-beyond-nvlink", "ep-vs-tokens", "ep-vs-experts",
         "zero-bandwidth", "negative-latency", "unknown-interconnect"],
)
def test_flag_conflicts_are_refused_before_any_work(args, needle, tmp_path, capsys,
                                                    monkeypatch):
    """Exit 2 before the layer is built, before --out is created and before any progress
    line (`--kernel deepgemm-sm90` on the CPU used to print `building the layer` first)."""
    built = []
    monkeypatch.setattr(study_layer, "synthetic_kernel_weights",
                        lambda *a, **k: built.append(1))
    out = tmp_path / "out"
    assert cli.main([*TINY, "--out", str(out), *args]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err, captured.err
    assert not built and not out.exists() and "building" not in captured.out


@pytest.mark.parametrize(
    ("changes", "flag"),
    [({"link_gbps": 0.0}, "--link-gbps"), ({"link_gbps": math.inf}, "--link-gbps"),
     ({"link_latency_us": -1.0}, "--link-latency-us"), ({"interconnect": "x"}, "--interconnect"),
     ({"ep_size": 0}, "--ep-size"), ({"ep_tokens": 0}, "--ep-tokens")],
    ids=["zero-gbps", "inf-gbps", "negative-latency", "unknown-interconnect", "zero-ep",
         "zero-ep-tokens"],
)
def test_python_api_refuses_bad_time_settings(changes, flag):
    with pytest.raises(StudyArgumentError, match=f"^{flag}: "):
        validate(StudyConfig(model="tiny", **changes))


def test_a_checkpoint_whose_experts_do_not_split_over_the_ep_size(checkpoint, tmp_path,
                                                                  capsys):
    path, _ = checkpoint  # 8 experts
    code = cli.main([*TINY, "--weights", str(path), "--layer", "3", "--interconnect",
                     "rdma-cx7", "--ep-size", "16", "--out", str(tmp_path / "o")])
    assert code == 2
    assert "--ep-size: 8 experts do not split over 16 ranks" in capsys.readouterr().err


# -- the time estimate end to end ---------------------------------------------------------------


def test_overridden_link_gives_the_hand_computed_time(tmp_path, capsys):
    """rdma-cx7 at EP 16 with --link-gbps 100 and --link-latency-us 5: dispatch time is
    5 us + the busiest rank's copies x the row's bytes / 100 GB/s, for every format."""
    out = tmp_path / "o"
    assert cli.main([*TINY, "--interconnect", "rdma-cx7", "--ep-size", "16", "--ep-tokens",
                     "256", "--link-gbps", "100", "--link-latency-us", "5", "--out",
                     str(out)]) == 0
    printed = capsys.readouterr().out
    assert "time estimate: rdma-cx7+custom" in printed and "EP 16, 256 tokens per rank" in printed
    doc = json.loads((out / "results.json").read_text())
    link, ep = doc["interconnect"], doc["routing"]["ep"]
    assert link["latency_us"] == 5.0 and "--link-gbps 100" in link["source"]
    assert ep["ep_size"] == 16 and ep["tokens_per_rank"] == 256
    copies = 256 * 4 * ep["remote_fraction"] * ep["bottleneck"]
    assert ep["bottleneck_copies"] == pytest.approx(copies)
    for r in doc["results"]:
        row = {"bf16": 2 * 512, "fp8": 512, "nvfp4": 512 / 2 + 512 / 16}
        assert r["dispatch_us"] == pytest.approx(5 + copies * row[r["dispatch"]] / 100e3)
        assert r["combine_us"] == pytest.approx(5 + copies * row[r["combine"]] / 100e3)


def test_the_default_ep_size_fits_the_layer():
    """No --ep-size: 8 (a layer it does not fit is refused: tests/study/test_time_model.py)."""
    from moewire.study.settings import ep_size

    assert ep_size(StudyConfig(model="tiny", tokens=16), 16) == 8
    assert ep_size(StudyConfig(model="tiny", tokens=16, ep_size=2), 16) == 2


@pytest.mark.gpu
def test_the_fake_quantization_cost_is_measured_on_cuda():
    """On CUDA every pair reports the forward time it adds over the unquantized layer;
    quantizing both ways costs more than the baseline's (near-zero) difference."""
    doc = run_study(StudyConfig(model="tiny", tokens=64, calib_batches=1, eval_batches=2,
                                dispatch=("bf16", "fp8"), combine=("bf16", "nvfp4"),
                                device="cuda"))
    by_pair = {(r["dispatch"], r["combine"]): r["fake_quant_us"] for r in doc["results"]}
    assert all(isinstance(v, float) for v in by_pair.values())
    assert by_pair["fp8", "nvfp4"] > by_pair["bf16", "bf16"]
    assert "QDQ us" in report.plain_table(doc)


def test_the_one_builder_never_stands_in_for_the_real_kernel_silently():
    """layer.build_layer builds both kernels' layers; asked for the real kernel without its
    experts (what moewire.study.real_kernel.build_layer passes), it refuses."""
    cfg = StudyConfig(model="tiny", kernel="deepgemm-sm90", device="cuda")
    with pytest.raises(ValueError, match="deepgemm-sm90 needs its own experts"):
        study_layer.build_layer(cfg, torch.Generator())
    with pytest.raises(ValueError, match="the stand-in kernel takes neither"):
        study_layer.build_layer(StudyConfig(model="tiny"), torch.Generator(),
                                experts=lambda *a: {}, layer_cls=study_layer.StudyLayer)


def test_the_fake_quantization_cost_is_paired_so_a_drift_cancels(monkeypatch):
    """``added_forward_us`` times the quantized and the unquantized pass back to back in
    each trial and takes the median difference: a clock that drifts by far more than the
    cost between trials still gives the cost. The break it catches: timing the reference
    once and the quantized layer later (what the study did, which printed negative costs on
    the H200), or differencing the two medians of unpaired passes."""
    clock = {"calls": 0}
    cost, drift = 7.0, 50.0

    def pass_us(model, evals):
        clock["calls"] += 1
        # The GPU slows down trial after trial (far more than the cost); within a trial
        # (two passes) it is steady.
        base = 1000.0 + drift * ((clock["calls"] - 1) // 2)
        return base + (cost if model == "quantized" else 0.0)

    calls = []
    model = lambda *batch: calls.append("quantized")  # noqa: E731
    reference = lambda *batch: calls.append("reference")  # noqa: E731
    monkeypatch.setattr(study_layer, "_pass_us",
                        lambda m, evals: pass_us("quantized" if m is model else "ref", evals))
    got = study_layer.added_forward_us(model, reference, [("x", "w", "ids")])
    assert got == cost
    assert calls == ["quantized", "reference"]  # one warm-up pass each
