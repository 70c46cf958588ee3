"""Loading SGLang's released Mega-MoE modules (the sglang 0.5.23 wheel) on a CPU machine.

The wheel is found as an installed distribution (``make test-sglang`` installs it with
``--no-deps``) or at ``$SGLANG_SRC`` (an unzipped wheel). ``mega_moe.py``,
``mega_moe_sm90.py``, ``sglang/srt/environ.py`` and the plugin framework
(``sglang/srt/plugins``) run as released. Only the modules that cannot import on a CPU
machine are replaced (docs/sglang.md lists them, :data:`REPLACED` holds them): the package
``__init__`` files above the loaded modules (not run: ``sglang/__init__.py`` imports the
frontend language and transformers) and the modules ``mega_moe.py`` imports that pull in
CUDA kernels or the server, each by the few names ``mega_moe.py`` reads, in the state of
an SM90 (Hopper) server without Mega-Gate, DP attention or CUDA-graph capture.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

from moewire.reference.sgl_staging import sglang_mega_moe_pre_dispatch

MEGA_MOE_SM90 = "sglang.srt.layers.moe.mega_moe_sm90"
MEGA_MOE = "sglang.srt.layers.moe.mega_moe"
FLASHINFER_MEGAMOE = "sglang.srt.layers.moe.flashinfer_megamoe"
FLASHINFER_AUTOTUNE = "sglang.srt.layers.moe.flashinfer_megamoe_autotune"
MEGA_MOE_FLYDSL = "sglang.srt.layers.moe.mega_moe_flydsl"
MUSE_SPARK_MEGAMOE = "sglang.srt.layers.muse_spark.muse_spark_megamoe"
_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.moe",
             "sglang.srt.models", "sglang.srt.models.deepseek_common", "sglang.kernels",
             "sglang.kernels.ops", "sglang.kernels.ops.moe", "sglang.srt.layers.attention",
             "sglang.srt.layers.attention.dsa", "sglang.srt.model_executor",
             "sglang.srt.multimodal", "sglang.srt.multimodal.dsv41",
             "sglang.srt.layers.moe.moe_runner", "sglang.srt.layers.utils",
             "sglang.srt.layers.muse_spark")
_REAL = ("sglang.srt.environ", "sglang.srt.plugins.hook_registry", "sglang.srt.plugins",
         MEGA_MOE_SM90, MEGA_MOE)
#: The wheel's other Mega-MoE paths (loaded by :func:`load` with ``other=True``): moewire
#: has no site for them and refuses their layers at load.
OTHER = (FLASHINFER_AUTOTUNE, FLASHINFER_MEGAMOE, MEGA_MOE_FLYDSL, MUSE_SPARK_MEGAMOE)


def _absent(what: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"{what} has no CPU replacement in these tests")

    return call


def _copy_or_rebind_param(layer, name, tensor) -> None:
    """``sglang.srt.layers.utils.common.copy_or_rebind_param``: the parameter takes the
    prepared tensor."""
    getattr(layer, name).data = tensor


class _MegaMoEBackend:
    """``get_moe_a2a_backend()`` of a server run with ``--moe-a2a-backend megamoe``."""

    def is_megamoe(self) -> bool:
        return True


def _parallel():
    """``get_parallel()`` of one rank: ``moe_ep_group.device_group`` is ``None`` (the
    stand-in buffer's one-rank group)."""
    return types.SimpleNamespace(moe_ep_group=types.SimpleNamespace(device_group=None))


#: module -> the names it provides to ``mega_moe.py`` / ``mega_moe_sm90.py`` (``device_sm``
#: fills ``_device_sm``).
REPLACED = {
    "sglang.srt.models.deepseek_common.utils": {"_device_sm": None},
    # SGLang's JIT CUDA cast (the SM100 fp8xfp4 staging): moewire's stand-in of it.
    "sglang.kernels.ops.moe.dsv4": {"mega_moe_pre_dispatch": sglang_mega_moe_pre_dispatch},
    "sglang.srt.layers.attention.dsa.utils": {"is_dsa_enable_prefill_cp": lambda: False},
    "sglang.srt.layers.dp_attention": {"get_dp_global_num_tokens": lambda: None,
                                       "get_is_extend_in_batch": lambda: False},
    "sglang.srt.layers.moe.mega_gate": {
        "run_mega_gate": _absent("Mega-Gate"),
        "should_use_mega_gate": lambda *args, **kwargs: False},
    "sglang.srt.layers.moe.utils": {"get_moe_a2a_backend": _MegaMoEBackend},
    "sglang.srt.model_executor.runner": {"get_is_capture_mode": lambda: False},
    "sglang.srt.multimodal.dsv41.vl_routing": {"vision_topk": _absent("vision_topk")},
    "sglang.srt.utils": {"is_hip": lambda: False, "is_sm100_supported": lambda: False},
    "sglang.srt.runtime_context": {"get_parallel": _parallel},
    # What flashinfer_megamoe.py imports of the MoE runner framework (a decorator that
    # registers run_flashinfer_megamoe, and the base classes of its quant info).
    "sglang.srt.layers.moe.moe_runner.base": {
        "MoeQuantInfo": type("MoeQuantInfo", (), {}),
        "MoeRunnerConfig": type("MoeRunnerConfig", (), {}),
        "register_fused_func": lambda *names: (lambda fn: fn)},
    "sglang.srt.layers.utils.common": {"copy_or_rebind_param": _copy_or_rebind_param},
    # mega_moe_flydsl.py's padded-row fill (a Triton kernel); not reached at load.
    "sglang.kernels.ops.moe.fill_padded_rows": {"_fill_padded_rows": _absent("_fill_padded_rows")},
}


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


def load(root: Path, device_sm: int, other: bool = False) -> list[str]:
    """Put SGLang's released modules into ``sys.modules`` (with ``other``, also the
    modules of :data:`OTHER`); returns every name added."""
    added = []
    for name in _PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = [str(root / Path(*name.split(".")))]
        sys.modules[name] = package
        added.append(name)
    for name, attrs in REPLACED.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        if "_device_sm" in attrs:
            module._device_sm = device_sm
        sys.modules[name] = module
        added.append(name)
    for name in _REAL + (OTHER if other else ()):
        _load(root, name)
        added.append(name)
    return added


def stage(dest: Path) -> list[Path]:
    """Copy the released files :func:`load` reads into ``dest`` (a device run carries them
    as ``$SGLANG_SRC``: the whole wheel is too large to carry).

    Raises:
        RuntimeError: the wheel is not found (see :func:`wheel_root`).
    """
    import shutil

    root = wheel_root()
    if root is None:
        raise RuntimeError("the sglang 0.5.23 wheel is not installed (make test-sglang) and "
                           "$SGLANG_SRC is unset")
    copied = []
    for name in _REAL:
        rel = Path(*name.split("."))
        src = root / rel / "__init__.py"
        src = src if src.is_file() else root / rel.with_suffix(".py")
        target = dest / src.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
        copied.append(target)
    return copied


if __name__ == "__main__":
    for path in stage(Path(sys.argv[1])):
        print(path)

