"""Wire formats: what a number becomes on the wire.

``moewire.formats.get(name)`` returns the registered :class:`WireFormat`;
``moewire.fake_quant(x, name, amax=None)`` applies it.
"""

from moewire.formats.base import WireFormat, get, names, register

__all__ = ["WireFormat", "fake_quant", "get", "names", "register"]


def fake_quant(x, name, amax=None):
    """Fake-quantize ``x`` in the wire format ``name``; returns a tensor of ``x.dtype``."""
    return get(name).qdq(x, amax)
