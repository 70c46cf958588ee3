"""What the engines' serving-scales end-to-end tests share (``tests/vllm`` and
``tests/sglang``, each in its own venv): the calibration in transformers, run by
``tests/hf_transformers/serving_scales_source.py`` under the Python that has transformers
5.23, and the files a loader must refuse, made from the served one."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from moewire.megamoe.scales_file import read_scales, write_scales

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "hf_transformers" / "serving_scales_source.py"
RECIPE = "moe_fp8_dispatch_nvfp4_combine"


def transformers_python() -> str:
    python = os.environ.get("MOEWIRE_TRANSFORMERS_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    if not Path(python).is_file():
        pytest.fail(f"no Python with transformers 5.23 at {python}: run `make test` once (it "
                    "builds .venv) or set MOEWIRE_TRANSFORMERS_PYTHON")
    return python


def calibrate(out: Path) -> Path:
    """``out`` after ``serving_scales_source.py`` wrote into it (checkpoint, scales, batch)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    done = subprocess.run([transformers_python(), str(SOURCE), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _other_layer_count(path: Path, out: Path) -> Path:
    scales = read_scales(path)
    more = {n.replace("layers.0.", "layers.1."): s for n, s in scales.items()}
    return write_scales(out, scales | more)


def _renamed(served: str, other: str) -> Callable[[Path, Path], Path]:
    def make(path: Path, out: Path) -> Path:
        scales = read_scales(path)
        return write_scales(out, {n.replace(served, other): s for n, s in scales.items()})

    return make


def refused(served: str, other: str, other_host: str) -> dict[str, tuple]:
    """``case: (how the file is made from the served one, the recipe served, the refusal)``
    for an engine whose experts sit under ``model.layers.N.<served>.experts``: the names of
    ``other_host`` (``<other>``), two layers for one, another format, not a scales file."""
    return {
        f"{other_host}-names": (
            _renamed(f".{served}.", f".{other}."), RECIPE,
            rf"has scales for \['model\.layers\.0\.{other}\.experts\..*no such module"),
        "two-layers-for-one": (
            _other_layer_count, RECIPE,
            rf"has scales for \['model\.layers\.1\.{served}\.experts\..*no such module"),
        "other-format": (lambda path, out: path, "moe_fp8",
                         r"combine_quantizer was saved with format 'nvfp4'"),
        "not-a-scales-file": (lambda path, out: out.write_text('{"quantizers": {}}') and out,
                              RECIPE, r"load_scales: .*bad\.json"),
    }
