"""Suite-wide hooks: GPU tests skip without CUDA, and no test leaves process-wide state behind.

The leak check (:func:`_no_leaks`, autouse) snapshots moewire's process-wide state before
each test and compares it after the test's own fixtures are torn down: converted experts
modules still alive, undo-ledger entries (``moewire.patches``), DeepGEMM module objects
still of the hooked class, and the entries of every registry (experts adapters, kernel
flavours and refused kernels, combine base rules, wire formats, the vLLM bridge's rebinds,
the stand-in's forward contexts, and what moewire registered with ModelOpt). A difference
fails the test at teardown with what it left, then the state is put back so that the next
test starts clean. A test that converts, patches or registers something undoes it, or runs
under a fixture that does: :func:`patches_undone` (autouse in the directories whose tests
drop quantized models), :func:`modelopt_registered`, :func:`registries_restored`.

The suite runs in a random order (pytest-randomly, ``make test``); torch's generator is
seeded per test (:func:`_torch_seeded`) as pytest-randomly seeds ``random`` and numpy.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import sys
import types
import weakref
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Triton's interpreter on a machine without CUDA: TRITON_INTERPRET must be set before Triton
# is first imported (``triton.jit`` reads it when a kernel is defined), and a test module
# collected before tests/kernels (transformers' model classes, for one) may import Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moewire import patches  # noqa: E402
from moewire.formats import base as formats_base
from moewire.integrations.vllm import bridge as _vllm_bridge
from moewire.megamoe import active, builds, flavours, hooks, registry
from moewire.megamoe import convert as convert_module
from moewire.reference import experts as reference_experts


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `pytest -m gpu` on a machine with a CUDA GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Import ModelOpt (when a collected file uses it) and moewire's SM90 integration
    before the first test.

    ModelOpt's first import keeps the call stack that imported it alive (a frame of that
    stack stays referenced after the import returns), so a test that first imports it
    inside its body keeps its own locals, a converted model among them, for the rest of
    the process. Imported here, the frames kept are the session's, holding nothing.
    """
    # moewire's SM90 integration registers its experts class when first imported; imported
    # here, that registration is the session's, not the first test's that reaches it.
    importlib.import_module("moewire.integrations.deepgemm_sm90")
    if importlib.util.find_spec("modelopt") is None:
        return
    files = {Path(str(item.path)) for item in session.items}
    if any("modelopt" in path.read_text(errors="replace") for path in files if path.is_file()):
        with contextlib.suppress(ImportError):
            importlib.import_module("modelopt.torch.quantization")


@pytest.fixture(autouse=True)
def _torch_seeded(request: pytest.FixtureRequest) -> None:
    """torch's global generator seeded from the test's id (and ``--randomly-seed`` when
    pytest-randomly runs, which reseeds ``random`` and numpy the same way but not torch),
    so a test draws the same numbers in any order."""
    seed = zlib.crc32(request.node.nodeid.encode())
    if request.config.pluginmanager.has_plugin("randomly"):
        seed += request.config.getoption("randomly_seed")
    torch.manual_seed(seed % 2**32)


# -- ModelOpt's registry -----------------------------------------------------------------


def _modelopt_state() -> dict[str, Any]:
    """What moewire can add to ModelOpt: its registry entries and conversion plug-ins."""
    if "moewire.integrations.modelopt" not in sys.modules:
        return {}
    from modelopt.torch.quantization.nn import QuantModuleRegistry
    from modelopt.torch.quantization.plugins import custom

    from moewire.integrations import modelopt as mw_mo

    return {
        "QuantModuleRegistry": {
            attr: dict(getattr(QuantModuleRegistry, attr))
            for attr in ("_registry", "_key_registry", "_dynamic_classes", "_rule_classes")
        },
        "moewire.integrations.modelopt._REGISTERED": dict(mw_mo._REGISTERED),
        "CUSTOM_MODEL_PLUGINS": set(custom.CUSTOM_MODEL_PLUGINS),
        "CUSTOM_POST_CONVERSION_PLUGINS": set(custom.CUSTOM_POST_CONVERSION_PLUGINS),
    }


