"""The deprecated module paths of the flat ``integrations/`` layout (moewire 0.1.0).

moewire 0.1.0 kept every host in one flat folder (``integrations/vllm_worker.py``,
``integrations/vllm_sites.py``...); each host is now a package of its own. A user's launch
command may still name an old path (``--worker-cls
moewire.integrations.vllm_worker.MoewireWorker``), so each old path stays importable for one
release as a thin alias: importing it warns with a ``DeprecationWarning`` that names the new
path, and gives the new module itself (the same object, so a patch on either name is a
patch on both). The aliases are removed in the release after the next.

May import: the standard library only.
"""

from __future__ import annotations

import sys
import warnings
from types import ModuleType

#: old module path -> new module path; one line each, read by the aliases' test.
MOVED = {
    "moewire.integrations.vllm_sites": "moewire.integrations.vllm.sites",
    "moewire.integrations.vllm_worker": "moewire.integrations.vllm.worker",
    "moewire.integrations._vllm_bridge": "moewire.integrations.vllm.bridge",
    "moewire.integrations._vllm_groups": "moewire.integrations.vllm.groups",
    "moewire.integrations.sglang_sites": "moewire.integrations.sglang.sites",
    "moewire.integrations.modelopt_quantizer": "moewire.integrations.modelopt.quantizer",
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
        f"{old} moved to {new.__name__}; import that (the old path is removed in the "
        "release after the next)",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = new
