"""The pip command that installs one of moewire's extras (``pyproject.toml``'s
``[project.optional-dependencies]``), for refusals that name a missing package.

moewire is installed from its clone, not from a package index, so ``pip install
'moewire[eval]'`` would fail. When this module sits in a clone (``<root>/src/moewire``, with
``<root>/pyproject.toml``) the command installs that clone with the extra; otherwise it names
the packages themselves.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

__all__ = ["install_command"]

#: What each extra brings, for a moewire installed without its clone at hand.
PACKAGES = {
    "gpu": "triton",
    "transformers": "'transformers>=5.23,<5.24' accelerate",
    "eval": "lm-eval==0.4.13 'accelerate>=0.26' 'transformers>=5.23,<5.24'",
}


def install_command(extra: str) -> str:
    """``<this python> -m pip install ...`` for ``extra`` ("gpu", "transformers", "eval")."""
    if extra not in PACKAGES:
        raise ValueError(f"install_command: {extra!r} is not one of moewire's extras "
                         f"({', '.join(PACKAGES)}); add it to PACKAGES and pyproject.toml")
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "src" / "moewire").is_dir():
        what = "-e " + shlex.quote(f"{root}[{extra}]")
    else:
        what = PACKAGES[extra]
    return f"{sys.executable} -m pip install {what}"
