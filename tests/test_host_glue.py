"""The glue every host integration shares (``moewire.integrations._host``): the rebind of a
host module's global through the undo ledger, recognition by source, ``{rank}`` paths, the
calibration held open across two RPCs, and one host reaching another's experts classes
through an entry point."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest

from moewire import patches
from moewire.integrations import _host

HOST, BRIDGE = "moewire_test_host_site", "moewire_test_host_bridge"


@pytest.fixture
def modules(monkeypatch):
    """A host module whose ``stage`` is read at call time, and a bridge module; every
    rebind undone after the test."""
    host, bridge = types.ModuleType(HOST), types.ModuleType(BRIDGE)
    host.stage = lambda x: ("host", x)
    host.forward = lambda x: host.stage(x)  # reads the global at call time
    monkeypatch.setitem(sys.modules, HOST, host)
    monkeypatch.setitem(sys.modules, BRIDGE, bridge)
    yield host, bridge
    patches.undo_all()


def test_rebind_routes_through_the_bridge_and_undoes(modules):
    host, bridge = modules
    original = host.stage
    _host.rebind_global(HOST, "stage", BRIDGE, "stage__host")
    assert _host.is_rebound(HOST, "stage", "stage__host")
    assert bridge.stage__host is original
    bridge.stage__host = lambda x: ("bridge", x)  # what a moewire proxy does
    assert host.forward(1) == ("bridge", 1)
    trampoline = host.stage
    _host.rebind_global(HOST, "stage", BRIDGE, "stage__host")  # idempotent
    assert host.stage is trampoline
    patches.undo_all()
    assert host.stage is original and not _host.is_rebound(HOST, "stage", "stage__host")


@pytest.mark.parametrize(("versions", "tail"), [
    ("", "the versions moewire supports"),
    (" (docs/vllm.md, version table)", "the versions moewire supports (docs/vllm.md, version "
                                       "table)"),
], ids=["plain", "with-versions"])
def test_rebind_of_a_missing_function_is_refused(modules, versions, tail):
    with pytest.raises(RuntimeError) as info:
        _host.rebind_global(HOST, "prepare", BRIDGE, "stage__host", versions)
    assert str(info.value) == (
        f"{HOST}: no function 'prepare' to interpose on; this build differs from {tail}")
    assert not patches.is_patched(sys.modules[HOST], "prepare")


def test_source_reach_reads_calls_and_imports_from_the_syntax_tree():
    reach = _host.SourceReach(
        "import deep_gemm.mega\n"
        "def fp8_mega_moe(y):\n"
        "    '''stage_it(x) in a docstring'''\n"
        "    return run(y)  # fp8_fp4_mega_moe(y) in a comment\n"
        "x = dg.mega_moe_pre_dispatch(a)\n"
    )
    assert reach.calls(".mega_moe_pre_dispatch(") and reach.calls("mega_moe_pre_dispatch(")
    assert reach.calls("run(") and not reach.calls(".run(")
    for absent in ("fp8_mega_moe(", "stage_it(", "fp8_fp4_mega_moe("):
        assert not reach.calls(absent), absent
    assert reach.imports_module("deep_gemm") and not reach.imports_module("deep")
    assert _host.source_reach("moewire_no_such_module") is None


def test_rank_path():
    assert _host.rank_path("/s/scales.rank{rank}.pt", 3) == "/s/scales.rank3.pt"
    assert _host.rank_path("/s/scales.pt", 3) == "/s/scales.pt"


def test_calibration_held_across_two_calls():
    events = []

    @contextlib.contextmanager
    def calibration():
        events.append("enter")
        yield
        events.append("exit")

    owner = types.SimpleNamespace()
    _host.begin_calibration(owner, calibration())
    assert events == ["enter"]
    _host.finish_calibration(owner, "call moewire_begin_calibration first")
    assert events == ["enter", "exit"] and owner._moewire_calibration is None
    with pytest.raises(RuntimeError, match="^moewire_finish_calibration: no calibration in "
                                           "progress; call moewire_begin_calibration first$"):
        _host.finish_calibration(owner, "call moewire_begin_calibration first")


@pytest.mark.parametrize(
    ("source", "calls"),
    [
        ("kernel = dg.bf16_mega_moe if bf16 else dg.fp8_fp4_mega_moe\nkernel(y)\n", True),
        ("kernel = dg.fp8_fp4_mega_moe\nkernel(y)\n", True),
        ("kernel = dg.fp8_fp4_mega_moe\n", False),
        ("kernel = dg.fp8_fp4_mega_moe\nother(y)\n", False),
    ],
    ids=["conditional-alias-called", "alias-called", "alias-never-called", "other-name-called"],
)
def test_a_called_alias_of_an_attribute_is_a_call(source, calls):
    assert _host.SourceReach(source).calls("fp8_fp4_mega_moe(") is calls


def test_another_hosts_classes_come_through_the_entry_point(monkeypatch):
    """ModelOpt's registration reaches vLLM's classes through the ``moewire.host_classes``
    entry point (no host package imports another): the installed metadata names vLLM's
    registration function, and what that entry point's function returns comes back."""
    import importlib.metadata

    (vllm,) = [ep for ep in importlib.metadata.entry_points(group=_host.HOST_CLASSES)
               if ep.name == "vllm"]
    assert vllm.value == "moewire.integrations.vllm:register_vllm_experts"

    class Registered:
        pass

    fake = types.SimpleNamespace(name="vllm", load=lambda: lambda: [Registered])
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [fake])
    assert _host.register_host_classes("vllm") == [Registered]


def test_a_host_without_an_entry_point_is_refused_with_the_fix(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    with pytest.raises(RuntimeError, match=r"no entry point 'vllm'.*pip install -e \."):
        _host.register_host_classes("vllm")
