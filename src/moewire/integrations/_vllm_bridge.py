"""Deprecated alias of :mod:`moewire.integrations.vllm.bridge` (``_moved`` says why)."""

from moewire.integrations._moved import alias
from moewire.integrations.vllm import bridge

alias(__name__, bridge)
