"""The stand-in kernel's ``DG_USE_FP8_COMBINE=1`` mode (sgl-deep-gemm 0.2.5's FP8 combine):
FP8 rows and UE8M0 bytes in the buffer, reduced in FP32, equal bit for bit to moewire's
``deepgemm_fp8_combine`` format with FP32 accumulation; a BF16 reading of those bytes is
refused by the layout check."""

from __future__ import annotations

import pytest
import torch
from tests.reference.reference_cases import build

from moewire import formats
from moewire.megamoe import flavours, layout_check
from moewire.megamoe.layout import combine_rows
from moewire.megamoe.resum import resum
from moewire.quantizer import WireQuantizer

FLAVOUR = "vllm-0.33"


def _pair(monkeypatch, shared: int, seed: int):
    """The same call on a BF16-combine buffer and on an FP8-combine one."""
    plain = build(flavour=FLAVOUR, shared=shared, t=29, seed=seed)
    monkeypatch.setenv("DG_USE_FP8_COMBINE", "1")
    fp8 = build(flavour=FLAVOUR, shared=shared, t=29, seed=seed)
    monkeypatch.delenv("DG_USE_FP8_COMBINE")
    assert fp8.buf.use_fp8_combine and not plain.buf.use_fp8_combine
    return plain, fp8


@pytest.mark.parametrize("shared", [0, 1], ids=["noshared", "shared"])
def test_fp8_rows_are_the_format_of_the_bf16_rows(monkeypatch, shared):
    plain, fp8 = _pair(monkeypatch, shared, seed=3)
    bf16_rows = plain.buf.combine_rows()[:, :29]
    q, sf = fp8.buf.combine_fp8()
    from moewire.reference._numerics import fp8_combine_decode

    got = fp8_combine_decode(q[:, :29], sf[:, :29])
    want = formats.get("deepgemm_fp8_combine").dequantize(bf16_rows)
    k = plain.buf.num_topk
    valid = (plain.topk_idx >= 0).T.unsqueeze(-1)
    assert torch.equal(torch.where(valid, got[:k], 0.0), torch.where(valid, want[:k], 0.0))
    if shared:
        assert torch.equal(got[k], want[k])
    # One UE8M0 byte per (slot, token, 128 columns), right after the FP8 rows.
    start_q, n_q = fp8.buf._moewire_regions["combine"]
    start_sf, n_sf = fp8.buf._moewire_regions["combine_sf"]
    assert start_sf == start_q + n_q and n_sf * 128 == n_q


@pytest.mark.parametrize("shared", [0, 1], ids=["noshared", "shared"])
def test_fp8_combine_y_is_resum_of_the_format_in_fp32_mode(monkeypatch, shared):
    plain, fp8 = _pair(monkeypatch, shared, seed=4)
    shared_position = flavours.get(FLAVOUR).layout("fp8_fp4_mega_moe").shared_position
    bf16_rows = plain.buf.combine_rows()
    quantizer = WireQuantizer("deepgemm_fp8_combine")
    # The shared row is on the FP8 wire too: quantize all slots, add them unquantized.
    rows = bf16_rows.clone()
    k = plain.buf.num_topk
    if shared:
        rows[k, :29] = formats.get("deepgemm_fp8_combine").qdq(rows[k, :29])
    want = resum(rows, plain.topk_idx, 29, shared_position=shared_position if shared else None,
                 row_quantizer=quantizer)
    assert quantizer.accumulate == "fp32"
    assert torch.equal(fp8.y, want)
    assert not torch.equal(fp8.y, plain.y), "the FP8 wire changed nothing: a weak case"


def test_a_bf16_reading_of_fp8_rows_is_refused(monkeypatch):
    monkeypatch.setenv("DG_USE_FP8_COMBINE", "1")
    case = build(flavour=FLAVOUR, t=29, seed=5)
    monkeypatch.delenv("DG_USE_FP8_COMBINE")
    with pytest.raises(ValueError, match="holds DeepGEMM's FP8 combine rows"):
        combine_rows(case.buf, FLAVOUR, "fp8_fp4_mega_moe")


def test_without_the_refusal_the_layout_check_would_still_refuse(monkeypatch):
    """A BF16 view of the FP8 bytes, taken by hand past the refusal, fails the check (the
    FP8 rows take half the bytes: the view holds half the tokens)."""
    monkeypatch.setenv("DG_USE_FP8_COMBINE", "1")
    case = build(flavour=FLAVOUR, t=29, seed=5)
    monkeypatch.delenv("DG_USE_FP8_COMBINE")
    start, _ = case.buf._moewire_regions["combine"]
    n = case.buf.num_topk * case.buf.num_max_tokens_per_rank * case.buf.hidden
    rows = case.buf.buffer[start : start + n].view(torch.bfloat16)
    rows = rows.view(case.buf.num_topk, case.buf.num_max_tokens_per_rank // 2, case.buf.hidden)
    call = layout_check.Combine(rows, case.topk_idx, 29, None, None, case.y,
                                flavours.get(FLAVOUR), "fp8_fp4_mega_moe")
    with pytest.raises(RuntimeError):
        layout_check.check("layers.0.experts", layout_check.buffer_state(case.buf), call)


@pytest.mark.parametrize(
    ("flag", "env", "refused"),
    [(True, "0", True), (False, "1", False), (None, "1", True), (None, "0", False)],
    ids=["buffer_says_fp8", "buffer_says_bf16", "real_buffer_env_on", "real_buffer_env_off"],
)
def test_which_buffers_hold_fp8_rows(monkeypatch, flag, env, refused):
    from types import SimpleNamespace

    from moewire.megamoe.layout import holds_fp8_combine

    monkeypatch.setenv("DG_USE_FP8_COMBINE", env)
    buf = SimpleNamespace() if flag is None else SimpleNamespace(use_fp8_combine=flag)
    assert holds_fp8_combine(buf) is refused


def test_fp8_reader_refuses_a_bf16_buffer():
    case = build(flavour=FLAVOUR, t=5, seed=6)
    with pytest.raises(ValueError, match="built without DG_USE_FP8_COMBINE=1"):
        case.buf.combine_fp8()
