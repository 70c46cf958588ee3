"""``moewire study``: which wire format can my MoE layer afford?

Builds one MoE layer on the stand-in Mega-MoE kernel, quantizes it with every dispatch x
combine pair of wire formats through ``moewire.quantize``, calibrates, evaluates on
held-out batches and reports the layer-output error against the unquantized layer with
the bytes on the wire per token. See ``docs/study.md``.

- :func:`run_study` (``StudyConfig`` -> the ``results.json`` document),
- :func:`moewire.study.report.write_all` (JSON and plots),
- :func:`error_metrics` (relative L2, SQNR, cosine, max abs error),
- :data:`PRESETS` (model shapes).
"""

from moewire.study.config import StudyConfig, parse_formats, validate
from moewire.study.errors import StudyArgumentError
from moewire.study.metrics import ErrorMetrics, error_metrics
from moewire.study.presets import PRESETS, ModelPreset
from moewire.study.runner import run_study
from moewire.study.wire import WireCost, wire_cost

__all__ = [
    "PRESETS",
    "ErrorMetrics",
    "ModelPreset",
    "StudyArgumentError",
    "StudyConfig",
    "WireCost",
    "error_metrics",
    "parse_formats",
    "run_study",
    "validate",
    "wire_cost",
]
