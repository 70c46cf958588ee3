"""``moewire study --kernel deepgemm-sm90``: refused with what is missing (CPU), and run on the
real kernel where it exists (``real_kernel``)."""

from __future__ import annotations

import pytest
import torch

from moewire import cli
from moewire.study import StudyConfig, run_study
from moewire.study import real_kernel as study_real
from moewire.study.errors import StudyArgumentError
from moewire.study.settings import validate

SMALL = ["study", "--model", "demo", "--tokens", "128", "--calib-batches", "1",
         "--eval-batches", "1", "--dispatch", "fp8", "--combine", "nvfp4"]


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--device", "cpu"], "--device"),
        (["--device", "cpu", "--mma", "bf16xbf16"], "--mma"),
    ],
    ids=["cpu-device", "bf16-mma"],
)
def test_cli_refuses_with_exit_2(extra, flag, tmp_path, capsys):
    assert cli.main([*SMALL, "--kernel", "deepgemm-sm90", *extra, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag}:" in err
    assert not (tmp_path / "results.json").exists()


def test_unknown_kernel_refused():
    with pytest.raises(StudyArgumentError, match="--kernel: unknown kernel 'sm100'"):
        validate(StudyConfig(kernel="sm100"))


def test_cli_rejects_an_unknown_kernel_choice(capsys):
    assert cli.main([*SMALL, "--kernel", "sm100"]) == 2
    assert "--kernel" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is absent")
def test_says_what_is_missing_without_a_gpu():
    cfg = StudyConfig(kernel="deepgemm-sm90", device="cuda")  # validate would stop at --device
    with pytest.raises(StudyArgumentError, match="--kernel: the real SM90 .*no CUDA device"):
        study_real.check(cfg)


@pytest.mark.real_kernel
def test_study_runs_on_the_real_kernel():
    """The demo layer on fp8_fp4_mega_moe: every pair reported; bf16 x bf16 measures the
    kernel's own run-to-run noise (it is not deterministic), which the quantized pairs
    exceed."""
    cfg = StudyConfig(model="demo", tokens=128, calib_batches=1, eval_batches=1,
                      dispatch=("bf16", "fp8"), combine=("bf16", "nvfp4"), device="cuda",
                      kernel="deepgemm-sm90")
    doc = run_study(cfg)
    assert doc["layer"]["kernel"] == "deepgemm-sm90 fp8_fp4_mega_moe"
    by_pair = {(r["dispatch"], r["combine"]): r for r in doc["results"]}
    assert set(by_pair) == {(d, c) for d in cfg.dispatch for c in cfg.combine}
    noise = by_pair[("bf16", "bf16")]["rel_l2"]
    assert noise < 1e-2
    assert by_pair[("bf16", "nvfp4")]["rel_l2"] > max(noise, 1e-3)
    assert by_pair[("fp8", "nvfp4")]["calibrated"]
