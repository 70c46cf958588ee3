"""moewire.outputs: atomic files, the refusal of a directory holding another run's files,
``force`` removing exactly that run's files, and the interruption marker."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from moewire.outputs import (
    INTERRUPTED,
    MANIFEST,
    OutputDirError,
    mark_interrupted,
    prepare_output_dir,
    write_atomic,
)

EVAL_FILES = {"results.json", "kl.png", "mixed_recipe.yaml"}


def _manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def test_write_atomic_writes_text_and_bytes_and_leaves_no_temporary(tmp_path):
    write_atomic(tmp_path / "a.txt", "héllo")
    write_atomic(tmp_path / "b.bin", b"\x00\xff")
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\xff"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin"]
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o666 & ~mask


def test_write_atomic_interrupted_keeps_the_old_file(tmp_path, monkeypatch):
    """A KeyboardInterrupt between the write and the rename leaves the old file whole and
    no temporary file behind."""
    target = tmp_path / "results.json"
    target.write_text("old")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_fresh_directory_gets_a_manifest_listing_each_file_written(tmp_path):
    out = prepare_output_dir(tmp_path / "new" / "dir", "eval", EVAL_FILES, False, print)
    assert _manifest(out.path) | {"started": None} == {
        "kind": "eval", "files": [], "complete": False, "interrupted": False, "started": None}
    out.write("results.json", "{}")
    out.write("kl.png", b"png")
    out.write("results.json", '{"a": 1}')
    assert _manifest(out.path)["files"] == ["results.json", "kl.png"]
    out.complete()
    assert _manifest(out.path)["complete"] is True


def test_unrelated_files_are_neither_refused_nor_removed(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    prepare_output_dir(tmp_path, "eval", EVAL_FILES, True, print)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("manifest", [True, False], ids=["with-manifest", "older-run-no-manifest"])
def test_earlier_run_is_refused_without_force(tmp_path, manifest):
    if manifest:
        prepare_output_dir(tmp_path, "eval", EVAL_FILES, False, print).write("other.csv", "x")
    else:
        (tmp_path / "mixed_recipe.yaml").write_text("quant_cfg: []")
    with pytest.raises(OutputDirError, match=r"^--out: .*earlier run \((other.csv|mixed_recipe"
                       r"\.yaml)\).*--force"):
        prepare_output_dir(tmp_path, "eval", EVAL_FILES, False, print)


def test_force_removes_exactly_the_earlier_runs_files(tmp_path):
    """The earlier run wrote results.json and mixed_recipe.yaml; the user added notes.txt.
    With force, the new run starts from a directory without the earlier run's files (none
    survives next to the new ones), the user's file stays, and the log names what went."""
    first = prepare_output_dir(tmp_path, "eval", EVAL_FILES, False, print)
    first.write("results.json", "{}")
    first.write("mixed_recipe.yaml", "quant_cfg: []")
    (tmp_path / "notes.txt").write_text("mine")
    lines: list[str] = []
    second = prepare_output_dir(tmp_path, "eval", EVAL_FILES, True, lines.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "notes.txt"]
    assert lines == [f"eval: --force: removed the earlier run's mixed_recipe.yaml, results.json "
                     f"from {tmp_path}"]
    second.write("results.json", "{}")
    assert _manifest(tmp_path)["files"] == ["results.json"]


def test_manifest_names_outside_the_directory_are_never_removed(tmp_path):
    outside = tmp_path / "keep.txt"
    outside.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    (run / MANIFEST).write_text(json.dumps({"kind": "eval", "files": ["../keep.txt", "/etc"]}))
    prepare_output_dir(run, "eval", EVAL_FILES, True, print)
    assert outside.read_text() == "keep"


def test_a_file_is_refused_as_the_directory(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"^--out: .* is not a directory"):
        prepare_output_dir(tmp_path / "f", "eval", None, False, print)


def test_the_commands_error_type_is_raised(tmp_path):
    class CommandError(ValueError):
        def __init__(self, argument, message):
            super().__init__(f"{argument}: {message}")

    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(CommandError):
        prepare_output_dir(tmp_path, "eval", EVAL_FILES, False, print, error=CommandError)


def test_mark_interrupted_writes_the_marker_and_a_forced_run_removes_it(tmp_path):
    out = prepare_output_dir(tmp_path, "eval", EVAL_FILES, False, print)
    out.write("results.json", "{}")
    marker = mark_interrupted(tmp_path)
    assert marker == tmp_path / INTERRUPTED
    assert "results.json" in marker.read_text()
    manifest = _manifest(tmp_path)
    assert manifest["interrupted"] is True and manifest["complete"] is False
    assert manifest["files"] == ["results.json", INTERRUPTED]
    with pytest.raises(OutputDirError, match="INTERRUPTED"):
        prepare_output_dir(tmp_path, "eval", EVAL_FILES, False, print)
    prepare_output_dir(tmp_path, "eval", EVAL_FILES, True, print)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST]


def test_mark_interrupted_before_any_file_leaves_the_directory_as_it_was(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    prepare_output_dir(tmp_path, "eval", EVAL_FILES, False, print)
    assert mark_interrupted(tmp_path) is None
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
