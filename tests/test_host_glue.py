"""The glue every host integration shares (``moewire.integrations._host``): the rebind of a
host module's global through the undo ledger, recognition by source, ``{rank}`` paths and
the calibration held open across two RPCs."""

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
