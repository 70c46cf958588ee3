"""Deprecated alias of :mod:`moewire.integrations.vllm.sites` (``moewire._moved`` says why)."""

from moewire._moved import alias
from moewire.integrations.vllm import sites

alias(__name__, sites)
