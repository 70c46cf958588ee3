"""``benchmarks/forward_overhead.py`` as a small CPU run: the rows it times side by side, the
ratios it derives from them, and the JSON it writes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers.integrations.moe")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "forward_overhead.py"


def _bench():
    spec = importlib.util.spec_from_file_location("forward_overhead", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_small_cpu_run_times_every_row_and_writes_the_ratios(tmp_path, capsys):
    out = tmp_path / "forward.json"
    from moewire.integrations import transformers as mt

    try:
        code = _bench().main(["--device", "cpu", "--layers", "1", "--experts", "8",
                              "--hidden", "256", "--intermediate", "256", "--vocab", "512",
                              "--seq", "16", "--iters", "1", "--out", str(out)])
    finally:
        mt.unregister()  # the benchmark registers the "moewire" implementation
    assert code == 0
    doc = json.loads(out.read_text())
    rows = {r["row"]: r for r in doc["rows"]}
    quantized = "moewire/stand-in/moe_fp8_dispatch_nvfp4_combine"
    # CPU: no CUDA graph rows, no real kernel.
    assert list(rows) == ["grouped_mm", "moewire/stand-in", quantized]
    assert [r["quantized"] for r in rows.values()] == [False, False, True]
    for r in rows.values():
        assert r["ms"] > 0
        assert r["x_grouped_mm"] == pytest.approx(r["ms"] / rows["grouped_mm"]["ms"])
    # The quantized row is divided by its own kernel's plain row, not by grouped_mm.
    assert rows[quantized]["x_plain"] == pytest.approx(
        rows[quantized]["ms"] / rows["moewire/stand-in"]["ms"])
    assert "x_plain" not in rows["moewire/stand-in"]
    assert doc["config"]["layers"] == 1 and doc["config"]["device"] == "cpu"
    printed = capsys.readouterr().out
    assert quantized in printed and "x grouped_mm" in printed
