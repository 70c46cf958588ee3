"""A new user's first hour: fast help, checks before any work, memory plan,
an 80-column table, realistic synthetic routing."""

import json
import subprocess
import sys

import pytest
import torch

from moewire import cli
from moewire.study import PRESETS, StudyConfig, report
from moewire.study import layer as study_layer
from moewire.study.data import load_profile, norm_gamma, synthetic_hidden_states
from moewire.study.layer import synthetic_router

TINY = ["study", "--model", "tiny", "--tokens", "16", "--calib-batches", "1",
        "--eval-batches", "1", "--dispatch", "fp8", "--combine", "nvfp4"]


def _fails_before_work(tmp_path, capsys, args, code, needle, monkeypatch=None):
    """The command exits with ``code`` and ``needle`` before the layer is built."""
    built = []
    if monkeypatch is not None:
        real = study_layer.build_layer
        monkeypatch.setattr("moewire.study.runner.build_layer",
                            lambda *a: built.append(1) or real(*a))
    assert cli.main([*TINY, *args]) == code
    err = capsys.readouterr().err
    assert needle in err, err
    assert not built


# -- checks before any work --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--dispatch", ""], "--dispatch: the list is empty"),
     (["--combine", " , "], "--combine: the list is empty"),
     (["--out", "/proc/moewire-x"], "--out: cannot write into /proc/moewire-x"),
     (["--out", "{file}"], "exists and is not a directory"),
     (["--router-imbalance", "0.5"], "argument --router-imbalance: must be a finite number"),
     (["--router-imbalance", "9"], "--router-imbalance: 9.0 x the mean load is more than "
                                   "every token: with 16 experts and top-k 4")],
    ids=["empty-dispatch", "empty-combine", "out-unwritable", "out-is-a-file",
         "imbalance-below-1", "imbalance-above-e-over-k"],
)
def test_refused_before_any_work_with_exit_2(args, needle, tmp_path, capsys, monkeypatch):
    existing = tmp_path / "file"
    existing.write_text("x")
    args = [str(existing) if a == "{file}" else a for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    _fails_before_work(tmp_path, capsys, args, 2, needle, monkeypatch)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_missing_dependency_names_the_pip_line_before_any_work(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    _fails_before_work(tmp_path, capsys, ["--out", str(tmp_path / "out")], 1,
                       "-m pip install matplotlib", monkeypatch)
    assert not (tmp_path / "out").exists()


def _cli_without_torch(argv):
    """Run ``cli.main(argv)`` in a fresh Python; assert it never imported torch.

    Returns (exit code, the command's stdout)."""
    code = (f"import sys; from moewire import cli; rc = cli.main({argv!r}); "
            "assert 'torch' not in sys.modules, 'torch imported'; print('rc', rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert "torch imported" not in done.stderr and "\nrc " in "\n" + done.stdout, done.stderr
    out, _, rc = done.stdout.rpartition("rc ")
    return int(rc), out


@pytest.mark.parametrize("argv", [["--help"], ["study", "--help"], ["study", "--tokens", "x"],
                                  ["study", "--model", "gpt5"], [], ["formats"],
                                  ["formats", "--help"], ["formats", "--hidden", "0"],
                                  ["formats", "--bogus"]],
                         ids=["help", "study-help", "bad-int", "bad-choice", "no-command",
                              "formats", "formats-help", "formats-bad-hidden",
                              "formats-bad-flag"])
def test_help_formats_and_flag_errors_do_not_import_torch(argv):
    rc, _ = _cli_without_torch(argv)
    assert rc == (2 if argv in ([], ["study", "--tokens", "x"], ["study", "--model", "gpt5"],
                                ["formats", "--hidden", "0"], ["formats", "--bogus"]) else 0)


@pytest.mark.parametrize("hidden", [4096, 7168, 100])
def test_formats_table_without_torch_matches_the_registry(hidden):
    from moewire import formats

    rc, out = _cli_without_torch(["formats", "--hidden", str(hidden)])
    assert rc == 0
    lines = out.splitlines()
    assert f"bits/elem @H={hidden}" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert sorted(rows) == formats.names()
    for name, row in rows.items():
        f = formats.get(name)  # the torch-backed format objects, as fake_quant uses them
        fits = f.block_size is None or hidden % f.block_size == 0
        assert row[1:] == [
            f"{f.element_bits:g}", "-" if f.block_size is None else str(f.block_size),
            str(f.scale_bits), str(f.row_scale_bits),
            f"{f.wire_bits(hidden) / hidden:.4g}" if fits else "n/a",
            "yes" if f.needs_amax else "no", "yes" if f.row_local else "no",
        ], name


# -- memory plan -----------------------------------------------------------------------------------


def test_a_layer_that_will_not_fit_is_refused_with_size_and_experts(tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setattr(study_layer, "_available_bytes", lambda device: 8 * 10**9)
    needed, available, fits = study_layer.plan_memory(StudyConfig(model="v4-flash"))
    per_expert = 3 * 4096 * 2048 * 1.42
    assert needed == pytest.approx(256 * per_expert + 0.25e9)
    assert fits == int((0.9 * 8e9 - 0.25e9) // per_expert)
    code = cli.main(["study", "--model", "v4-flash", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2
    assert (f"--experts: the v4-flash layer with 256 experts needs about {needed / 1e9:.1f} GB"
            in err), err
    assert f"8.0 GB are available on cpu; pass --experts {fits} (or fewer)" in err


def test_large_token_counts_warn_up_front(monkeypatch):
    monkeypatch.setattr(study_layer, "_available_bytes", lambda device: 10**12)
    with pytest.warns(RuntimeWarning, match="--tokens 8192 on the CPU.*expect a long run"):
        plan = study_layer.check_resources(StudyConfig(model="tiny", tokens=8192))
    assert plan.startswith("16 experts, about ")


def test_the_memory_plan_shows_before_the_layer_is_built(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(study_layer, "_available_bytes", lambda device: 64 * 10**9)
    needed, _, _ = study_layer.plan_memory(StudyConfig(model="tiny"))
    shown = []
    real = study_layer.build_layer
    monkeypatch.setattr("moewire.study.runner.build_layer",
                        lambda *a: shown.append(capsys.readouterr().out) or real(*a))
    assert cli.main([*TINY, "--out", str(tmp_path / "out")]) == 0
    assert len(shown) == 1
    assert (f"building the layer (16 experts, about {needed / 1e9:.1f} GB of 64 GB free)"
            in shown[0]), shown[0]


# -- the table in 80 columns ----------------------------------------------------------------------


def _doc():
    results = []
    for d in ("bf16", "fp8", "fp8_b128_ue8m0", "mxfp4"):
        for c in ("bf16", "fp8_b32_ue8m0", "logfmt10"):
            results.append({"dispatch": d, "combine": c, "rel_l2": 1.3951234e-2,
                            "sqnr_db": 37.106, "cosine": 0.9999027, "max_abs_err": 1.2345e-1,
                            "bytes_per_token": 100366.0, "ratio_to_bf16": 0.314,
                            "dispatch_us": 41.93, "combine_us": 58.81, "comm_us": 100.74,
                            "saved_us": 17.9, "time_ratio_to_bf16": 0.849,
                            "fake_quant_us": 12.5})
    return {"results": results}


@pytest.mark.parametrize("width", [80, 100], ids=["80", "100"])
def test_plain_and_rich_tables_fit_the_terminal(width):
    from rich.console import Console

    doc = _doc()
    text = report.plain_table(doc, width=width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "1.395e-02" in text and "…" not in text
    console = Console(width=width, record=True, force_terminal=False)
    console.print(report.rich_table(doc, width=width))
    rendered = console.export_text()
    assert max(len(line) for line in rendered.splitlines()) <= width
    assert "1.395e-02" in rendered and "…" not in rendered
    assert "fp8_b128_ue8m0" in rendered and "fp8_b32_ue8m0" in rendered
    assert "100.7" in text and "100.7" in rendered  # the estimated time always stays
    if width == 80:
        assert "left out to fit the terminal: SQNR dB, cosine" in " ".join(rendered.split())


def test_a_wide_terminal_shows_every_column():
    assert report.table_columns(_doc(), 200) == tuple(k for k, _ in report._COLUMNS)


def test_columns_follow_what_the_results_hold():
    """No QDQ column where nothing was timed (CPU), no time columns in a schema-1 file."""
    doc = _doc()
    for r in doc["results"]:
        r["fake_quant_us"] = None
    assert "fake_quant_us" not in report.table_columns(doc, None)
    assert "comm_us" in report.table_columns(doc, None)
    old = {"results": [{k: v for k, v in r.items() if not k.endswith("_us")
                        and k != "time_ratio_to_bf16"} for r in doc["results"]]}
    assert report.table_columns(old, None) == tuple(k for k, _ in report._COLUMNS[:9])
    assert len(report.plain_table(old).splitlines()) == 2 + len(old["results"])


# -- realistic routing --------------------------------------------------------------------------


def test_load_profile_has_mean_one_and_the_asked_max():
    for experts, imbalance in ((16, 2.5), (256, 2.5), (896, 3.0), (8, 1.0)):
        v = load_profile(experts, imbalance)
        assert float(v.mean()) == pytest.approx(1.0, rel=1e-5)
        assert float(v.max()) == pytest.approx(imbalance, rel=1e-4)


def _measured_imbalance(name, imbalance, tokens=8192):
    p = PRESETS[name]
    g = torch.Generator().manual_seed(0)
    gamma = norm_gamma(p.hidden, g)
    router = synthetic_router(p.num_experts, p.hidden, p.top_k, p.gating, imbalance, g, gamma)
    x = synthetic_hidden_states(tokens, p.hidden, torch.Generator().manual_seed(9), gamma)
    _, ids = router(x)
    load = torch.bincount(ids.reshape(-1), minlength=p.num_experts).float()
    return float(load.max() / load.mean())


@pytest.mark.parametrize(("name", "imbalance"), [("demo", 2.5), ("tiny", 2.5), ("demo", 1.5)],
                         ids=["demo", "tiny", "demo-1.5"])
def test_synthetic_router_lands_near_the_imbalance(name, imbalance):
    assert _measured_imbalance(name, imbalance) == pytest.approx(imbalance, rel=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v4-flash", "v4-pro", "kimi-k3"])
def test_synthetic_router_is_balanced_at_full_size(name):
    """At 256-896 experts the hottest of 8192 tokens' experts adds sampling noise on top of
    the expected 2.5x (a few hundred copies per expert): it must stay a few x, not 40x."""
    assert 2.2 <= _measured_imbalance(name, 2.5) <= 3.2


@pytest.mark.slow
def test_study_reports_the_target_and_lands_near_it(tmp_path):
    out = tmp_path / "o"
    assert cli.main(["study", "--model", "tiny", "--tokens", "512", "--calib-batches", "1",
                     "--eval-batches", "2", "--dispatch", "bf16", "--combine", "bf16",
                     "--out", str(out)]) == 0
    routing = json.loads((out / "results.json").read_text())["routing"]
    assert routing["target_max_over_mean"] == 2.5
    assert 2.0 <= routing["expert_load_max_over_mean"] <= 3.0


def test_the_study_mma_table_agrees_with_the_stand_in():
    """``study/settings.py`` keeps its own MMA table because the CLI validates flags before
    torch is imported (the stand-in kernel imports torch); this keeps the two in step."""
    from moewire.reference import deep_gemm
    from moewire.study import settings

    assert settings.MMA_TYPES == (*deep_gemm.MMA_TYPES, "nvfp4")
    assert "fp4xfp4" in settings.MMA_TYPES
    assert settings._HIDDEN_MULTIPLE == {**deep_gemm.HIDDEN_MULTIPLE, "nvfp4": 128}


def test_kimi_k3s_wire_carries_latent_rows():
    """Kimi-K3's experts run on its latent width (3584, not the model's 7168): a BF16
    dispatch row is 2 * 3584 bytes."""
    from moewire.study.presets import PRESETS
    from moewire.study.wire import format_bits

    kimi = PRESETS["kimi-k3"]
    assert (kimi.hidden, kimi.num_experts, kimi.top_k, kimi.num_shared) == (3584, 896, 16, 2)
    assert format_bits("bf16", kimi.hidden) / 8 == 2 * 3584
