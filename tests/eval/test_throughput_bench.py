"""``benchmarks/eval_throughput.py`` as a small CPU run: both sides measured in one process,
each run's tokens/s as a fraction of the plain forward's, the host peak reset per
measurement, and the JSON it writes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers.integrations.moe")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "eval_throughput.py"


def _bench():
    sys.path.insert(0, str(_PATH.parent))
    spec = importlib.util.spec_from_file_location("eval_throughput", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_host_peak_resets():
    bench = _bench()
    if not bench.reset_host_peak():
        pytest.skip("this kernel has no /proc/self/clear_refs")
    big = bytearray(256 * 2**20)  # touched: 256 MiB resident
    big[::4096] = b"x" * len(big[::4096])
    high = bench.host_peak_bytes()
    del big
    assert bench.reset_host_peak()
    assert bench.host_peak_bytes() < high - 200 * 2**20


def test_a_small_cpu_run_writes_the_table_and_json(tmp_path, capsys):
    bench = _bench()
    code = bench.main(["--device", "cpu", "--layers", "1", "--experts", "4", "--top-k", "2",
                       "--hidden", "128", "--intermediate", "128", "--vocab", "256",
                       "--tokens", "32", "64", "--seq-len", "32", "--pairs", "fp8:nvfp4",
                       "--out", str(tmp_path)])
    assert code == 0
    doc = json.loads((tmp_path / "eval_throughput.json").read_text())
    assert [row["tokens"] for row in doc["rows"]] == [32, 64]
    for row in doc["rows"]:
        assert [run["name"] for run in row["runs"]] == ["bf16:bf16", "fp8:nvfp4"]
        assert row["plain_tokens_per_second"] > 0 and row["eval_host_peak_bytes"] > 0
        for run in row["runs"]:
            assert run["fraction_of_plain"] == pytest.approx(
                run["tokens_per_second"] / row["plain_tokens_per_second"])
        assert row["runs"][0]["kl_mean"] == 0.0 < row["runs"][1]["kl_mean"]
    out = capsys.readouterr().out
    assert "eval tok/s" in out
    assert "of the plain forward's tokens/s" in out
