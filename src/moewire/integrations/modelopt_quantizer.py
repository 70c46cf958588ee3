"""Deprecated alias of :mod:`moewire.integrations.modelopt.quantizer` (``_moved`` says why)."""

from moewire.integrations._moved import alias
from moewire.integrations.modelopt import quantizer

alias(__name__, quantizer)
