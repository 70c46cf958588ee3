"""The docs' commands as written: every ``moewire`` command line of README.md and docs/
parses with the CLI's own parser (a renamed flag, a kernel name or a bound the CLI refuses
fails here), and the shell blocks marked ``<!-- docs-test: run -->`` run, verbatim, in a
fresh directory and exit 0 (the README's and docs/eval.md's first run: a checkpoint from
``moewire checkpoint`` and ``moewire eval`` on it). And the wording rule: the docs and the
set-up files say what hardware a claim needs, not which machine someone had."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from moewire import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_MARK = "<!-- docs-test: run -->"
_BLOCK = re.compile(r"(?P<mark><!-- docs-test: run -->\n)?```bash\n(?P<body>.*?)```", re.S)


def _blocks(path: Path) -> list[tuple[bool, str]]:
    """``(marked to run, body)`` of each bash block of ``path``."""
    return [(m["mark"] is not None, m["body"]) for m in _BLOCK.finditer(path.read_text())]


def _commands(body: str) -> list[list[str]]:
    """The shell words of each command of a block: continuations joined, comments and
    leading ``NAME=value`` assignments dropped."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words:
            commands.append(words)
    return commands


def _moewire_argv(words: list[str]) -> list[str] | None:
    """The arguments after ``moewire`` (``moewire ...``, ``python -m moewire ...``,
    ``torchrun ... -m moewire ...``), or ``None`` for another command."""
    if words[0] == "moewire":
        return words[1:]
    if "-m" in words and words.index("-m") + 1 < len(words) and \
            words[words.index("-m") + 1] == "moewire":
        return words[words.index("-m") + 2:]
    return None


def _docs_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOCS:
        for _, body in _blocks(path):
            for words in _commands(body):
                argv = _moewire_argv(words)
                # "[the same arguments]" and "..." stand for what the text around says.
                if argv is not None and not any("[" in w or w == "..." for w in argv):
                    found.append((f"{path.name}: moewire {' '.join(argv)}", argv))
    return found


COMMANDS = _docs_commands()


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) >= 15
    assert any(argv[0] == "checkpoint" for _, argv in COMMANDS)


@pytest.mark.parametrize("argv", [argv for _, argv in COMMANDS],
                         ids=[name for name, _ in COMMANDS])
def test_every_docs_command_parses(argv, capsys):
    if "--help" in argv or "--version" in argv:
        pytest.skip("prints and exits")
    cli.build_parser().parse_args(argv)
    assert "deprecated" not in capsys.readouterr().err  # the docs use the current names


MARKED = [(f"{path.name}-{n}", body) for path in DOCS
          for n, (marked, body) in enumerate(_blocks(path)) if marked]
#: Each marked block once (the README's first run and docs/eval.md's are the same block).
RUNS = list({body: (name, body) for name, body in reversed(MARKED)}.values())


def test_the_first_runs_are_marked():
    assert {name.split("-")[0] for name, _ in MARKED} >= {"README.md", "eval.md"}


@pytest.mark.slow
@pytest.mark.parametrize("body", [body for _, body in RUNS], ids=[name for name, _ in RUNS])
def test_a_marked_block_runs_as_written(body, tmp_path):
    pytest.importorskip("transformers")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert list(tmp_path.glob("*/results.json")), sorted(p.name for p in tmp_path.iterdir())


#: Words that name someone's machine instead of the hardware a claim needs.
MACHINE_WORDS = re.compile(
    r"project machines?|the H200 machine|this machine|not measured here|on the H200\b|"
    r"free 2-core machine|neither the H200", re.I)
#: The files whose wording this rule covers: the set-up files, the docs a new user reads
#: first, and the tests' skip reasons.
WORDED = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml",
          *(ROOT / "docs" / f for f in ("eval.md", "study.md", "usage.md", "reference.md",
                                        "recipes.md", "real-kernel.md", "architecture.md",
                                        "modelopt.md", "performance.md"))]


@pytest.mark.parametrize("path", WORDED, ids=[p.name for p in WORDED])
def test_the_docs_name_hardware_not_a_machine(path):
    found = [(n, line.strip()) for n, line in enumerate(path.read_text().splitlines(), 1)
             if MACHINE_WORDS.search(line)]
    assert found == [], f"{path.name}: say what hardware the claim needs: {found}"


def test_no_file_of_the_repository_names_a_machine():
    """Every text file git tracks (code, tests, benchmarks, docs, set-up), this rule's own
    file and the changelog's history aside."""
    listed = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.toml", "*.sh", "*.yaml",
                             "Makefile"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    skip = {"CHANGELOG.md", "tests/test_docs_commands.py"}
    found = [(name, n, line.strip()[:100]) for name in listed.stdout.split()
             if name not in skip and (ROOT / name).is_file()
             for n, line in enumerate((ROOT / name).read_text().splitlines(), 1)
             if MACHINE_WORDS.search(line)]
    assert found == [], f"say what hardware the claim needs: {found}"


def test_skip_reasons_name_hardware_not_a_machine():
    reason = re.compile(r"(?:skip\(|reason=)\s*[\"'f](.*?)[\"']\s*[,)]", re.S)
    found = [(str(p.relative_to(ROOT)), m[1]) for p in (ROOT / "tests").rglob("*.py")
             for m in reason.finditer(p.read_text()) if MACHINE_WORDS.search(m[1])]
    assert found == []


def test_the_readme_sets_up_what_the_commands_need():
    """The set-up steps a fresh clone needs: moewire from the clone (not the package index),
    the demo venv activated, torch's CPU wheel named, one time for `make test-fast`."""
    readme, makefile = (ROOT / "README.md").read_text(), (ROOT / "Makefile").read_text()
    assert "source .venv-demo/bin/activate" in readme
    assert "download.pytorch.org/whl/cpu" in readme
    assert re.search(r"pip install [\"']?moewire\[", readme + (ROOT / "docs/eval.md").read_text()) \
        is None
    fast = re.search(r"test-fast .*?\n.*?(under \d+ min)", readme)
    assert fast is not None and f"({fast[1]}utes on 2 cores)" in makefile


def test_the_eval_docs_say_what_layer_rel_l2_includes():
    row = next(line for line in (ROOT / "docs/eval.md").read_text().splitlines()
               if line.startswith("| `layer_rel_l2`"))
    assert "carried in" in row and "--per-layer" in row
