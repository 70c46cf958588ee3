"""The SM90 integration on CPU: its flavour, adapter and refusals, on a stand-in buffer whose
views share no storage with ``.buffer`` (like the real SM90 build's DLPack views) and a
stand-in kernel that writes the combine rows where PR #323 does and sums them as it does."""

from __future__ import annotations

import sys
import types
import zlib

import pytest
import torch
from torch import nn

import moewire
from moewire.integrations import deepgemm_sm90 as sm90
from moewire.megamoe import flavours, layout_check
from moewire.megamoe.layout import combine_rows

T, TMAX, H, K, E = 12, 16, 64, 4, 8


def _dlpack(t: torch.Tensor) -> torch.Tensor:
    return torch.utils.dlpack.from_dlpack(t.__dlpack__())


def make_buffer() -> types.SimpleNamespace:
    """Regions x | x_sf | topk_idx | topk_weights | l2_acts_sf | combine rows, views by DLPack."""
    sizes = [TMAX * H * 2, TMAX * 4, TMAX * K * 8, TMAX * K * 4, TMAX * 4, K * TMAX * H * 2]
    flat = torch.zeros(sum(sizes), dtype=torch.int8)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def view(i, dtype, shape):
        return _dlpack(flat[starts[i] : starts[i] + sizes[i]].view(dtype).view(shape))

    return types.SimpleNamespace(
        buffer=flat, num_max_tokens_per_rank=TMAX, num_topk=K, hidden=H, group=None,
        x=view(0, torch.bfloat16, (TMAX, H)), x_sf=view(1, torch.float32, (TMAX,)),
        topk_idx=view(2, torch.int64, (TMAX, K)), topk_weights=view(3, torch.float32, (TMAX, K)),
        l2_acts_sf=view(4, torch.float32, (TMAX,)),
    )


def stage(hidden_states, topk_idx, topk_weights, buf):
    n = hidden_states.shape[0]
    buf.x[:n].copy_(hidden_states)
    buf.topk_idx[:n].copy_(topk_idx)
    buf.topk_weights[:n].copy_(topk_weights)


def fp8_mega_moe(y, l1, l2, buf, **kwargs):
    """Rows (slot s, token t) = w[t, s] * x[t] * l2[expert] in BF16 at the tail; y = the FP32
    ascending sum of the valid rows, one BF16 rounding. DG_COMM_KERNEL_DEBUG zeroes all."""
    n = y.shape[0]
    rows = buf.buffer[buf.buffer.numel() - K * TMAX * H * 2 :].view(torch.bfloat16)
    rows = rows.view(K, TMAX, H)
    ids, w, x = buf.topk_idx[:n], buf.topk_weights[:n], buf.x[:n].float()
    acc = torch.zeros(n, H)
    for s in range(K):
        valid = ids[:, s] >= 0
        row = (x * w[:, s, None] * l2[ids[:, s].clamp(min=0)]).bfloat16()
        rows[s, :n][valid] = row[valid]
        acc = torch.where(valid[:, None], acc + rows[s, :n].float(), acc)
    y.copy_(acc.bfloat16())
    if sm90.os.environ.get("DG_COMM_KERNEL_DEBUG", "0") != "0":
        buf.buffer.zero_()


kernels_ns = types.SimpleNamespace(fp8_mega_moe=fp8_mega_moe)


class UserExperts(nn.Module):
    def __init__(self, buf):
        super().__init__()
        self.buf = buf
        g = torch.Generator().manual_seed(zlib.crc32(b"sm90-cpu-l2"))
        self.register_buffer("l2", torch.randn(E, H, generator=g))

    def forward(self, hidden_states, topk_weights, topk_ids):
        stage(hidden_states, topk_ids, topk_weights, self.buf)
        y = torch.empty_like(hidden_states)
        kernels_ns.fp8_mega_moe(y, None, self.l2, self.buf)
        return y


sm90.register_sm90_experts(UserExperts, forward_module=__name__, stage_fn="stage",
                           kernel_ns="kernels_ns", get_symm_buffer=lambda m: m.buf)


def batch(tag: str):
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    x = torch.randn(T, H, generator=g).bfloat16()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K)
    masked = torch.rand(T, K, generator=g) < 0.3
    masked[-2:] = True
    return x, w.masked_fill(masked, 0.0), ids.masked_fill(masked, -1)


@pytest.fixture(autouse=True)
def _fresh():
    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


def test_flavour_locates_rows_by_data_ptr_on_views_without_shared_storage():
    buf = make_buffer()
    assert buf.l2_acts_sf.untyped_storage().data_ptr() != buf.buffer.untyped_storage().data_ptr()
    rows = combine_rows(buf, sm90.FLAVOUR, "fp8_mega_moe")
    assert rows.data_ptr() - buf.buffer.data_ptr() == buf.buffer.numel() - K * TMAX * H * 2
    assert rows.shape == (K, TMAX, H)


