"""Deprecated alias of :mod:`moewire.integrations.sglang.sites` (``moewire._moved`` says why)."""

from moewire._moved import alias
from moewire.integrations.sglang import sites

alias(__name__, sites)
