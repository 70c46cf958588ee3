"""The one error type of the study's argument checks."""

from __future__ import annotations


class StudyArgumentError(ValueError):
    """A bad ``moewire study`` argument: names the argument, the cause and the fix.

    The CLI prints ``moewire study: error: <argument>: <message>`` and exits with code 2
    (argparse's code for bad usage); called from Python it is a plain ``ValueError``.

    Attributes:
        argument: the command-line flag, e.g. ``"--dispatch"``.
    """

    def __init__(self, argument: str, message: str) -> None:
        self.argument = argument
        super().__init__(f"{argument}: {message}")
