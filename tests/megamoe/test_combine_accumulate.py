"""The combine's two accumulation modes in the torch path (``resum``), against an
independent NumPy sum: ``bf16`` (QDQ each row to BF16, then the FP32 sum) and ``fp32`` (the
FP32 dequantized rows summed, as the real FP8/FP4 combine kernels do)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from moewire import formats
from moewire.kernels import ACCUMULATE_MODES as KERNEL_MODES
from moewire.megamoe.resum import resum
from moewire.quantizer import WireQuantizer
from moewire.quantizer.config import CfgError, parse_cfg

FMT = "trtllm_16e2m1xbf16"


def _case(seed: int = 4, k: int = 4, t: int = 5, h: int = 64):
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(k, t, h, generator=g) * 3).bfloat16()
    idx = torch.randint(0, 8, (t, k), generator=g)
    idx[1, 2] = -1
    rows[2, 1] = float("nan")  # a stale row under an invalid slot
    return rows, idx


def _oracle(rows, idx, accumulate: str) -> np.ndarray:
    """Slot-ascending FP32 sum of the format's FP32 values (float32 NumPy adds, one per
    slot), each rounded to BF16 first in ``bf16`` mode; one BF16 rounding at the end."""
    fmt = formats.get(FMT)
    k, t, _ = rows.shape
    acc = np.zeros((t, rows.shape[2]), dtype=np.float32)
    for s in range(k):
        v = fmt.dequantize(rows[s]).numpy()
        if accumulate == "bf16":
            v = v.astype(ml_dtypes.bfloat16).astype(np.float32)
        valid = (idx[:, s] >= 0).numpy()[:, None]
        acc = np.where(valid, acc + v, acc).astype(np.float32)
    return acc.astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("accumulate", ["bf16", "fp32"])
def test_resum_mode_matches_its_oracle_and_not_the_other(accumulate):
    rows, idx = _case()
    q = WireQuantizer(FMT, accumulate=accumulate)
    got = resum(rows, idx, 5, row_quantizer=q).float().numpy()
    other = "fp32" if accumulate == "bf16" else "bf16"
    assert np.array_equal(got, _oracle(rows, idx, accumulate))
    assert not np.array_equal(got, _oracle(rows, idx, other)), "data does not separate modes"


def test_quantizer_defaults_to_the_formats_real_kernel_mode():
    assert WireQuantizer(FMT).accumulate == "fp32"
    assert WireQuantizer("deepgemm_fp8_combine").accumulate == "fp32"
    assert WireQuantizer("nvfp4_token").accumulate == "bf16"
    rows, idx = _case(seed=9)
    default = resum(rows, idx, 5, row_quantizer=WireQuantizer(FMT))
    assert torch.equal(default, resum(rows, idx, 5, row_quantizer=WireQuantizer(FMT),
                                      accumulate="fp32"))


def test_a_plain_callable_must_return_fp32_in_fp32_mode():
    rows, idx = _case()
    fmt = formats.get(FMT)
    with pytest.raises(ValueError, match="accumulate='fp32' adds the FP32 dequantized rows"):
        resum(rows, idx, 5, row_quantizer=fmt.qdq, accumulate="fp32")
    got = resum(rows, idx, 5, row_quantizer=fmt.dequantize, accumulate="fp32")
    assert torch.equal(got, resum(rows, idx, 5, row_quantizer=WireQuantizer(FMT)))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: WireQuantizer(FMT, accumulate="fp16"), "accumulate must be one of"),
        (lambda: parse_cfg({"format": FMT, "accumulate": "tf32"}), "accumulate='tf32'"),
        (lambda: resum(*_case(), 5, accumulate="exact"), "resum: accumulate must be one of"),
    ],
    ids=["quantizer", "recipe_cfg", "resum"],
)
def test_unknown_accumulation_mode_is_refused(make, match):
    with pytest.raises((ValueError, CfgError), match=match):
        make()


def test_recipe_cfg_sets_the_mode():
    spec = parse_cfg({"format": FMT, "accumulate": "bf16"})
    assert spec.accumulate == "bf16"
    assert WireQuantizer.from_cfg({"format": FMT, "accumulate": "bf16"}).accumulate == "bf16"
    assert WireQuantizer.from_cfg({"format": FMT}).accumulate == "fp32"


def test_kernels_and_formats_name_the_same_modes():
    assert tuple(KERNEL_MODES) == tuple(formats.ACCUMULATE_MODES)
