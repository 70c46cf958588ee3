"""The output directory of a run (``moewire eval --out``, ``moewire study --out``): only
complete files, and never one run's files beside another's.

- :func:`write_atomic`: a file is written to a temporary file in the same directory and
  renamed over the target (``os.replace``, atomic on POSIX and Windows): a reader, or a run
  stopped half way (Ctrl-C, a crash), sees the old file or the new one, never a part.
- :func:`prepare_output_dir`: before a run writes anything, a directory that holds another
  run's files is refused, or with ``force`` those files are removed (and the log says which).
  A run's files are the ones its manifest ``.moewire-run.json`` lists; a directory without
  a manifest (a run of an older moewire) counts the files of ``files`` (the names this kind
  of run writes). A file moewire did not write is never removed.
- :class:`OutputDir`: the directory a run writes into; each file is added to the manifest
  before it is written, so the manifest lists every file the run may have left.
- :func:`mark_interrupted`: a run stopped before its end writes the marker ``INTERRUPTED``
  beside its complete files and flags the manifest (or, having written nothing, leaves the
  directory as it found it).

Manifest (JSON): ``{"kind": "eval", "files": ["results.json", ...], "complete": bool,
"interrupted": bool, "started": ISO time}``.

Torch-free and imports nothing of moewire, so any command can use it before torch loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["INTERRUPTED", "MANIFEST", "OutputDir", "OutputDirError", "mark_interrupted",
           "prepare_output_dir", "write_atomic"]

MANIFEST = ".moewire-run.json"
INTERRUPTED = "INTERRUPTED"


class OutputDirError(ValueError):
    """A refused output directory: ``"<argument>: <cause>; <fix>"`` (the default error of
    :func:`prepare_output_dir`; a command passes its own, e.g. ``EvalError``).

    Attributes:
        argument: the flag, ``"--out"``.
    """

    def __init__(self, argument: str, message: str) -> None:
        self.argument = argument
        super().__init__(f"{argument}: {message}")


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (``str`` as UTF-8) to ``path`` atomically.

    The bytes go to a temporary file ``.<name>.<random>.tmp`` in the same directory (a rename
    is atomic only within one file system), are flushed to disk, and the file is renamed
    over ``path``; on any failure or interruption the temporary file is removed and
    ``path`` is untouched. The file gets the permissions a plain ``open(path, "w")`` gives
    (``0o666`` less the umask), not ``mkstemp``'s ``0o600``.

    Returns:
        ``path``, as a ``Path``.
    """
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _plain(name: Any) -> bool:
    """A file name inside the directory (a manifest from elsewhere may hold anything)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name)


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _previous_files(path: Path, files: Collection[str] | None) -> list[str]:
    """The files of an earlier run in ``path`` that are still there: its manifest's (and
    its ``INTERRUPTED`` marker), or without a manifest the names of ``files``."""
    manifest = _read_manifest(path)
    listed = manifest.get("files", []) if manifest is not None else list(files or ())
    names = {n for n in listed if _plain(n)} | {INTERRUPTED}
    return sorted(n for n in names if (path / n).is_file())


def _write_manifest(path: Path, doc: dict[str, Any]) -> None:
    write_atomic(path / MANIFEST, json.dumps(doc, indent=1))


@dataclass
class OutputDir:
    """The directory a run writes into (:func:`prepare_output_dir` makes it).

    Attributes:
        path: the directory.
        kind: the command (``"eval"``, ``"study"``).
        files: the files written so far (and the one being written), in order.
    """

    path: Path
    kind: str
    files: list[str]
    started: str

    def _manifest(self, **flags: bool) -> dict[str, Any]:
        return {"kind": self.kind, "files": list(self.files), "complete": False,
                "interrupted": False, "started": self.started, **flags}

    def write(self, name: str, data: str | bytes) -> Path:
        """Write the file ``name`` atomically (:func:`write_atomic`), listed in the manifest
        first: whatever stops the run, the manifest names every file it may have left."""
        if not _plain(name):
            raise ValueError(f"OutputDir.write: {name!r} is not a file name; pass a name "
                             "inside the directory")
        if name not in self.files:
            self.files.append(name)
            _write_manifest(self.path, self._manifest())
        return write_atomic(self.path / name, data)

    def complete(self) -> None:
        """Flag the manifest: the run ended and every listed file is its final version."""
        _write_manifest(self.path, self._manifest(complete=True))


def prepare_output_dir(path: str | os.PathLike, kind: str, files: Collection[str] | None,
                       force: bool, log: Callable[[str], None],
                       error: Callable[[str, str], Exception] = OutputDirError) -> OutputDir:
    """Make ``path`` the output directory of a new ``kind`` run, before it writes anything.

    Args:
        path: the directory (created with its parents).
        kind: the command, written into the manifest (``"eval"``).
        files: every name this kind of run may write (``{"results.json", "kl.png"}``): what
            counts as an earlier run's file in a directory without a manifest; ``None``: only
            a manifest tells.
        force: remove the earlier run's files instead of refusing.
        log: where the line naming the removed files goes.
        error: the command's error type, called ``error("--out", message)``.

    Returns:
        The :class:`OutputDir`, its manifest written (no file yet).

    Raises:
        ``error``: (``--out``) ``path`` holds files of an earlier run and ``force`` is off;
            or ``path`` is a file.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise error("--out", f"{path} exists and is not a directory; pass a directory (it is "
                    f"created if missing), e.g. --out moewire-{kind}")
    path.mkdir(parents=True, exist_ok=True)
    previous = _previous_files(path, files)
    if previous and not force:
        raise error("--out", f"{path} holds the files of an earlier run ({', '.join(previous)}), "
                    f"which this run would mix with its own; pass another --out, or --force to "
                    f"remove them first")
    if previous:
        for name in previous:
            (path / name).unlink()
        log(f"{kind}: --force: removed the earlier run's {', '.join(previous)} from {path}")
    out = OutputDir(path, kind, [], time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    _write_manifest(path, out._manifest())
    return out


def mark_interrupted(path: str | os.PathLike) -> Path | None:
    """Say in the output directory ``path`` that its run was interrupted.

    When the run had written files: the marker ``INTERRUPTED`` is written beside them and the
    manifest flagged; the files the manifest lists are complete (each was written
    atomically), the run's other files were never written. When it had written none: the
    manifest is removed, and the directory holds what it held before the run.

    Returns:
        The marker's path, or ``None`` when the run had written nothing.
    """
    path = Path(path)
    manifest = _read_manifest(path) or {"files": []}
    files = [n for n in manifest.get("files", []) if _plain(n)]
    done = [n for n in files if n != INTERRUPTED and (path / n).is_file()]
    if not done:
        (path / MANIFEST).unlink(missing_ok=True)
        return None
    if INTERRUPTED not in files:
        files.append(INTERRUPTED)
    _write_manifest(path, {**manifest, "files": files, "complete": False, "interrupted": True})
    return write_atomic(path / INTERRUPTED, (
        f"This run was interrupted at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}. "
        f"The files here are complete, each as last written: {', '.join(done)}; the run's "
        "other files were not written.\n"))
