"""``flashinfer_nvfp4``'s reciprocal is the GPU's ``rcp.approx.ftz.f32``, bit for bit.

The measurement (``benchmarks/results/rcp-approx/``, made by ``benchmarks/rcp_approx_table.py``
on an H100) holds the instruction's result on the NVFP4 decode scale of every positive
normal BF16 amax. The model (``formats._numerics.rcp_approx_bf16_decode_scale``) must give
each of them; and the format, on BF16 rows built where the approximate and the correctly
rounded reciprocal give different E2M1 codes, must follow the device.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fmt_oracle import RCP_DUMP, expected

from moewire import formats
from moewire.formats._numerics import e2m1_magnitude, mul_recip, rcp_approx_bf16_decode_scale
from moewire.kernels.rcp_approx import DOWN_AT as RCP_APPROX_DOWN_AT
from moewire.kernels.rcp_approx import UP_AT as RCP_APPROX_UP_AT


def _dump() -> dict[str, torch.Tensor]:
    dump = np.load(RCP_DUMP)
    return {k: torch.from_numpy(dump[k].astype(np.int32)) for k in dump.files}


def test_the_model_is_the_measured_instruction_on_every_bf16_amax():
    d = _dump()
    a = d["a_bits"].to(torch.int16).view(torch.bfloat16).float()
    ds = mul_recip(a, 6.0)
    assert torch.equal(ds.view(torch.int32), d["ds_bits"])  # the same decode scales
    normal = ds >= torch.finfo(torch.float32).tiny
    got = rcp_approx_bf16_decode_scale(ds, a).view(torch.int32)
    assert normal.sum() > 32000
    assert torch.equal(got[normal], d["rcp_bits"][normal])
    # The measurement is not the correctly rounded reciprocal: the model has work to do.
    off = (d["rcp_bits"] - torch.reciprocal(ds).view(torch.int32))[normal]
    assert set(off.unique().tolist()) == {-1, 0, 1}
    assert int((off != 0).sum()) == 4024


def test_the_table_is_the_measurement_json():
    report = json.loads((RCP_DUMP.parent / "rcp_approx.json").read_text())
    table = report["offset_by_bf16_significand"]
    assert report["offset_by_bf16_significand_consistent"] is True
    assert [m for m, v in enumerate(table) if v == 1] == list(RCP_APPROX_UP_AT)
    assert [m for m, v in enumerate(table) if v == -1] == list(RCP_APPROX_DOWN_AT)
    assert set(report["significands_whose_offset_changes_with_the_exponent"].values()) == {0}


def _rows_where_the_reciprocal_decides() -> torch.Tensor:
    """BF16 rows of 16-element blocks ``[a, x, 0, ...]`` with ``a`` a BF16 amax whose
    approximate reciprocal is off by one ulp and ``x <= a`` a BF16 element whose E2M1 code
    differs between the two reciprocals."""
    d = _dump()
    a = d["a_bits"].to(torch.int16).view(torch.bfloat16).float()
    ds = mul_recip(a, 6.0)
    exact = torch.reciprocal(ds)
    approx = d["rcp_bits"].view(torch.float32)
    pick = ((approx != exact) & (ds >= 1e-20) & (a <= 1e20)).nonzero().flatten()[::7]
    blocks = []
    for i in pick.tolist():
        steps = torch.arange(0, 6 * 128 + 1, dtype=torch.int32)
        x = (d["a_bits"][i] - steps).clamp(min=0).to(torch.int16).view(torch.bfloat16).float()
        codes = [e2m1_magnitude((x * r).clamp(max=6.0)) for r in (exact[i], approx[i])]
        for v in x[codes[0] != codes[1]][:2].tolist():
            block = torch.zeros(16)
            block[0], block[1] = a[i], v
            blocks.append(block)
    assert len(blocks) > 100
    return torch.stack(blocks).bfloat16()


def test_the_format_follows_the_device_where_the_last_bit_decides():
    rows = _rows_where_the_reciprocal_decides()
    got = formats.fake_quant(rows, "flashinfer_nvfp4")
    assert torch.equal(got.view(torch.int16), expected("flashinfer_nvfp4", rows).view(torch.int16))
    # The correctly rounded reciprocal (the format before the measurement) gives other
    # values on every one of these rows.
    a = rows.float().abs().amax(-1, keepdim=True)
    ds = mul_recip(a, 6.0)
    q = e2m1_magnitude((rows.float().abs() * torch.reciprocal(ds)).clamp(max=6.0))
    naive = (q * ds * rows.float().sign()).bfloat16()
    assert bool((naive != got).any(-1).all())


@pytest.mark.parametrize("negative", [False, True], ids=["positive", "negative"])
def test_the_triton_kernels_follow_the_device_too(negative):
    """The Triton QDQ and the fused combine's ``flashinfer_nvfp4`` branch (under the
    interpreter on CPU, compiled on a GPU) on the same rows: the format's bits."""
    kernels = pytest.importorskip("moewire.kernels")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = _rows_where_the_reciprocal_decides()[:64]
    rows = -rows if negative else rows
    t = rows.shape[0]
    y = rows.repeat(1, 16)  # [T, 256]: 16 blocks per row
    want = formats.fake_quant(y, "flashinfer_nvfp4")
    got = kernels.qdq(y.to(device), "flashinfer_nvfp4", None).cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    buffer = y.unsqueeze(0).contiguous().to(device)  # one top-k slot: the combine is the QDQ
    idx = torch.zeros((t, 1), dtype=torch.int64, device=device)
    out = torch.full((t, 256), float("nan"), dtype=torch.bfloat16, device=device)
    kernels.fused_combine(buffer, idx, t, out, "flashinfer_nvfp4", None, None)
    summed = (0.0 + want.float()).bfloat16()  # the sum starts at +0.0: -0.0 comes back +0.0
    assert torch.equal(out.cpu().view(torch.int16), summed.view(torch.int16))
