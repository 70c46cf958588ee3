"""The suite's shared seed and bit-exact helpers say what a failure needs to be replayed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from bitexact import assert_same_bits, same_bits, seed_of


def test_seed_is_stable_across_processes():
    code = "import zlib; print(zlib.crc32(repr(('fmt', 3)).encode()))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert int(other.stdout) == seed_of("fmt", 3)
    assert seed_of("fmt", 3) != seed_of("fmt", 4)


def test_report_names_seed_index_and_bits():
    want = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    got = want.clone()
    got[1, 0] = torch.tensor(3.0, dtype=torch.bfloat16).view(torch.int16).add(1).view(
        torch.bfloat16
    )  # one BF16 ulp
    with pytest.raises(AssertionError) as err:
        assert_same_bits(got, want, seed=1234, what="case")
    text = str(err.value)
    assert "case (seed 1234): 1 of 4 elements differ; first at (1, 0)" in text
    assert "0x4041" in text and "0x4040" in text


def test_nan_matches_nan_and_signed_zero_does_not_match():
    a = torch.tensor([float("nan"), 0.0])
    b = torch.tensor([-float("nan"), 0.0])
    assert_same_bits(a, b, seed=None, what="nan")
    assert not same_bits(torch.tensor([-0.0]), torch.tensor([0.0])).any()


def test_numpy_uint16_is_read_as_bf16_bits():
    t = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    assert_same_bits(t, t.view(torch.int16).numpy().view(np.uint16), seed=None, what="np")
    with pytest.raises(AssertionError, match="dtype"):
        assert_same_bits(t, t.float(), seed=None, what="dtype")
