"""Deprecated alias of :mod:`moewire.integrations.vllm.groups` (``_moved`` says why)."""

from moewire.integrations._moved import alias
from moewire.integrations.vllm import groups

alias(__name__, groups)
