"""No reference to the project's planning sheet or to issue numbers in what the repository
ships or documents (sources, docs, tests, benchmarks and their READMEs, scripts, the
Makefile, the README, pyproject.toml): each fact is stated where it is used, with its real
source. Raw program output kept as data (``*.log``, ``*.json``, ``*.xml``) is not text
anyone maintains, and CHANGELOG.md is the project's history; neither is checked."""

from pathlib import Path

import pytest

from internal_refs import INTERNAL_REFERENCE

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("src", "docs", "tests", "benchmarks", "scripts", "Makefile", "README.md",
           "pyproject.toml")
DATA_SUFFIXES = {".log", ".json", ".xml", ".png", ".pt", ".safetensors", ".npz", ".pyc"}
#: The files that must spell the pattern and its examples out.
PATTERN_HOMES = {Path("tests") / "internal_refs.py", Path("tests") / Path(__file__).name}


def _files() -> list[Path]:
    out = []
    for name in CHECKED:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        for p in candidates:
            if (p.is_file() and p.suffix not in DATA_SUFFIXES and "__pycache__" not in p.parts
                    and p.relative_to(ROOT) not in PATTERN_HOMES):
                out.append(p)
    return out


def _hits(text: str) -> list[str]:
    return [f"{n}: {line.strip()[:120]}" for n, line in enumerate(text.splitlines(), 1)
            if INTERNAL_REFERENCE.search(line)]


def test_no_file_refers_to_the_planning_sheet_or_an_issue_number():
    found = {}
    files = _files()
    assert len(files) > 100  # the walk found the repository
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary data
        hits = _hits(text)
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, "state the fact and its real source instead:\n" + "\n".join(
        f"{f}:{h}" for f, hs in found.items() for h in hs)


@pytest.mark.parametrize(
    "text, flagged",
    [
        ("the shapes of SPEC 1.4", True),
        ("see ../shared/SPEC.md", True),
        ("SPEC's definition", True),
        ("(issue 15)", True),
        ("issues 26-30 merged", True),
        ("Issue 28: the time estimate", True),
        ("fixed in issue #12", True),
        ("DeepGEMM PR #323 at 8ddf7f9", False),
        ("https://github.com/vllm-project/vllm/issues/1234", False),
        ("_SPEC = importlib.util.spec_from_file_location(name, path)", False),
        ("SPECIAL cases", False),
        ("77% issue rate; warps issued per cycle", False),
        ("ModelOpt PR #2767, on top of #2660", False),
    ],
    ids=["spec-section", "spec-path", "spec-possessive", "issue-paren", "issues-range",
         "issue-capital", "issue-hash", "upstream-pr", "upstream-issue-url", "identifier",
         "longer-word", "issue-rate", "modelopt-pr"],
)
def test_the_pattern_is_tight(text, flagged):
    assert bool(INTERNAL_REFERENCE.search(text)) is flagged
