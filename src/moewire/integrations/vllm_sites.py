"""Deprecated alias of :mod:`moewire.integrations.vllm.sites` (``_moved`` says why)."""

from moewire.integrations._moved import alias
from moewire.integrations.vllm import sites

alias(__name__, sites)
