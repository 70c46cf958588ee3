"""Deprecated alias of :mod:`moewire.integrations.vllm.worker` (``moewire._moved`` says why)."""

from moewire._moved import alias
from moewire.integrations.vllm import worker

alias(__name__, worker)
