"""Deprecated alias of :mod:`moewire.integrations.vllm.bridge` (``moewire._moved`` says why)."""

from moewire._moved import alias
from moewire.integrations.vllm import bridge

alias(__name__, bridge)
