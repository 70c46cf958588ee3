"""The 32-column E8M0 combine formats' scale edges in the Triton kernels, bit for bit against
their torch references: blocks whose ``amax * fl(1/448)`` is an FP32 subnormal (TE's and
FlashInfer's byte 0, FlyDSL's and DeepGEMM's byte 1), underflows to zero, sits just above a
power of two, or is a block of signed zeros. Random data seldom reaches these rows.

Under Triton's interpreter where there is no GPU, compiled on CUDA (marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch

from bitexact import assert_same_bits
from moewire import formats, kernels

pytest.importorskip("triton")

from cases import DEVICES  # noqa: E402

FORMATS = ["flydsl_fp8_blockwise_1x32", "te_mxfp8", "trtllm_32e4m3xe8m0", "flashinfer_mxfp8"]

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _edge_rows() -> torch.Tensor:
    """FP32 [2, 256]: eight 32-column blocks per row, each with one edge amax."""
    amaxes = [2.0**-120, 2.0**-125, 2.0**-149, 0.0, 500.0, 448.0 * (1 + 2.0**-23), 2.0**-100,
              3.0 * 2.0**-130]
    x = torch.zeros(2, 8, 32)
    for b, a in enumerate(amaxes):
        x[0, b, 0], x[0, b, 1], x[0, b, 2] = a, -a / 2, -a / 3
        x[1, b, 0], x[1, b, 5], x[1, b, 6] = -a, a * 0.75, 3 * 2.0**-10
    x[0, 3, 7] = -0.0
    return x.reshape(2, 256)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_equals_reference_at_the_scale_edges(fmt, device):
    x = _edge_rows().to(device)
    got = kernels.qdq(x, fmt, None)
    assert_same_bits(got, formats.get(fmt).reference(x, None), seed=None,
                     what=f"{fmt} scale edges")
