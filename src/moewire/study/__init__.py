"""``moewire study``: which wire format can my MoE layer afford?

Builds one MoE layer on the stand-in Mega-MoE kernel, quantizes it with every dispatch x
combine pair of wire formats through ``moewire.quantize``, calibrates, evaluates on
held-out batches and reports the layer-output error against the unquantized layer with
the bytes on the wire per token and the estimated dispatch and combine time on an
interconnect. See ``docs/study.md``.

- :func:`run_study` (``StudyConfig`` -> the ``results.json`` document),
- :func:`moewire.study.report.write_all` (JSON and plots),
- :func:`error_metrics` (relative L2, SQNR, cosine, max abs error),
- :data:`PRESETS` (model shapes),
- :data:`INTERCONNECTS` and :func:`comm_time` (the communication-time model,
  :mod:`moewire.study.comm`).
"""

from __future__ import annotations

import importlib

# Lazy, so that `moewire --help` and argument errors answer before torch is imported.
_LAZY = {
    "PRESETS": "moewire.study.presets",
    "ModelPreset": "moewire.study.presets",
    "StudyArgumentError": "moewire.study.errors",
    "INTERCONNECTS": "moewire.study.comm",
    "Interconnect": "moewire.study.comm",
    "comm_time": "moewire.study.comm",
    "StudyConfig": "moewire.study.settings",
    "parse_formats": "moewire.study.settings",
    "validate": "moewire.study.settings",
    "ErrorMetrics": "moewire.study.metrics",
    "error_metrics": "moewire.study.metrics",
    "run_study": "moewire.study.runner",
    "WireCost": "moewire.study.wire",
    "wire_cost": "moewire.study.wire",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moewire.study' has no attribute {name!r}")
