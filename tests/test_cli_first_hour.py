"""What a new user sees from ``moewire study`` and ``moewire eval`` when something goes
wrong: one line per bad argument, one line and exit 130 on Ctrl-C, one vocabulary in both
commands, refusals before any work, and a progress display without markup or hard wraps."""

import io
from pathlib import Path

import pytest

from moewire import cli

# -- one line per bad argument --------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [(["eval", "ckpt", "--budget", "-1"], "argument --budget: must be a finite number > 0"),
     (["eval", "ckpt", "--budget", "0"], "argument --budget: must be a finite number > 0"),
     (["eval", "ckpt", "--seq-len", "0"], "argument --seq-len: must be >= 2, got 0"),
     (["eval", "ckpt", "--max-tokens", "0"], "argument --max-tokens: must be >= 2, got 0"),
     (["eval", "ckpt", "--kernel", "cutlass"], "argument --kernel: unknown kernel 'cutlass'"),
     (["study", "--tokens", "0"], "argument --tokens: must be >= 1, got 0"),
     (["study", "--kernel", "cutlass"], "argument --kernel: unknown kernel 'cutlass'"),
     (["eval"], "the following arguments are required: checkpoint")],
    ids=["eval-budget-negative", "eval-budget-zero", "eval-seq-len", "eval-max-tokens",
         "eval-kernel", "study-tokens", "study-kernel", "eval-no-checkpoint"])
def test_a_bad_argument_is_one_line_without_the_usage_block(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "usage:" not in err
    assert needle in err
    assert err.startswith(f"moewire {argv[0]}: error: ")
    assert err.rstrip().endswith(f"(see moewire {argv[0]} --help)")


def test_under_torchrun_only_rank_0_says_a_bad_argument(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["eval", "ckpt", "--budget", "0"]) == 2
    assert capsys.readouterr().err == ""


def test_help_still_prints_the_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["eval", "--help"])
    assert exit_.value.code == 0
    assert "usage: moewire eval" in capsys.readouterr().out


# -- Ctrl-C ---------------------------------------------------------------------------------


def _interrupt_after(path: Path, write: bool):
    """A run that claims ``path`` (``moewire.outputs``), writes one file or none, and is
    interrupted."""
    from moewire.outputs import prepare_output_dir

    def run(*args, **kwargs):
        out = prepare_output_dir(path, "eval", ("results.json",), False, print)
        if write:
            out.write("results.json", "{}")
        raise KeyboardInterrupt

    return run


@pytest.mark.parametrize("command", ["study", "eval"])
def test_ctrl_c_is_one_line_exit_130_and_no_empty_directory(command, tmp_path, monkeypatch,
                                                            capsys):
    out = tmp_path / "out"
    if command == "study":
        monkeypatch.setattr(cli, "_sweep", _interrupt_after(out, write=False))
        argv = ["study", "--model", "tiny", "--out", str(out)]
    else:
        monkeypatch.setattr("moewire.eval.evaluate", _interrupt_after(out, write=False))
        argv = ["eval", str(tmp_path), "--out", str(out)]
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"moewire {command}: interrupted; nothing was written")
    assert not out.exists()