def test_quantize_a_user_module_calling_the_sm90_api():
    module = UserExperts(make_buffer())
    x, w, ids = batch("user")
    y_plain = module(x, w, ids)
    moewire.quantize(module, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "bf16"}}]})
    assert torch.equal(module(x, w, ids).view(torch.int16), y_plain.view(torch.int16))
    assert layout_check.layout_checked(module.buf)
    moewire.quantize(module, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}}]})
    y = module(x, w, ids)
    rows = combine_rows(module.buf, sm90.FLAVOUR, "fp8_mega_moe")[:, :T]
    q = moewire.formats.fake_quant(rows, "mxfp8").float()
    acc = torch.zeros(T, H)
    for s in range(K):
        acc = torch.where((ids[:, s] >= 0)[:, None], acc + q[s], acc)
    assert torch.equal(y.view(torch.int16), acc.bfloat16().view(torch.int16))
    assert not torch.equal(y.view(torch.int16), y_plain.view(torch.int16))


def test_debug_env_refuses_the_combine_before_the_kernel(monkeypatch):
    module = UserExperts(make_buffer())
    x, w, ids = batch("debug")
    module(x, w, ids)
    rows_before = combine_rows(module.buf, sm90.FLAVOUR, "fp8_mega_moe").clone()
    moewire.quantize(module, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}}]})
    monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", "1")
    with pytest.raises(RuntimeError, match="DG_COMM_KERNEL_DEBUG=1 is set.*unset"):
        module(x, w, ids)
    rows_after = combine_rows(module.buf, sm90.FLAVOUR, "fp8_mega_moe")
    assert torch.equal(rows_after.view(torch.int16), rows_before.view(torch.int16))
    assert not layout_check.layout_checked(module.buf)
    module.combine_quantizer.disable()
    module(x, w, ids)  # the combine off: the kernel runs (and zeroes the buffer)
    assert not module.buf.buffer.any()


def test_debug_env_zero_means_unset(monkeypatch):
    module = UserExperts(make_buffer())
    moewire.quantize(module, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "bf16"}}]})
    monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", "0")
    module(*batch("zero"))
    assert layout_check.layout_checked(module.buf)


@pytest.mark.parametrize(
    ("l1_shape", "l2_shape", "dtype", "match"),
    [
        ((2, 256, 128), (2, 128, 128), torch.float32, "must be BF16"),
        ((2, 256, 128), (2, 128, 64), torch.bfloat16, r"l2 must be \[E, H, I\]"),
        ((2, 256, 192), (2, 192, 128), torch.bfloat16, "multiples of 128"),
    ],
    ids=["fp32-weights", "l2-shape", "hidden-not-128"],
)
def test_quantize_weights_refuses(l1_shape, l2_shape, dtype, match):
    with pytest.raises(ValueError, match=match):
        sm90.quantize_weights(torch.zeros(l1_shape, dtype=dtype),
                              torch.zeros(l2_shape, dtype=dtype), "fp8_mega_moe")


@pytest.mark.parametrize("where", ["quantize_weights", "module"], ids=["weights", "module"])
def test_unknown_kernel_refused(where):
    with pytest.raises(ValueError, match="kernel must be one of"):
        if where == "module":
            sm90.SM90MegaMoEExperts(None, None, make_buffer(), "bf16_mega_moe")
        else:
            z = torch.zeros(1, 256, 128, dtype=torch.bfloat16)
            sm90.quantize_weights(z, torch.zeros(1, 128, 128, dtype=torch.bfloat16), "nope")


def test_too_many_tokens_refused():
    module = sm90.SM90MegaMoEExperts(None, None, make_buffer(), "fp8_mega_moe")
    x = torch.zeros(TMAX + 1, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exceed the buffer's capacity"):
        module(x, torch.zeros(TMAX + 1, K), torch.zeros(TMAX + 1, K, dtype=torch.long))


def test_missing_package_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    with pytest.raises(RuntimeError, match="cannot import deep_gemm.*build_kit.sh"):
        sm90.deep_gemm.fp8_mega_moe  # noqa: B018


def test_package_without_sm90_kernels_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))
    with pytest.raises(RuntimeError, match="not the SM90 Mega-MoE build"):
        sm90.deep_gemm.fp8_mega_moe  # noqa: B018


def test_flavour_refuses_a_buffer_without_l2_acts_sf():
    buf = make_buffer()
    del buf.l2_acts_sf
    with pytest.raises(ValueError, match="l2_acts_sf"):
        combine_rows(buf, sm90.FLAVOUR, "fp8_mega_moe")
    assert sm90.FLAVOUR in flavours.names()