def _restore_modelopt(state: dict[str, Any]) -> None:
    if not state:
        # moewire's ModelOpt integration was first imported during the test: nothing of
        # it was registered before.
        state = {"QuantModuleRegistry": None}
    from modelopt.torch.quantization.nn import QuantModuleRegistry
    from modelopt.torch.quantization.plugins import custom

    from moewire.integrations import modelopt as mw_mo

    saved = state["QuantModuleRegistry"]
    for attr in ("_registry", "_key_registry", "_dynamic_classes", "_rule_classes"):
        live = getattr(QuantModuleRegistry, attr)
        if saved is None:
            for key in [k for k, v in live.items() if _is_moewire_entry(k, v)]:
                del live[key]
        else:
            live.clear()
            live.update(saved[attr])
    _refill(mw_mo._REGISTERED, state.get("moewire.integrations.modelopt._REGISTERED", {}))
    for name in ("CUSTOM_MODEL_PLUGINS", "CUSTOM_POST_CONVERSION_PLUGINS"):
        live = getattr(custom, name)
        kept = state.get(name, {p for p in live if not p.__module__.startswith("moewire")})
        live.clear()
        live.update(kept)


def _is_moewire_entry(key: Any, value: Any) -> bool:
    return any(
        isinstance(v, str) and v.startswith("moewire:")
        or getattr(v, "__module__", "").startswith("moewire")
        for v in (key, value)
    )


@pytest.fixture
def modelopt_registered() -> Iterator[list[type]]:
    """moewire's experts classes registered with ModelOpt for one test, then unregistered.

    Yields:
        The classes ``moewire.integrations.modelopt.register(vllm=False)`` registered.
    """
    pytest.importorskip("modelopt.torch.quantization")
    from moewire.integrations import modelopt as mw_mo

    before = _modelopt_state()
    try:
        yield mw_mo.register(vllm=False)
    finally:
        _restore_modelopt(before)


@pytest.fixture
def patches_undone(request: pytest.FixtureRequest) -> Iterator[None]:
    """After the test, its quantized models unconverted and moewire's patches undone.

    ``moewire.unquantize`` undoes every patch when it unconverts the last converted module;
    a test that drops its quantized model instead leaves the patches in place. This
    unconverts what the test's fixtures hold (pytest holds their values until the test is
    over) and puts the patches back, as that last unquantize would have, when no converted
    module is alive any more; one still alive (held past the test) is left for the leak
    check to report.
    """
    yield
    for value in request.node.funcargs.values():
        for module in value.modules() if isinstance(value, torch.nn.Module) else ():
            if convert_module.is_converted(module):
                with contextlib.suppress(TypeError):  # ModelOpt's conversion: not ours
                    convert_module.unconvert(module)
    if convert_module._CONVERTED:
        gc.collect()
    if not convert_module._CONVERTED:
        patches.undo_all()


@pytest.fixture
def registries_restored() -> Iterator[None]:
    """Every registry (moewire's and what it added to ModelOpt) put back after the test,
    for a test that registers classes, flavours or formats of its own."""
    before = _snapshot()
    try:
        yield
    finally:
        _restore(before)


# -- the leak check ----------------------------------------------------------------------


def _refill(live: dict | list | set, saved: dict | list | set) -> None:
    live.clear()
    if isinstance(live, dict):
        live.update(saved)
    elif isinstance(live, list):
        live.extend(saved)
    else:
        live.update(saved)


# Every process-wide registry of moewire: label -> the live container.
_REGISTRIES: dict[str, dict | list] = {
    "experts adapters (megamoe.registry)": registry._ADAPTERS,
    "kernel flavours (megamoe.flavours)": flavours._REGISTRY,
    "refused kernels (megamoe.flavours)": flavours._REFUSED,
    "combine base rules (megamoe.builds)": builds.BASE_RULES,
    "wire formats (formats)": formats_base._REGISTRY,
    "vLLM bridge resolvers (integrations.vllm.bridge)": _vllm_bridge._resolver,
    "vLLM bridge rebinds (integrations.vllm.bridge)": _vllm_bridge._installed,
    "forward contexts (reference.experts)": reference_experts._CONTEXTS,
}


def _hooked_modules() -> list[str]:
    """Module objects whose class is still moewire's hooked module class."""
    return sorted(
        name for name, module in list(sys.modules.items())
        if isinstance(module, hooks._HookedModule)
    )


def _converted() -> weakref.WeakSet:
    return weakref.WeakSet(convert_module._CONVERTED)


