"""Deprecated alias of :mod:`moewire.quantizer.config` (``moewire._moved`` says why)."""

from moewire._moved import alias
from moewire.quantizer import config

alias(__name__, config)
