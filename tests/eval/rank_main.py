"""``python -m moewire`` for the multi-rank tests, launched by ``torchrun``: an audit hook
records every path this rank opens for writing or creates (``open`` with a writing mode or
flag, ``os.mkdir``), written at exit to ``$MOEWIRE_TEST_WRITES/rank{RANK}.json``; then the
command runs unchanged."""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND


def _record(written: list[str]):
    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if path is not None and (any(c in (mode or "") for c in "wax+")
                                     or (mode is None and flags & _WRITING)):
                written.append(os.fsdecode(path) if not isinstance(path, int) else "")
        elif event == "os.mkdir":
            written.append(os.fsdecode(args[0]))

    return hook


if __name__ == "__main__":
    written: list[str] = []
    target = Path(os.environ["MOEWIRE_TEST_WRITES"]) / f"rank{os.environ.get('RANK', '0')}.json"
    atexit.register(lambda: target.write_text(json.dumps(list(written))))
    sys.addaudithook(_record(written))
    from moewire.cli import main

    sys.exit(main())
