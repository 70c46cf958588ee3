"""Curated mutation check: every mutant of moewire's critical spots must fail its tests.

Usage (from the repository root; ``make mutants`` runs it with the project's venv)::

    python scripts/mutants.py                 # every mutant in scripts/mutants.toml
    python scripts/mutants.py -k kernel       # only mutants whose name contains "kernel"
    python scripts/mutants.py --spot "time model" --spot "hook order"   # only these spots
    python scripts/mutants.py --list          # print the mutants and exit
    python scripts/mutants.py --check         # only check the list still matches the code

The repository's files (tracked and untracked, not ignored: ``git ls-files -co
--exclude-standard``) are copied once into a scratch folder; the working tree is never
touched. The named tests first run there unmutated (they must pass; the suites that name only
tests run together, in one process). Then each mutant (``--jobs`` at once, each worker with a
scratch copy of its own) has its edits applied to its copy, its tests run with ``-x`` (the
scratch ``src`` first on ``PYTHONPATH``), and the file is restored. A mutant whose tests fail is
*caught*; one whose tests pass *survived*; a run that cannot collect or errors otherwise is
an *error*; a run past the time limit counts as caught (the mutant broke the tests, by
hanging them) and is marked so.

Exit status: 0 when every mutant was caught, 1 when one survived or errored, 2 when the
mutation list no longer matches the code (an ``original`` text not found exactly once) or
the unmutated tests fail.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
LIST = Path(__file__).resolve().with_name("mutants.toml")


@dataclass(frozen=True)
class Mutant:
    name: str
    spot: str
    file: str
    tests: tuple[str, ...]
    edits: tuple[tuple[str, str], ...]

    def apply(self, text: str) -> str:
        """``text`` with every edit applied in order; each original must occur once."""
        for original, replacement in self.edits:
            count = text.count(original)
            if count != 1:
                raise LookupError(
                    f"mutant {self.name!r}: its original text occurs {count} times in "
                    f"{self.file} (must be exactly once); update scripts/mutants.toml to the "
                    f"current code of this spot:\n{original}"
                )
            text = text.replace(original, replacement)
        return text


def load(path: Path = LIST) -> list[Mutant]:
    with path.open("rb") as f:
        data = tomllib.load(f)
    mutants = []
    for entry in data.get("mutant", []):
        edits = tuple((e["original"], e["replacement"]) for e in entry["edit"])
        mutants.append(
            Mutant(entry["name"], entry["spot"], entry["file"], tuple(entry["tests"]), edits)
        )
    names = [m.name for m in mutants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{path}: mutant names must be unique, repeated: {duplicates}")
    return mutants


def scratch_copy(dest: Path) -> None:
    """Copy the working tree's files (tracked + untracked, not ignored) into ``dest``."""
    listing = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode()
    for rel in filter(None, listing.split("\0")):
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree but still tracked
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _env(scratch: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(scratch / "src"), str(scratch)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_tests(scratch: Path, tests: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    """pytest -x on ``tests`` in ``scratch``: (exit code or None on timeout, output tail)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(
            cmd, cwd=scratch, env=_env(scratch), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None, ""
    return done.returncode, (done.stdout + done.stderr)[-3000:]


def unmutated_runs(suites: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The pytest runs that show every suite passes on the unmutated code: the suites that
    name only tests (paths or node ids) together in one run, since the suite passes in any
    order and together (``make test``), the ``-k`` suites of the same paths together, and
    any other suite with options alone. Few processes instead of one per suite: a process
    start imports torch and transformers."""
    plain = sorted({t for tests in suites if not _has_options(tests) for t in tests})
    # Suites whose one option is ``-k EXPR`` on the same paths run as one process with the
    # expressions or-ed (the tests each selects, together); any other option runs alone.
    by_paths: dict[tuple[str, ...], list[str]] = {}
    alone = []
    for tests in suites:
        if not _has_options(tests):
            continue
        if len(tests) >= 3 and tests[-2] == "-k" and not _has_options(tests[:-2]):
            by_paths.setdefault(tests[:-2], []).append(tests[-1])
        else:
            alone.append(tests)
    merged = [(*paths, "-k", " or ".join(f"({e})" for e in sorted(set(exprs))))
              for paths, exprs in sorted(by_paths.items())]
    return ([tuple(plain)] if plain else []) + merged + alone


def _has_options(tests: tuple[str, ...]) -> bool:
    return any(arg.startswith("-") for arg in tests)


def _first_failure(output: str) -> str:
    """The first ``FAILED`` line of pytest's summary (the test that caught the mutant)."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line[:220]
    return ""


def check_import_path(scratch: Path) -> None:
    """The scratch copy's moewire must be the one imported (not an installed one)."""
    found = subprocess.run(
        [sys.executable, "-c", "import moewire; print(moewire.__file__)"],
        cwd=scratch, env=_env(scratch), capture_output=True, text=True, check=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(scratch.resolve()):
        raise RuntimeError(
            f"mutants: moewire imports from {found}, not from the scratch copy {scratch}; "
            "run with a Python whose moewire is not installed ahead of PYTHONPATH"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="select", action="append",
                        help="only mutants whose name contains this (repeatable: any of them)")
    parser.add_argument("--spot", action="append",
                        help="only mutants of this spot (repeatable: any of them)")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument(
        "--check", action="store_true", help="only check that every mutant matches the code"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per test run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="mutants judged at once, each worker in its own scratch copy "
                             "(default: 2, or 1 on one CPU)")
    args = parser.parse_args(argv)

    mutants = load()
    if args.select:
        mutants = [m for m in mutants if any(k in m.name for k in args.select)]
    if args.spot:
        mutants = [m for m in mutants if m.spot in args.spot]
    if not mutants:
        print(f"mutants: no mutant matches -k {args.select!r} --spot {args.spot!r}",
              file=sys.stderr)
        return 2
    if args.list:
        for m in mutants:
            print(f"{m.name:40s} {m.spot:26s} {m.file}  ->  {' '.join(m.tests)}")
        return 0

    try:
        for m in mutants:  # every mutant must still match the code before anything runs
            m.apply((ROOT / m.file).read_text())
    except (LookupError, FileNotFoundError) as exc:
        print(f"mutants: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{len(mutants)} mutants match the code")
        return 0

    jobs = max(1, min(args.jobs, len(mutants)))
    scratches = [Path(tempfile.mkdtemp(prefix="moewire-mutants-")) for _ in range(jobs)]
    results: list[dict | None] = [None] * len(mutants)
    try:
        for scratch in scratches:
            scratch_copy(scratch)
            check_import_path(scratch)
        suites = sorted({m.tests for m in mutants})
        free: queue.Queue[Path] = queue.Queue()
        for scratch in scratches:
            free.put(scratch)

        def unmutated(tests: tuple[str, ...]) -> tuple[tuple[str, ...], int | None, str]:
            scratch = free.get()
            try:
                return (tests, *run_tests(scratch, tests, args.timeout * len(tests)))
            finally:
                free.put(scratch)

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            runs = list(pool.map(unmutated, unmutated_runs(suites)))
        for tests, code, tail in runs:
            if code != 0:
                print(tail, file=sys.stderr)
                print(
                    f"mutants: the unmutated tests {' '.join(tests)} do not pass (exit {code}); "
                    "fix them before judging mutants",
                    file=sys.stderr,
                )
                return 2
        print(f"{len(mutants)} mutants; unmutated tests pass ({len(suites)} suites); "
              f"{jobs} at once", flush=True)
        printing = threading.Lock()

        def judge(index: int) -> None:
            m = mutants[index]
            scratch = free.get()
            try:
                results[index] = _judge(m, scratch, args.timeout, printing)
            finally:
                free.put(scratch)

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            for future in [pool.submit(judge, i) for i in range(len(mutants))]:
                future.result()
    finally:
        for scratch in scratches:
            if args.keep:
                print(f"scratch copy kept in {scratch}")
            else:
                shutil.rmtree(scratch, ignore_errors=True)

    done = [r for r in results if r is not None]
    caught = sum(r["result"].startswith("caught") for r in done)
    print(f"{caught} of {len(done)} mutants caught")
    if args.json:
        args.json.write_text(json.dumps(done, indent=2) + "\n")
    return 0 if caught == len(done) == len(mutants) else 1


def _judge(m: Mutant, scratch: Path, timeout: float, printing: threading.Lock) -> dict:
    """Apply ``m`` in ``scratch`` (which this worker alone uses), run its tests, restore the
    file; its result row, printed as it ends."""
    path = scratch / m.file
    original = path.read_text()
    path.write_text(m.apply(original))
    start = time.monotonic()
    try:
        code, tail = run_tests(scratch, m.tests, timeout)
    finally:
        path.write_text(original)
    seconds = time.monotonic() - start
    if code is None:
        verdict = "caught (timeout)"
    elif code == 1:
        verdict = "caught"
    elif code == 0:
        verdict = "SURVIVED"
    else:
        verdict = f"ERROR (pytest exit {code})"
    why = _first_failure(tail) if code == 1 else ""
    with printing:
        if verdict.startswith("ERROR"):
            print(tail, file=sys.stderr)
        print(f"{m.name:40s} {m.spot:26s} {verdict:18s} {seconds:6.1f}s", flush=True)
        if why:
            print(f"    {why}", flush=True)
    return {"name": m.name, "spot": m.spot, "file": m.file, "tests": list(m.tests),
            "result": verdict, "seconds": round(seconds, 1), "failed": why}


if __name__ == "__main__":
    sys.exit(main())
