"""Deprecated alias of :mod:`moewire.integrations.vllm.groups` (``moewire._moved`` says why)."""

from moewire._moved import alias
from moewire.integrations.vllm import groups

alias(__name__, groups)
