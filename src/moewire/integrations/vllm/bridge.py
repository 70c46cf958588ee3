"""The two call-time lookups of vLLM's Mega-MoE forwards, rebound to globals of this module.

vLLM's Mega-MoE experts (0.32 to 0.34, and main's backend shape) read the staging function
``prepare_megamoe_inputs`` from their module globals, but reach DeepGEMM through a local
``from vllm.utils.deep_gemm import _import_deep_gemm`` in the forward (and in the backend's
``run_mega_moe`` on 0.32): the kernel namespace is no global of the forward's module.
:func:`install` points both lookups at globals of this module, so a moewire experts adapter
names one module (this one) for both, as ``docs/architecture.md`` asks:

- ``deep_gemm``: the namespace vLLM's ``_import_deep_gemm()`` returns, resolved on first
  use (never at plugin load: importing DeepGEMM may initialise CUDA);
- ``stage__<site>``: the staging function of one vLLM forward module, rebound by
  :func:`moewire.integrations._host.rebind_global` (the rebind the SGLang integration uses).

Both rebinds keep behaviour: outside a quantized module's forward vLLM gets exactly what it
got before. Both go through moewire's undo ledger (:mod:`moewire.patches`), so
``moewire.unquantize`` puts vLLM's own back.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from moewire import patches
from moewire.integrations._host import is_rebound, rebind_global

_resolver: dict[str, Callable[[], Any] | None] = {"vllm": None, "override": None}
# Every staging function rebound so far: (forward module, function) -> global name here
# (vLLM 0.33/0.34 sites have a second one, ``prepare_megamoe_nvfp4_inputs``). Undone
# rebinds stay listed; :func:`installed_stage_globals` reads the live ones.
_installed: dict[tuple[str, str], str] = {}
PRIMARY_STAGE_FN = "prepare_megamoe_inputs"


def __getattr__(name: str) -> Any:
    if name == "deep_gemm":
        namespace = _resolve()
        if namespace is None:
            # No attribute rather than None: a proxy must not be built around "no DeepGEMM".
            raise AttributeError(
                f"module {__name__!r}: vLLM imports no DeepGEMM (neither `deep_gemm` nor "
                "`vllm.third_party.deep_gemm`)"
            )
        return namespace
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _resolve() -> Any:
    namespace = globals().get("deep_gemm")
    if namespace is None:
        namespace = kernel_source()
        # Not cached when None: vLLM returns None too, and a later import may succeed.
        if namespace is not None:
            globals()["deep_gemm"] = namespace
    return namespace


def kernel_source() -> Any:
    """The DeepGEMM namespace vLLM would import, without moewire's proxies.

    Returns:
        The test override (:func:`set_kernel_override`) if one is set, else what vLLM's
        original ``_import_deep_gemm()`` returns (a module, or ``None`` when vLLM finds none).
    """
    override = _resolver["override"]
    if override is not None:
        return override()
    original = _resolver["vllm"]
    return None if original is None else original()


def set_kernel_override(getter: Callable[[], Any] | None) -> None:
    """Make ``deep_gemm`` resolve to ``getter()`` (``None`` restores vLLM's import)."""
    _resolver["override"] = getter
    globals().pop("deep_gemm", None)


def import_deep_gemm() -> Any:
    """Replacement of ``vllm.utils.deep_gemm._import_deep_gemm``: this module's ``deep_gemm``.

    Returns ``None`` where vLLM's original would (no DeepGEMM importable).
    """
    return _resolve()


def _cache_clear() -> None:
    globals().pop("deep_gemm", None)
    original = _resolver["vllm"]
    if original is not None and hasattr(original, "cache_clear"):
        original.cache_clear()


# vLLM's original is a functools.cache; keep the one method callers may use.
import_deep_gemm.cache_clear = _cache_clear  # type: ignore[attr-defined]


def stage_global_name(forward_module: str) -> str:
    """The global of this module that holds ``forward_module``'s staging function."""
    return "stage__" + forward_module.replace(".", "_")


def installed_stage_globals() -> list[tuple[str, str, str]]:
    """The staging functions rebound now: ``(forward module, function, global name here)``."""
    return [
        (module, fn, name)
        for (module, fn), name in _installed.items()
        if is_rebound(module, fn, name)
    ]


def install_access() -> None:
    """Rebind vLLM's ``_import_deep_gemm`` to this module's ``deep_gemm`` (idempotent;
    through the undo ledger, ``moewire.patches``), in every module of
    ``sites.ACCESS_MODULES`` that imports (vLLM main moved it to
    ``vllm.foundation.utilities.deep_gemm``).

    Enough for a forward that stages inline (vLLM main's SM90 experts): it has no staging
    global, and its cast and kernel are hooked on the DeepGEMM module object.

    Raises:
        RuntimeError: no module of ``ACCESS_MODULES`` imports with an ``_import_deep_gemm``.
    """
    from moewire.integrations.vllm.sites import ACCESS_MODULES, KERNEL_ACCESS

    holders = []
    for name in ACCESS_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if callable(getattr(module, KERNEL_ACCESS, None)):
            holders.append(module)
    if not holders:
        raise RuntimeError(
            f"moewire: this vLLM has no {KERNEL_ACCESS} in any of {list(ACCESS_MODULES)}, so "
            "moewire cannot reach the DeepGEMM its Mega-MoE experts call; add the module "
            "that holds it to moewire.integrations.vllm.sites.ACCESS_MODULES"
        )
    unpatched = [m for m in holders if getattr(m, KERNEL_ACCESS) is not import_deep_gemm]
    if unpatched:
        # vLLM's own lookup (main's old path re-exports the new one: the same function).
        _resolver["vllm"] = getattr(unpatched[0], KERNEL_ACCESS)
    for module in unpatched:
        patches.patch_attr(module, KERNEL_ACCESS, import_deep_gemm)


def install(forward_module: str, stage_fn: str) -> str:
    """Rebind ``forward_module.<stage_fn>`` and vLLM's DeepGEMM import to this module.

    Idempotent. Args:
        forward_module: the vLLM module whose forward calls ``stage_fn`` at call time.
        stage_fn: the name of the staging global there (``"prepare_megamoe_inputs"``).

    Returns:
        The name of the global of this module now holding the staging function.

    Raises:
        RuntimeError: ``forward_module`` has no ``stage_fn`` (a vLLM that moewire does not
            know: see docs/vllm.md, version table).
    """
    install_access()
    name = stage_global_name(forward_module)
    if stage_fn != PRIMARY_STAGE_FN:
        name = f"{name}__{stage_fn}"
    rebind_global(forward_module, stage_fn, __name__, name, " (docs/vllm.md, version table)")
    _installed[(forward_module, stage_fn)] = name
    return name
