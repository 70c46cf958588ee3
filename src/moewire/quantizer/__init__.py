"""The wire quantizer: one format plus its calibration state (amax, enable, mode).

:class:`WireQuantizer` is what the Mega-MoE wrapper puts on the dispatch and the combine
path: a :class:`~moewire.formats.WireFormat` and the state ModelOpt's ``TensorQuantizer``
holds for it. One class, built in three layers, one file each:

- ``state.py``: :class:`~moewire.quantizer.state.QuantizerState`, the ``amax`` and
  calibration buffers, where the amax came from (``has_amax``, ``amax_source``,
  ``constant_amax``, ``set_constant_amax``, ``load_amax``), and ``mode`` / ``enable`` /
  ``disable`` (``MODES``).
- ``calibrate.py``: :class:`~moewire.quantizer.calibrate.QuantizerCalibration`, the
  calibration steps: ``collect``, ``begin_calibration`` / ``end_calibration``,
  ``load_calib_amax``, ``sync_amax``, ``calibrating``, ``reset_calibration``.
- ``binding.py``: :class:`WireQuantizer` itself, the format bound to that state: the
  constructor and ``from_cfg``, ``scale_amax`` / ``is_static_scale``, ``forward`` /
  ``dequantize``, the format saved with the ``state_dict`` (extra state), and the repr.

``forward`` and ``collect`` never synchronise with the host (no ``.item()``, no Python
branch on a tensor value), so both can be captured in a CUDA graph; every check that has to
read a value runs on the host in ``load_calib_amax``, ``load_amax`` and ``sync_amax``.

What callers may use is written down once, as the Protocol
:class:`~moewire.quantizer.contract.WireQuantizerLike` (ModelOpt's ``WireTensorQuantizer``
implements it too), and every calibration runs through
:func:`~moewire.quantizer.contract.calibration`: collect, then sync across ranks, then load
(both in ``contract.py``, re-exported here). ModelOpt-style configuration dicts map to
formats in ``config.py`` (:func:`~moewire.quantizer.config.parse_cfg`, re-exported here):
configuration apart from state, as torchao's and ModelOpt's ``config.py`` keep it.

May import: torch and ``moewire.formats`` (and its own modules, which never import this
package back).
"""

from __future__ import annotations

from moewire.quantizer.binding import WireQuantizer

# parse_cfg and CfgError are imported from here too, as 0.1.0 documented them here.
from moewire.quantizer.config import CfgError, parse_cfg
from moewire.quantizer.contract import WireQuantizerLike, calibration, max_all_reduce
from moewire.quantizer.state import MODES

__all__ = [
    "MODES",
    "CfgError",
    "WireQuantizer",
    "WireQuantizerLike",
    "calibration",
    "max_all_reduce",
    "parse_cfg",
]
