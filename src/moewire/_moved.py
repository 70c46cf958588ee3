"""moewire's deprecated module paths, each an alias of the module that replaced it.

A user's code or launch command may still name a path an earlier moewire had
(``--worker-cls moewire.integrations.vllm_worker.MoewireWorker``,
``from moewire.config import parse_cfg``), so each old path stays importable as a thin alias
until the release :data:`REMOVED_IN`: importing it warns with a ``DeprecationWarning`` that
names the new path and that release, and gives the new module itself (the same object, so a
patch on either name is a patch on both). What moved:

- moewire 0.1.0 kept every host in one flat ``integrations/`` folder
  (``integrations/vllm_worker.py``, ``integrations/vllm_sites.py``...); each host is now a
  package of its own.
- ``config.py`` (ModelOpt-style cfg parsing) and ``calibration.py`` (the quantizer contract
  and the one calibration) sat at the package root; both belong to the quantizer.

The test suite turns these warnings into errors (``pyproject.toml``'s ``filterwarnings``
matches :data:`REMOVED_PHRASE`), so no moewire code or test uses an old path unnoticed.

May import: the standard library only.
"""

from __future__ import annotations

import sys
import warnings
from types import ModuleType

#: The moewire release that deletes every alias of :data:`MOVED`.
REMOVED_IN = "0.3.0"
#: The words every alias's warning carries (the test suite's warning filter matches them).
REMOVED_PHRASE = "removed in moewire"

#: old module path -> new module path; one line each, read by the aliases' tests.
MOVED = {
    "moewire.integrations.vllm_sites": "moewire.integrations.vllm.sites",
    "moewire.integrations.vllm_worker": "moewire.integrations.vllm.worker",
    "moewire.integrations._vllm_bridge": "moewire.integrations.vllm.bridge",
    "moewire.integrations._vllm_groups": "moewire.integrations.vllm.groups",
    "moewire.integrations.sglang_sites": "moewire.integrations.sglang.sites",
    "moewire.integrations.modelopt_quantizer": "moewire.integrations.modelopt.quantizer",
    "moewire.config": "moewire.quantizer.config",
    "moewire.calibration": "moewire.quantizer.contract",
}


def alias(old: str, new: ModuleType) -> None:
    """Make the module being imported as ``old`` the module ``new``, with a warning.

    Args:
        old: the importing alias module's ``__name__`` (a key of :data:`MOVED`).
        new: the module it moved to.
    """
    # stacklevel 3: the line that imported the old path (``warnings`` skips importlib's own
    # frames), so the default filters show the warning where that line is ``__main__``'s.
    warnings.warn(
        f"{old} moved to {new.__name__}; import that (the old path is {REMOVED_PHRASE} "
        f"{REMOVED_IN})",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = new
