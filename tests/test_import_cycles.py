"""The shape of moewire's imports, read from the sources (tests/import_graph.py):

- no import cycle anywhere in ``src/moewire`` (the project's style guide: "No import cycles,
  also not inside a package: a shared type gets its own module below both users");
- no upward arrow: data flows integrations -> megamoe -> quantizer -> formats -> kernels,
  and each part of the package imports only its own layer or the layers below
  (:data:`LAYERS`);
- inside ``integrations/``, no host package imports another host package, and the modules
  every host shares import no host (``integrations/__init__.py`` draws the layout).
"""

from __future__ import annotations

import pytest

from import_graph import find_cycle, src_graph

#: The parts of moewire from the bottom up; an import may go to its own layer or below.
#: ``reference`` (the stand-in kernel), ``patches`` (the undo ledger) and ``_moved`` (the
#: deprecated paths' aliasing) import nothing of moewire, so anything may use them;
#: ``moewire.config`` and ``moewire.calibration`` are deprecated aliases of quantizer modules.
#: ``moewire`` is the package's public API.
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(layer) for layer in (
    {"moewire.format_table"},
    {"moewire.patches", "moewire.reference", "moewire._moved", "moewire.outputs",
     "moewire.extras"},
    {"moewire.kernels"},
    {"moewire.formats"},
    {"moewire.quantizer", "moewire.config", "moewire.calibration"},
    {"moewire.recipes"},
    {"moewire.megamoe"},
    {"moewire.integrations"},
    {"moewire"},
    {"moewire.study", "moewire.eval", "moewire.checkpoints"},
    {"moewire.cli", "moewire.__main__"},
))
#: ``moewire.reference`` in two layers (its ``__init__`` lists them): the experts modules and
#: weight holders above (and the package's face), the kernels below (DeepGEMM's API, buffers,
#: staging, numerics, a folder per kernel family: every other module). No kernel module
#: imports one above it.
REFERENCE_MODULES = frozenset({"moewire.reference"} | {f"moewire.reference.{m}" for m in (
    "_ep_experts", "experts", "weights", "dense", "nvfp4.experts", "nvfp4.weights",
    "fp4_fp4.experts", "fp4_fp4.weights",
)})
#: The host packages of ``integrations/``.
HOSTS = ("vllm", "sglang", "transformers", "modelopt")
_INTEGRATIONS = "moewire.integrations"


def _part(module: str) -> str:
    """The part of moewire ``module`` is in (``moewire.megamoe.api``: ``moewire.megamoe``)."""
    return ".".join(module.split(".")[:2])


def _layer(module: str) -> int:
    part = _part(module)
    found = [i for i, layer in enumerate(LAYERS) if part in layer]
    assert found, f"{part} is in no layer of LAYERS: add it where it belongs"
    return found[0]


def _host(module: str) -> str | None:
    """The host package ``module`` belongs to, or None (shared or outside integrations)."""
    parts = module.split(".")
    if parts[:2] == _INTEGRATIONS.split(".") and len(parts) > 2 and parts[2] in HOSTS:
        return parts[2]
    return None


def _is_alias(module: str) -> bool:
    """A deprecated module path (``moewire/_moved.py``)."""
    from moewire._moved import MOVED

    return module in MOVED


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, bs in graph.items() for b in bs if _layer(b) > _layer(a))


def reference_kernel_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of an experts module or weight holder of ``moewire.reference`` by one of its
    kernel modules (:data:`REFERENCE_MODULES`)."""
    kernels = {a for a in graph if _part(a) == "moewire.reference"} - REFERENCE_MODULES
    return sorted((a, b) for a in kernels for b in graph[a] if b in REFERENCE_MODULES)


def cross_host_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of one host package by another, or of a host by a shared integration module
    (the deprecated aliases excepted: each imports the module it names)."""
    found = []
    for a, targets in graph.items():
        if not a.startswith(_INTEGRATIONS + ".") or _is_alias(a):
            continue
        for b in targets:
            if _host(b) is not None and _host(b) != _host(a):
                found.append((a, b))
    return sorted(found)


