"""Loading SGLang's released Mega-MoE modules (the sglang 0.5.23 wheel) on a CPU machine.

The wheel is found as an installed distribution (``make test-sglang`` installs it with
``--no-deps``) or at ``$SGLANG_SRC`` (an unzipped wheel). Only these modules are replaced
(docs/sglang.md lists them): the package ``__init__`` files above the loaded modules (not
run: ``sglang/__init__.py`` imports the frontend language and transformers), and
``sglang.srt.models.deepseek_common.utils`` (imports the Triton kernels and the MoE layer;
SGLang's SM90 path reads only ``_device_sm`` from it). ``mega_moe_sm90.py``,
``sglang/srt/environ.py`` and the plugin framework (``sglang/srt/plugins``) run as released.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

MEGA_MOE_SM90 = "sglang.srt.layers.moe.mega_moe_sm90"
_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.moe",
             "sglang.srt.models", "sglang.srt.models.deepseek_common")
_REAL = ("sglang.srt.environ", "sglang.srt.plugins.hook_registry", "sglang.srt.plugins",
         MEGA_MOE_SM90)


def wheel_root() -> Path | None:
    """The directory holding the ``sglang`` package of the wheel, or ``None``."""
    env = os.environ.get("SGLANG_SRC")
    if env and (Path(env) / "sglang" / "srt").is_dir():
        return Path(env)
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent


def _load(root: Path, name: str) -> types.ModuleType:
    rel = Path(*name.split("."))
    path = root / rel / "__init__.py"
    if not path.is_file():
        path = root / rel.with_suffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load(root: Path, device_sm: int) -> list[str]:
    """Put SGLang's released modules into ``sys.modules``; returns every name added."""
    added = []
    for name in _PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = [str(root / Path(*name.split(".")))]
        sys.modules[name] = package
        added.append(name)
    utils = types.ModuleType("sglang.srt.models.deepseek_common.utils")
    utils._device_sm = device_sm
    sys.modules[utils.__name__] = utils
    added.append(utils.__name__)
    # SGLang's mega_moe.py (the SM100 path) needs CUDA-only imports: absent here.
    sys.modules["sglang.srt.layers.moe.mega_moe"] = None  # type: ignore[assignment]
    added.append("sglang.srt.layers.moe.mega_moe")
    for name in _REAL:
        _load(root, name)
        added.append(name)
    return added