def _snapshot() -> dict[str, Any]:
    return {
        "registries": {label: type(live)(live) for label, live in _REGISTRIES.items()},
        "modelopt": _modelopt_state(),
        "active": {var.name: var.get() for var in (active.ACTIVE, active.REACHED)},
    }


def _describe(value: Any) -> str:
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)[:80]


def _diff(before: dict, after: dict) -> list[str]:
    out = []
    if isinstance(before, dict):
        added = [k for k in after if k not in before or after[k] is not before[k]]
        removed = [k for k in before if k not in after]
        out += [f"added or replaced {_describe(k)}" for k in added]
        out += [f"removed {_describe(k)}" for k in removed]
    elif isinstance(before, set):
        out += [f"added {_describe(p)}" for p in after - before]
        out += [f"removed {_describe(p)}" for p in before - after]
    elif list(before) != list(after):
        out.append(f"{len(before)} entries before, {len(after)} after")
    return out


def leaks(
    before: dict[str, Any], after: dict[str, Any], converted_before: weakref.WeakSet
) -> list[str]:
    """What changed in the process-wide state between two snapshots, one line each."""
    found = []
    if any(m not in converted_before for m in convert_module._CONVERTED):
        # A module in a reference cycle (transformers' EP installs a forward closure over
        # its module) goes only with a collection, which a list of the modules would stop.
        gc.collect()
    alive = [m for m in convert_module._CONVERTED if m not in converted_before]
    found += [
        f"converted module still alive: {type(m).__qualname__} "
        f"({getattr(m, '_moewire_name_', '?')})" for m in alive
    ]
    found += [
        f"undo-ledger entry: {_describe(obj)}" + (f".{attr}" if attr else " (its class)")
        for obj, attr in patches.active_patches()
    ]
    found += [f"DeepGEMM module still hooked: {name}" for name in _hooked_modules()]
    for label, saved in before["registries"].items():
        found += [f"{label}: {line}" for line in _diff(saved, after["registries"][label])]
    for key in sorted(after["modelopt"]):
        saved, now = before["modelopt"].get(key), after["modelopt"][key]
        if key == "QuantModuleRegistry":
            saved, now = (saved or {}).get("_key_registry", {}), now["_key_registry"]
        saved = type(now)() if saved is None else saved
        lines = _diff(_moewire_part(saved), _moewire_part(now))
        found += [f"ModelOpt {key}: {line}" for line in lines]
    found += [
        f"context variable {name} still set: {_describe(value)}"
        for name, value in after["active"].items() if value is not None
    ]
    return found


def _moewire_part(entries: dict | set) -> dict | set:
    """The entries moewire put in one of ModelOpt's containers."""
    if isinstance(entries, dict):
        return {k: v for k, v in entries.items() if _is_moewire_entry(k, v)}
    return {p for p in entries if getattr(p, "__module__", "").startswith("moewire")}


def _restore(before: dict[str, Any]) -> None:
    """Put the process-wide state back as ``before`` had it (after a reported leak)."""
    patches.undo_all()
    for name in _hooked_modules():
        sys.modules[name].__class__ = types.ModuleType
    for label, live in _REGISTRIES.items():
        _refill(live, before["registries"][label])
    if "moewire.integrations.modelopt" in sys.modules:
        _restore_modelopt(before["modelopt"])
    active.ACTIVE.set(None)
    active.REACHED.set(None)


# Tiers that run elsewhere (vLLM's own venv, the H200) and register vLLM's classes once
# per process, as vLLM's plugin loader does: not checked.
_UNCHECKED_MARKERS = ("vllm", "real_kernel")


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves converted modules, patches or registry entries behind.

    Autouse and requested first, so it is torn down last: after the test's own fixtures
    (``monkeypatch`` included) have undone what they set.
    """
    if any(request.node.get_closest_marker(m) for m in _UNCHECKED_MARKERS):
        yield
        return
    before, converted_before = _snapshot(), _converted()
    yield
    found = leaks(before, _snapshot(), converted_before)
    if found:
        _restore(before)
        pytest.fail(
            f"{request.node.nodeid} left process-wide state behind (undo it in the test, or "
            "use a fixture that does):\n  " + "\n  ".join(found),
            pytrace=False,
        )
