"""Deprecated alias of :mod:`moewire.integrations.sglang.sites` (``_moved`` says why)."""

from moewire.integrations._moved import alias
from moewire.integrations.sglang import sites

alias(__name__, sites)
