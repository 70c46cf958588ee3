"""Deprecated alias of :mod:`moewire.quantizer.contract` (``moewire._moved`` says why)."""

from moewire._moved import alias
from moewire.quantizer import contract

alias(__name__, contract)
