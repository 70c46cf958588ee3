"""Deprecated alias of :mod:`moewire.integrations.vllm.worker` (``_moved`` says why)."""

from moewire.integrations._moved import alias
from moewire.integrations.vllm import worker

alias(__name__, worker)
