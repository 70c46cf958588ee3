"""The checks of the paths a command reads and writes, shared by ``moewire study`` and
``moewire eval``: each names the flag, the cause and the fix."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from moewire.study.errors import StudyArgumentError

__all__ = ["existing_file", "writable_dir"]


def existing_file(path: str | os.PathLike, flag: str, wanted: str) -> Path:
    """``path`` as a ``Path``, if it is a file.

    Args:
        path: the file a flag names; flag: that flag (``"--from"``).
        wanted: what to pass instead, for the message (``"the results.json of a study"``).

    Raises:
        StudyArgumentError: (``flag``) ``path`` does not exist or is not a file.
    """
    path = Path(path)
    if not path.is_file():
        raise StudyArgumentError(flag, f"{path} does not exist or is not a file; pass {wanted}")
    return path


def writable_dir(out: str | os.PathLike, error: Callable[[str, str], Exception],
                 example: str) -> Path:
    """Create ``--out`` (with parents) and write a probe file there, before any work.

    Args:
        out: the directory; error: the command's error type, called ``error("--out",
            message)``; example: a directory name the message suggests (``"moewire-study"``).

    Returns:
        The directory, as a ``Path``.

    Raises:
        ``error``: ``--out`` is an existing file, or cannot be created or written.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise error("--out", f"{path} exists and is not a directory; pass a directory (it is "
                    f"created if missing), e.g. --out {example}")
    probe = path / ".moewire-write-check"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise error("--out", f"cannot write into {path} ({exc.strerror or exc}); pass a "
                    "directory you can write to") from None
    return path
