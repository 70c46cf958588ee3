"""The format table (``moewire.format_table``) against the formats: one row per registered
format, each fact of a format read from its row and true of its torch reference, and the
import refusing a format without a row or a row without a format."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.kernels import cases

import moewire
from moewire import formats, kernels
from moewire.format_table import FORMATS, FormatFacts
from moewire.formats.base import WireFormat, check_table

FACTS = ("element_bits", "block_size", "scale_bits", "row_scale_bits", "needs_amax",
         "row_local", "combine_accumulate")
# ModelOpt's (exponent, mantissa) bits of an element, and of a block scale kind.
_MODELOPT_ELEMENT = {"e4m3": (4, 3), "e2m1": (2, 1)}
_MODELOPT_SCALE = {"block_ue8m0": (8, 0), "block_e4m3": (4, 3), "block_e4m3_row": (4, 3)}
_SRC = str(Path(moewire.__file__).resolve().parents[1])


def test_every_registered_format_has_a_row_and_every_row_a_format():
    assert sorted(FORMATS) == formats.names()


def test_the_kernel_cases_are_the_rows_with_a_kernel():
    """tests/kernels/cases.py reads its formats from the table: every row with a kernel code,
    the ones that need an amax among them."""
    assert cases.FORMATS == kernels.SUPPORTED_FORMATS
    assert set(cases.FORMATS) == {n for n, row in FORMATS.items() if row.kernel_code is not None}
    assert set(cases.NEEDS_AMAX) == {n for n in cases.FORMATS if formats.get(n).needs_amax}
    assert {"fp8", "nvfp4", "fp8_e4m3fnuz"} == set(cases.NEEDS_AMAX)


@pytest.mark.parametrize("name", formats.names())
def test_the_format_reads_its_facts_from_its_row(name):
    fmt = formats.get(name)
    row = FORMATS[name]
    assert fmt.facts is row
    for fact in FACTS:
        assert getattr(fmt, fact) == getattr(row, fact), fact
    # No second copy: no class of the format (below WireFormat) nor the object sets a fact.
    for cls in type(fmt).__mro__[: type(fmt).__mro__.index(WireFormat)]:
        assert not set(FACTS) & set(vars(cls)), f"{cls.__name__} sets a fact of the table"
    assert not set(FACTS) & set(vars(fmt))
    assert kernels.supports(fmt.facts) == (row.kernel_code is not None)


def _groups(out: torch.Tensor, row: FormatFacts) -> torch.Tensor:
    """``out`` [R, H] as its scale groups: [R, H // block, block], or one group per row."""
    if row.block_size is None:
        return out.reshape(out.shape[0], 1, -1)
    return out.reshape(out.shape[0], -1, row.block_size)


@pytest.mark.parametrize("name", formats.names())
def test_the_row_states_what_the_reference_computes(name):
    """Each fact of the row, seen from the torch reference: an amax is refused exactly when
    the row needs one; a scale group holds at most 2^element_bits values; a block's values
    depend on that block alone; the ModelOpt spelling names the row's element and scale."""
    fmt = formats.get(name)
    row = FORMATS[name]
    gen = torch.Generator().manual_seed(len(name))
    x = torch.randn(4, 1024, generator=gen).to(torch.bfloat16) * 0.05
    amax = x.float().abs().amax() if row.needs_amax else None
    if row.needs_amax:
        with pytest.raises(ValueError, match="needs an amax"):
            fmt.qdq(x)
    out = fmt.qdq(x, amax, use_kernel=False)

    distinct = max(len(torch.unique(g)) for g in _groups(out, row).flatten(0, 1))
    assert distinct <= 2**row.element_bits

    if row.scale.startswith("block_") and not row.whole_row and row.scale != "block_bf16_range":
        y = x.clone()
        y[:, : row.block_size] *= 64
        moved = fmt.qdq(y, amax, use_kernel=False)
        assert torch.equal(moved[:, row.block_size:], out[:, row.block_size:])
        assert not torch.equal(moved[:, : row.block_size], out[:, : row.block_size])

    spelling = fmt.modelopt_spelling
    if spelling is not None:
        assert spelling.num_bits == _MODELOPT_ELEMENT[row.element]
        assert spelling.scale_bits == _MODELOPT_SCALE.get(row.scale)


class _Rowless(WireFormat):
    name = "fp6_rowless"


REFUSALS = {
    "format-without-row": (
        {**{n: formats.get(n) for n in formats.names()}, "fp6_rowless": _Rowless()}, FORMATS,
        r"\['fp6_rowless'\] are registered but have no row in moewire.format_table; add a "
        "FormatFacts row",
    ),
    "row-without-format": (
        {n: formats.get(n) for n in formats.names() if n != "logfmt10"}, FORMATS,
        r"has row\(s\) \['logfmt10'\] but no registered format .* add a WireFormat subclass",
    ),
}


@pytest.mark.parametrize(("registered", "rows", "match"), REFUSALS.values(), ids=REFUSALS)
def test_check_table_refuses(registered, rows, match):
    with pytest.raises(RuntimeError, match=match):
        check_table(registered, rows)
    check_table()  # the shipped registry and table agree


_PATCHED_IMPORT = """
import dataclasses
from types import MappingProxyType
import moewire.format_table as table
rows = dict(table.FORMATS)
{change}
table.FORMATS = MappingProxyType(rows)
import moewire.formats
"""


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ('rows["fp6_e3m2"] = dataclasses.replace(rows["mxfp4"], name="fp6_e3m2", '
         "kernel_code=None)",
         "moewire.format_table has row(s) ['fp6_e3m2'] but no registered format"),
        ('del rows["bf16"]', "['bf16'] are registered but have no row in moewire.format_table"),
    ],
    ids=["row-without-format", "format-without-row"],
)
def test_importing_the_formats_refuses_a_table_that_disagrees(change, match):
    """The check runs when ``moewire.formats`` is imported: a row added without its format,
    or a format left without its row, stops the import with what to add."""
    done = subprocess.run(
        [sys.executable, "-c", _PATCHED_IMPORT.format(change=change)],
        env={"PYTHONPATH": _SRC, "PATH": ""}, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode != 0
    assert "RuntimeError" in done.stderr and match in done.stderr, done.stderr[-2000:]


def test_a_format_registered_at_runtime_without_a_row_keeps_its_class_facts(monkeypatch):
    """A plugin's format (registered after import) has no row: its facts are its class
    attributes and the defaults, and it has no kernel."""
    from moewire.formats import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))

    class FP6(WireFormat):
        name = "fp6_plugin"
        element_bits = 6
        block_size = 32

        def reference(self, x, amax):
            return x.clone()

    formats.register(FP6)
    fmt = formats.get("fp6_plugin")
    assert fmt.facts is None and not kernels.supports("fp6_plugin")
    assert (fmt.element_bits, fmt.block_size, fmt.scale_bits, fmt.needs_amax) == (6, 32, 0, False)
    assert fmt.wire_bits(64) == 6 * 64
