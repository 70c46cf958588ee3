"""What the ``moewire`` command prints for a user's mistakes: clean warnings, flags that
agree with what is accepted, --ranks against --ep-size, no internal references."""

import pytest

from internal_refs import INTERNAL_REFERENCE
from moewire import cli
from moewire.study.errors import StudyArgumentError


def test_the_tokens_warning_is_one_clean_line(monkeypatch, tmp_path, capsys):
    """The real warning of a long CPU run, without a category or a source line."""
    from moewire.study import layer, runner

    def stop_after_the_checks(cfg, progress=None):
        layer.check_resources(cfg)
        raise StudyArgumentError("--tokens", "stopped by the test")

    monkeypatch.setattr(runner, "run_study", stop_after_the_checks)
    code = cli.main(["study", "--model", "tiny", "--tokens", "4096", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "warning" in line]
    assert len(warning) == 1
    assert warning[0].startswith("moewire study: warning: --tokens 4096 on the CPU")
    assert "RuntimeWarning" not in err and "warnings.warn" not in err and ".py:" not in err


@pytest.mark.parametrize("value", ["0", "-5", "inf", "x"], ids=["zero", "negative", "inf",
                                                              "text"])
def test_link_gbps_says_what_it_accepts(value, capsys):
    assert cli.main(["study", f"--link-gbps={value}"]) == 2
    err = capsys.readouterr().err
    assert "--link-gbps" in err and "> 0" in err and ">= 0" not in err


@pytest.mark.parametrize("value", ["0", "-1"], ids=["zero", "negative"])
def test_a_budget_must_be_positive(value, capsys):
    assert cli.main(["study", f"--budget={value}"]) == 2
    assert "--budget" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["5", "1.01"], ids=["five", "just-above-one"])
def test_a_budget_is_a_fraction(value, capsys):
    """``--budget 5`` would be a relative L2 error of 500%: refused, saying what it is."""
    assert cli.main(["study", f"--budget={value}"]) == 2
    err = capsys.readouterr().err
    assert (f"argument --budget: is a fraction (a relative L2 error: 0.05 is 5%), at most 1, "
            f"got {value}; for {value}% pass {float(value) / 100:g}") in err


def test_the_terminal_bar_shows_the_time_to_go():
    import io

    from rich.console import Console
    from rich.progress import TimeRemainingColumn

    bar = cli._rich_bar(Console(file=io.StringIO()))
    assert any(isinstance(c, TimeRemainingColumn) for c in bar.columns)


def test_both_budgets_at_once_are_refused(capsys):
    assert cli.main(["study", "--budget", "0.01", "--budget-sqnr", "40"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_ranks_and_ep_size_that_disagree_are_refused(tmp_path, capsys):
    code = cli.main(["study", "--model", "tiny", "--tokens", "64", "--ranks", "4",
                     "--ep-size", "8", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "--ranks 4 and --ep-size 8 disagree" in err and "pass the same number" in err


def test_help_tells_ranks_from_ep_size(capsys):
    assert cli.main(["study", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "error sweep simulates" in text and "time estimate" in text
    assert "Not --ranks" in text


@pytest.mark.parametrize("argv", [["study", "--help"], ["formats"], ["--help"]],
                         ids=["study-help", "formats", "help"])
def test_the_command_prints_no_internal_reference(argv, capsys):
    cli.main(argv)
    text = capsys.readouterr().out
    assert INTERNAL_REFERENCE.search(text) is None