def test_the_cycle_finder_finds_the_old_vllm_cycle():
    """An earlier shape: vllm.py imported ``_parallel`` from vllm_worker.py
    (inside a method), which imports vllm.py."""
    old = {
        "moewire.integrations.vllm": {"moewire.integrations.vllm.worker"},
        "moewire.integrations.vllm.worker": {"moewire.integrations.vllm"},
    }
    assert find_cycle(old) == [
        "moewire.integrations.vllm", "moewire.integrations.vllm.worker",
        "moewire.integrations.vllm",
    ]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_lazy_imports_and_from_imports_are_edges():
    graph = src_graph()
    # A lazy import (inside a function) is an edge: api is imported inside the vLLM glue's calls.
    assert "moewire.megamoe.api" in graph["moewire.integrations.vllm"]
    # `from moewire.megamoe import resum` names the submodule.
    assert "moewire.megamoe.resum" in graph["moewire.megamoe"]


def test_no_import_cycle_in_src():
    cycle = find_cycle(src_graph())
    assert cycle is None, f"import cycle in src/moewire: {' -> '.join(cycle)}"


@pytest.mark.parametrize("edge", [
    ("moewire.formats.base", "moewire.quantizer"),
    ("moewire.quantizer", "moewire.megamoe.resum"),
    ("moewire.megamoe.hooks", "moewire.integrations.vllm"),
    ("moewire.kernels.launch", "moewire.formats"),
], ids=["formats->quantizer", "quantizer->megamoe", "megamoe->integrations", "kernels->formats"])
def test_the_layer_check_finds_an_upward_import(edge):
    a, b = edge
    assert upward_imports({a: {b}}) == [edge]


def test_no_upward_import_in_src():
    up = upward_imports(src_graph())
    assert not up, "imports against the flow (integrations -> megamoe -> quantizer -> " \
        f"formats -> kernels): {up}"


@pytest.mark.parametrize("edge", [
    ("moewire.integrations.modelopt", "moewire.integrations.vllm"),
    ("moewire.integrations.transformers", "moewire.integrations.sglang.sites"),
    ("moewire.integrations._host", "moewire.integrations.vllm.bridge"),
], ids=["modelopt->vllm", "transformers->sglang.sites", "shared->host"])
def test_the_host_check_finds_a_host_importing_another(edge):
    a, b = edge
    assert cross_host_imports({a: {b}}) == [edge]


def test_a_host_may_import_itself_and_the_shared_modules():
    graph = {
        "moewire.integrations.vllm.worker": {"moewire.integrations.vllm",
                                             "moewire.integrations._host"},
        "moewire.integrations.transformers": {"moewire.integrations.deepgemm_sm90"},
    }
    assert cross_host_imports(graph) == []


def test_every_host_is_a_package_and_no_host_imports_another():
    graph = src_graph()
    for host in HOSTS:
        assert f"{_INTEGRATIONS}.{host}" in graph, f"no package integrations/{host}/"
    crossing = cross_host_imports(graph)
    assert not crossing, f"a host package imports another host: {crossing}"


def test_the_reference_check_finds_a_kernel_importing_an_experts_module():
    # An earlier shape: the NVFP4 family's folder held its experts module beside its kernel.
    old = {"moewire.reference.nvfp4.mega_moe": {"moewire.reference.nvfp4.experts"},
           "moewire.reference.nvfp4.experts": {"moewire.reference.deep_gemm"}}
    assert reference_kernel_imports(old) == [
        ("moewire.reference.nvfp4.mega_moe", "moewire.reference.nvfp4.experts")]


def test_reference_kernels_import_no_experts_module():
    graph = src_graph()
    missing = REFERENCE_MODULES - set(graph)
    assert not missing, f"REFERENCE_MODULES names modules that do not exist: {sorted(missing)}"
    up = reference_kernel_imports(graph)
    assert not up, f"a kernel module of moewire.reference imports an experts module: {up}"
