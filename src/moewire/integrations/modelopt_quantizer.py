"""Deprecated alias of :mod:`moewire.integrations.modelopt.quantizer` (see ``moewire._moved``)."""

from moewire._moved import alias
from moewire.integrations.modelopt import quantizer

alias(__name__, quantizer)