def test_ctrl_c_names_the_directory_that_holds_finished_files(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setattr("moewire.eval.evaluate", _interrupt_after(out, write=True))
    assert cli.main(["eval", str(tmp_path), "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{out} holds only complete files (INTERRUPTED lists them)" in err
    assert (out / "results.json").read_text() == "{}"
    assert "results.json" in (out / "INTERRUPTED").read_text()


def test_ctrl_c_in_eval_is_said_once_though_the_runner_logs_it(tmp_path, monkeypatch,
                                                                capsys):
    out = tmp_path / "out"
    claim = _interrupt_after(out, write=True)

    def evaluate(checkpoint, config, log, **kwargs):
        log("eval: window 1/2: 0.1 s so far")
        try:
            claim()
        except KeyboardInterrupt:
            log(f"eval: interrupted; {out} holds only complete files")
            raise

    monkeypatch.setattr("moewire.eval.evaluate", evaluate)
    assert cli.main(["eval", str(tmp_path), "--out", str(out)]) == 130
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "eval: window 1/2: 0.1 s so far"
    assert [line for line in lines if "interrupted" in line] == [
        f"moewire eval: interrupted; {out} holds only complete files (INTERRUPTED lists them)"]


def test_ctrl_c_keeps_a_directory_that_was_there_before(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(cli, "_sweep", _interrupt_after(out, write=False))
    assert cli.main(["study", "--model", "tiny", "--out", str(out)]) == 130
    assert out.is_dir() and list(out.iterdir()) == []
    assert f"nothing was written into {out}" in capsys.readouterr().err


TINY = ["study", "--model", "tiny", "--tokens", "16", "--calib-batches", "1",
        "--eval-batches", "1", "--dispatch", "fp8", "--combine", "nvfp4"]


@pytest.mark.slow
def test_a_study_refuses_an_earlier_runs_files_before_work_and_force_replaces_them(
        tmp_path, monkeypatch, capsys, patches_undone):
    import json

    from moewire.outputs import MANIFEST

    out = tmp_path / "out"
    assert cli.main([*TINY, "--out", str(out)]) == 0
    first = (out / "results.json").read_text()
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] and manifest["files"] == [
        "results.json", "error_heatmap.png", "frontier.png"]
    capsys.readouterr()
    built = []
    monkeypatch.setattr("moewire.study.runner.check_resources", lambda *a: built.append(1))
    assert cli.main([*TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out: {out} holds the files of an earlier run" in err and "--force" in err
    assert not built and (out / "results.json").read_text() == first
    monkeypatch.undo()
    (out / "notes.txt").write_text("mine")
    assert cli.main([*TINY, "--seed", "1", "--out", str(out), "--force"]) == 0
    assert "moewire study: --force: removed the earlier run's" in capsys.readouterr().err
    assert (out / "results.json").read_text() != first
    assert (out / "notes.txt").read_text() == "mine"  # not a moewire file: kept


def test_eval_passes_force_on(tmp_path, monkeypatch):
    seen = _captured_eval_config(monkeypatch)
    cli.main(["eval", str(tmp_path), "--force", "--out", str(tmp_path / "o")])
    assert seen["config"].force is True


# -- one vocabulary ---------------------------------------------------------------------------


def _captured_eval_config(monkeypatch):
    seen = {}

    def evaluate(checkpoint, config, **kwargs):
        seen["config"] = config
        raise KeyboardInterrupt

    monkeypatch.setattr("moewire.eval.evaluate", evaluate)
    return seen


def test_eval_takes_format_names_in_any_case_as_study_does(tmp_path, monkeypatch, capsys):
    seen = _captured_eval_config(monkeypatch)
    cli.main(["eval", str(tmp_path), "--pairs", "FP8:NVFP4", "--per-layer", "NvFp4:fp8",
              "--out", str(tmp_path / "o")])
    assert list(seen["config"].pairs) == [("fp8", "nvfp4")]
    assert seen["config"].per_layer == ("nvfp4", "fp8")


@pytest.mark.parametrize("command", ["study", "eval"])
@pytest.mark.parametrize(("given", "kernel", "deprecated"),
                         [("stand-in", "stand-in", False), ("Stand-In", "stand-in", False),
                          ("reference", "stand-in", True)],
                         ids=["stand-in", "any-case", "old-name"])
def test_both_commands_name_the_kernel_alike(command, given, kernel, deprecated, capsys):
    argv = [command, *(["ckpt"] if command == "eval" else []), "--kernel", given]
    assert cli.build_parser().parse_args(argv).kernel == kernel
    err = capsys.readouterr().err
    assert ("--kernel reference is deprecated; it is now called --kernel stand-in" in err) \
        == deprecated


def test_the_study_config_refuses_the_old_kernel_name_with_the_new_one():
    from moewire.study import StudyConfig
    from moewire.study.settings import validate

    with pytest.raises(ValueError, match="'reference' is now called 'stand-in'"):
        validate(StudyConfig(model="tiny", kernel="reference"))


def test_too_few_experts_are_refused_before_the_layer_is_built(monkeypatch, capsys):
    built = []
    monkeypatch.setattr("moewire.study.runner.check_resources", lambda *a: built.append(1))
    assert cli.main(["study", "--experts", "3", "--out", "/nonexistent/out"]) == 2
    captured = capsys.readouterr()
    assert "--experts: 3 experts are fewer than top-k" in captured.err
    assert "building" not in captured.out + captured.err
    assert not built


# -- progress -----------------------------------------------------------------------------------


def test_the_bar_shows_no_markup_and_log_lines_are_not_wrapped():
    from rich.console import Console

    buffer = io.StringIO()
    bar = cli._rich_bar(Console(file=buffer, force_terminal=True, width=60))
    line = "fp8:nvfp4 [w] " + "x" * 100
    with bar:
        progress = cli._eval_progress(bar)
        progress("baseline [1/2]", 1, 4)
        cli._bar_log(bar)(line)
        progress("mixed [b]recipe", 2, 4)
        # Any plain-text print above the bar (as the eval's log once was) redraws it alike.
        bar.console.print("a plain line", markup=False)
        progress("mixed [b]recipe", 3, 4)
    text = buffer.getvalue()
    assert "[progress.description]" not in text
    assert "baseline [1/2]" in text and "mixed [b]recipe" in text  # labels as written
    assert line + "\n" in text  # one line, as printed
