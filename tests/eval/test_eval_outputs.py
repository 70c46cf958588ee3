"""What ``moewire eval`` leaves in ``--out``: a ``results.json`` a script can compare across
runs (schema, versions, absolute checkpoint, config and text hashes), no earlier run's file
beside the new ones, and after Ctrl-C only complete files and the ``INTERRUPTED`` marker."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers.integrations.moe")

import torch  # noqa: E402
import transformers  # noqa: E402
from eval_helpers import TEXT  # noqa: E402

import moewire
from moewire.eval import EvalError, evaluate, runner
from moewire.outputs import INTERRUPTED, MANIFEST, prepare_output_dir

SMALL = {"text": TEXT, "max_tokens": 32, "seq_len": 32, "device": "cpu"}


def _earlier_per_layer_run(out) -> None:
    """The files an earlier ``--per-layer --budget`` run left (its manifest lists them)."""
    earlier = prepare_output_dir(out, "eval", runner.FILES, False, print)
    for name in ("results.json", "kl.png", "mixed_recipe.yaml"):
        earlier.write(name, "earlier")
    earlier.complete()


def test_a_reused_directory_is_refused_then_replaced_whole_with_force(checkpoint, tmp_path,
                                                                      monkeypatch):
    """An earlier run's files are refused before the model loads; with force they are all
    removed (the log says so) and the new run's results.json records what a script needs to
    compare it with another: schema, versions, the absolute checkpoint path (given here
    relative), the hash of its config.json, and the text's source and hash."""
    path = checkpoint("qwen3_moe")
    out = tmp_path / "out"
    _earlier_per_layer_run(out)

    def not_loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    with monkeypatch.context() as m:
        m.setattr(runner, "_load", not_loaded)
        with pytest.raises(EvalError, match=r"^--out: .* holds the files of an earlier run "
                           r"\(kl.png, mixed_recipe.yaml, results.json\), .* --force"):
            evaluate(path, [("fp8", "nvfp4")], out_dir=out, log=lambda s: None, **SMALL)
    assert (out / "mixed_recipe.yaml").read_text() == "earlier"

    monkeypatch.chdir(path.parent)
    lines: list[str] = []
    evaluate(path.name, [("fp8", "nvfp4")], out_dir=out, force=True, text_source="t.txt",
             log=lines.append, **SMALL)
    assert f"eval: --force: removed the earlier run's kl.png, mixed_recipe.yaml, results.json " \
           f"from {out}" in lines
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "kl.png", "results.json"]
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["files"] == ["results.json", "kl.png"] and manifest["complete"] is True
    report = json.loads((out / "results.json").read_text())
    assert report["schema"] == runner.SCHEMA and report["complete"] is True
    assert report["versions"] == {"moewire": moewire.__version__, "torch": torch.__version__,
                                  "transformers": transformers.__version__,
                                  "python": report["versions"]["python"]}
    assert report["checkpoint"] == str(path.resolve()) and os.path.isabs(report["checkpoint"])
    assert report["config_sha256"] == hashlib.sha256(
        (path / "config.json").read_bytes()).hexdigest()
    assert report["text"] == {"source": "t.txt", "chars": len(TEXT),
                              "sha256": hashlib.sha256(TEXT.encode()).hexdigest()}
    assert [r["name"] for r in report["pairs"]] == ["bf16:bf16", "fp8:nvfp4"]
    assert report["settings"]["pairs"] == [["fp8", "nvfp4"]]
    assert report["settings"]["out_dir"] == str(out) and report["settings"]["force"] is True
    assert "text" not in report["settings"]


def test_the_embedded_text_is_named_as_the_source(checkpoint):
    report = evaluate(checkpoint("qwen3_moe"), [("fp8", "nvfp4")], max_tokens=32, seq_len=32,
                      device="cpu", log=lambda s: None)
    text = (Path(moewire.__file__).parent / "data" / "calibration.txt").read_text()
    assert report["text"] == {"source": "moewire/data/calibration.txt (embedded)",
                              "chars": len(text),
                              "sha256": hashlib.sha256(text.encode()).hexdigest()}


def test_ctrl_c_after_the_metrics_leaves_them_and_the_marker(checkpoint, tmp_path, monkeypatch):
    """Interrupted while the mixed recipe is fitted: results.json (the measured runs, marked
    incomplete) stays, kl.png was never started, INTERRUPTED says so, and the interrupt
    propagates."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "_mixed", interrupted)
    out = tmp_path / "out"
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        evaluate(checkpoint("qwen3_moe"), [("fp8", "nvfp4")], per_layer=("nvfp4", "nvfp4"),
                 budget=1.0, out_dir=out, log=lines.append, **SMALL)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, INTERRUPTED, "results.json"]
    report = json.loads((out / "results.json").read_text())
    assert report["complete"] is False
    assert [r["name"] for r in report["pairs"]] == ["bf16:bf16", "fp8:nvfp4"]
    assert set(report["per_layer"]["kl_by_layer"]) == {"0", "1"}
    assert json.loads((out / MANIFEST).read_text())["interrupted"] is True
    assert lines[-1] == (f"eval: interrupted; {out} holds only complete files (INTERRUPTED "
                         "lists them)")


def test_ctrl_c_before_any_file_leaves_the_directory_empty_and_the_hub_online(
        checkpoint, tmp_path, monkeypatch):
    """Interrupted while the model loads: --out holds nothing (no manifest either); and moewire
    never set HF_HUB_OFFLINE itself (task datasets may download when the user allows)."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(runner, "_load", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        evaluate(checkpoint("qwen3_moe"), [("fp8", "nvfp4")], out_dir=out, log=lambda s: None,
                 **SMALL)
    assert list(out.iterdir()) == []
    assert "HF_HUB_OFFLINE" not in os.environ
