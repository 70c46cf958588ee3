"""moewire on the NVFP4 Mega-MoE (``nvfp4_mega_moe``): weighted (FMA) re-sum, hooks on its
staging and kernel, calibration over unweighted rows, scales that name their rows, and the
refusal of ``fp4_fp4_mega_moe``.

The stand-in is ``moewire.reference.NVFP4MegaMoEExperts`` (vLLM 0.34's NVFP4 forward).
"""

from __future__ import annotations

import zlib
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

import moewire
from moewire import formats
from moewire.megamoe import flavours, layout, layout_check, quant_experts
from moewire.megamoe.resum import resum
from moewire.reference import NVFP4MegaMoEExperts, deep_gemm, forward_context

E, K, H, INTER, TMAX = 8, 3, 256, 256, 24


def _seed(name: str) -> int:
    return zlib.crc32(name.encode()) % 100_000


def _batch(t: int, name: str, masked: float = 0.25, hidden: int = H):
    g = torch.Generator().manual_seed(_seed(name))
    x = torch.randn((t, hidden), generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    ids = ids.masked_fill(torch.rand((t, K), generator=g) < masked, -1)
    w = torch.rand((t, K), generator=g) + 0.1
    return x, w.masked_fill(ids < 0, 0.0), ids


class _Model(nn.Module):
    def __init__(
        self, fused: int = 0, shared_dtype=torch.float8_e4m3fn, seed: int = 0, device="cpu",
        hidden: int = H,
    ):
        super().__init__()
        self.experts = NVFP4MegaMoEExperts(
            E, K, hidden, INTER, TMAX, num_fused_shared_experts=fused, shared_dtype=shared_dtype,
            l2_activation_scale=0.5, seed=seed, device=device,
        )

    def forward(self, x, w, ids):
        return self.experts(x, w, ids)


@pytest.fixture(autouse=True)
def _fresh_checks():
    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


# -- an exact, independent oracle of the weighted combine ------------------------------------


def _round_f32(q: Fraction) -> np.float32:
    if q == 0:
        return np.float32(0.0)
    c = np.float32(float(q))
    cands = [np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))]
    return min(cands, key=lambda v: (abs(Fraction(float(v)) - q),
                                     int(np.array(v).view(np.uint32)) & 1))


def _oracle(rows, ids, w, t, shared, mode="fma", order="ascending", shared_at="last"):
    """BF16 bits ``[T, H]``: FP32 acc from +0, ``fl(r * w + acc)`` per valid slot."""
    rows = rows.float().numpy()
    k = ids.shape[1]
    slots = list(range(k)) if order == "ascending" else list(range(k))[::-1]
    steps = [(s, None) for s in slots]
    if shared:
        steps = [(k, 1.0), *steps] if shared_at == "first" else [*steps, (k, 1.0)]
    out = np.zeros((t, rows.shape[2]), dtype=np.uint16)
    for i in range(t):
        for j in range(rows.shape[2]):
            acc = np.float32(0.0)
            for s, fixed in steps:
                if fixed is None and ids[i, s] < 0:
                    continue
                ws = Fraction(float(np.float32(fixed if fixed is not None else w[i, s])))
                r = Fraction(float(rows[s, i, j]))
                if mode == "fma":
                    acc = _round_f32(r * ws + Fraction(float(acc)))
                else:
                    acc = _round_f32(Fraction(float(_round_f32(r * ws))) + Fraction(float(acc)))
            out[i, j] = torch.tensor(float(acc)).bfloat16().view(torch.int16).numpy().view(
                np.uint16)
    return out


def _bits(y: torch.Tensor) -> np.ndarray:
    return y.view(torch.int16).cpu().numpy().view(np.uint16)


def _crafted():
    """token 0: FMA shows (a, -a with weight 1 + 2^-20); token 1: slot order shows (2^25,
    -2^25, 1); token 2: the shared row added last shows (2^16, -2^16, shared 2^-9), and its
    invalid slot holds NaN."""
    a = 1.0 + 2.0**-7
    rows = torch.zeros((4, 5, 4), dtype=torch.bfloat16)
    rows[0, 0], rows[1, 0] = a, -a
    rows[0, 1], rows[1, 1], rows[2, 1] = 2.0**25, -(2.0**25), 1.0
    rows[0, 2], rows[1, 2], rows[2, 2], rows[3, 2] = 2.0**16, -(2.0**16), float("nan"), 2.0**-9
    ids = torch.tensor([[0, 1, -1], [0, 1, 2], [0, 1, -1]])
    w = torch.tensor([[1 + 2.0**-20, 1 + 2.0**-20, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return rows, ids, w


def test_resum_weights_is_the_fma_in_ascending_order_shared_last():
    rows, ids, w = _crafted()
    y = resum(rows, ids, 3, shared_position="last", weights=w)
    want = _oracle(rows, ids.numpy(), w.numpy(), 3, True)
    np.testing.assert_array_equal(_bits(y), want)
    assert float(y[0, 0]) == -(2.0**-27)
    for kwargs, token in (({"mode": "mul_add"}, 0), ({"order": "descending"}, 1),
                          ({"shared_at": "first"}, 2)):
        other = _oracle(rows, ids.numpy(), w.numpy(), 3, True, **kwargs)
        assert (other[token] != want[token]).all(), kwargs
    # Without weights the same rows add unweighted: the FMA token differs.
    assert float(resum(rows, ids, 3, shared_position="last")[0, 0]) == 0.0


def test_resum_weights_with_a_row_quantizer_quantizes_before_the_fma():
    rows, ids, w = _crafted()
    rows[2, 2] = 0.0
    rows = rows.repeat(1, 1, 8)  # MXFP8 blocks of 32 along H
    q = formats.get("mxfp8")
    y = resum(rows, ids, 3, shared_position="last", weights=w, row_quantizer=lambda r: q.qdq(r))
    qrows = rows.clone()
    qrows[:K] = q.qdq(rows[:K])
    np.testing.assert_array_equal(_bits(y), _oracle(qrows, ids.numpy(), w.numpy(), 3, True))


WEIGHT_REFUSALS = [
    ("float64", lambda w: w.double()),
    ("wrong-k", lambda w: w[:, :2]),
    ("too-few-tokens", lambda w: w[:1]),
    ("one-d", lambda w: w[:, 0]),
    ("not-a-tensor", lambda w: w.tolist()),
]


@pytest.mark.parametrize("bad", [b for _, b in WEIGHT_REFUSALS],
                         ids=[n for n, _ in WEIGHT_REFUSALS])
def test_resum_refuses_bad_weights(bad):
    rows, ids, w = _crafted()
    out = torch.full((3, 4), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="resum: weights must be the staged router weights"):
        resum(rows, ids, 3, shared_position="last", weights=bad(w), out=out)
    assert (out == 7.0).all()


# -- the flavour entry and the layout --------------------------------------------------------


def test_vllm_033_flavour_describes_nvfp4_mega_moe():
    layout_ = flavours.get("vllm-0.33").layout("nvfp4_mega_moe")
    assert (layout_.base_rule, layout_.shared_position, layout_.weighted) == (
        "after_l2_scales", "last", True)
    assert "nvfp4_mega_moe" in flavours.kernel_functions()
    with pytest.raises(ValueError, match="has no Mega-MoE kernel 'nvfp4_mega_moe'"):
        flavours.get("vllm-0.32").layout("nvfp4_mega_moe")


@pytest.mark.parametrize("fused", [0, 1], ids=["routed", "fused-shared"])
def test_combine_rows_of_the_nvfp4_buffer_resum_to_y(fused):
    model = _Model(fused=fused)
    x, w, ids = _batch(17, f"rows{fused}")
    y = model(x, w, ids)
    buf = model.experts.get_symm_buffer()
    rows = layout.combine_rows(buf, "vllm-0.33", "nvfp4_mega_moe", fused_shared=bool(fused))
    start = rows.data_ptr() - buf.buffer.data_ptr()
    assert start == buf.l2_acts_sf.data_ptr() + buf.l2_acts_sf.nbytes - buf.buffer.data_ptr()
    assert start != buf.buffer.numel() - rows.nbytes  # x_scales follow the region
    again = resum(rows, buf.topk_idx[:17], 17, shared_position="last" if fused else None,
                  weights=buf.topk_weights)
    assert torch.equal(again.view(torch.int16), y.view(torch.int16))
    unweighted = resum(rows, buf.topk_idx[:17], 17, shared_position="last" if fused else None)
    assert not torch.equal(unweighted, y)


# -- the quantized module --------------------------------------------------------------------


def _combine_recipe(fmt: str, amax: float | None = None) -> list[dict]:
    cfg: dict = {"format": fmt}
    if amax is not None:
        cfg["constant_amax"] = amax
    return [{"quantizer_name": "*combine_quantizer", "cfg": cfg}]


ROW_LOCAL = [n for n in formats.names() if formats.get(n).row_local and n != "bf16"]


@pytest.mark.parametrize("fmt", ROW_LOCAL)
@pytest.mark.parametrize("fused", [0, 1], ids=["routed", "fused-shared"])
def test_every_row_local_combine_format_through_the_weighted_resum(fmt, fused):
    model = _Model(fused=fused)
    x, w, ids = _batch(9, f"fmt{fmt}{fused}")
    plain = model(x, w, ids)
    buf = model.experts.get_symm_buffer()
    rows = layout.combine_rows(buf, "vllm-0.33", "nvfp4_mega_moe", fused_shared=bool(fused))
    f = formats.get(fmt)
    amax = 40.0 if f.needs_amax else None
    # What the FMA adds per row: the BF16 QDQ, or the FP32 dequantized values for a format
    # whose real combine accumulates in FP32 (the quantizer's default mode).
    q = rows.float()
    dq = f.dequantize if f.combine_accumulate == "fp32" else f.qdq
    q[:K, :9] = dq(rows[:K, :9], None if amax is None else torch.tensor(amax)).float()
    want = _oracle(q[:, :9], buf.topk_idx[:9].numpy(), buf.topk_weights[:9].numpy(), 9,
                   bool(fused))
    moewire.quantize(model, _combine_recipe(fmt, amax))
    y = model(x, w, ids)
    np.testing.assert_array_equal(_bits(y), want)
    # logfmt10 keeps blocks with amax >= 1 in BF16 (these rows): y may equal the plain one.
    assert torch.equal(y, plain) == torch.equal(q[:K, :9], rows[:K, :9].float())


def test_calibration_takes_the_amax_of_the_unweighted_valid_rows():
    model = _Model(fused=1)
    x, w, ids = _batch(13, "calib", masked=0.3)
    w = w * 4.0  # weighted rows would be ~4x larger
    moewire.quantize(model, _combine_recipe("nvfp4"), forward_loop=lambda m: m(x, w, ids))
    buf = model.experts.get_symm_buffer()
    rows = layout.combine_rows(buf, "vllm-0.33", "nvfp4_mega_moe", fused_shared=True)
    valid = (buf.topk_idx[:13] >= 0).T
    routed = rows[:K, :13][valid].float()
    amax = float(model.experts.combine_quantizer.static_amax)
    assert amax == float(routed.abs().max())
    weighted = (rows[:K, :13].float() * buf.topk_weights[:13].T.unsqueeze(-1))[valid]
    assert amax != float(weighted.abs().max())
    assert quant_experts.amax_rows(model.experts) == "unweighted"


def test_dispatch_quantizer_quantizes_the_nvfp4_staging_input_out_of_place():
    model = _Model()
    x, w, ids = _batch(11, "dispatch")
    keep = x.clone()
    ref_x = formats.get("mxfp8").qdq(x)
    expected = model(ref_x, w, ids)
    moewire.quantize(model, [{"quantizer_name": "*dispatch_quantizer",
                              "cfg": {"format": "mxfp8"}}])
    y = model(x, w, ids)
    assert torch.equal(x, keep)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


def test_layout_check_catches_an_unweighted_resum(monkeypatch):
    wrong = flavours.Flavour(
        "test-nvfp4-unweighted",
        {"nvfp4_mega_moe": flavours.KernelLayout("after_l2_scales", "last", weighted=False)},
    )
    monkeypatch.setitem(flavours._REGISTRY, wrong.name, wrong)
    monkeypatch.setenv(flavours.ENV_FLAVOUR, wrong.name)
    model = _Model()
    moewire.quantize(model, _combine_recipe("mxfp8"))
    x, w, ids = _batch(8, "check")
    with pytest.raises(RuntimeError, match="layout check failed"):
        model(x, w, ids)


def test_padding_stays_out_of_the_combine_amax():
    model = _Model()
    x, w, ids = _batch(10, "pad", masked=0.0)
    x[3] *= 1000.0
    pad = torch.zeros(10, dtype=torch.bool)
    pad[3] = True

    def loop(m):
        with forward_context(is_padding=pad):
            m(x, w, ids)

    moewire.quantize(model, _combine_recipe("nvfp4"), forward_loop=loop)
    buf = model.experts.get_symm_buffer()
    rows = layout.combine_rows(buf, "vllm-0.33", "nvfp4_mega_moe")
    keep = torch.ones(10, dtype=torch.bool)
    keep[3] = False
    want = rows[:K, :10][:, keep].float().abs().max()
    assert float(model.experts.combine_quantizer.static_amax) == float(want)


# -- scales name the rows they describe ------------------------------------------------------


def _fp8xfp4_model():
    from moewire.reference import MegaMoEExperts

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = MegaMoEExperts(E, K, 512, 512, TMAX, mma_type="fp8xfp4", device="cpu")

        def forward(self, x, w, ids):
            return self.experts(x, w, ids)

    return M()


@pytest.mark.parametrize("suffix", [".json", ".safetensors"])
def test_load_scales_refuses_an_nvfp4_combine_amax_on_fp8xfp4_rows(tmp_path, suffix):
    # Both kernels at one layer shape (fp8xfp4 needs H % 512): scales load only into a layer
    # of the shape they were calibrated on, so the refusal seen is the rows' weighting.
    nv = _Model(hidden=512)
    x, w, ids = _batch(12, "scales", hidden=512)
    moewire.quantize(nv, _combine_recipe("nvfp4"), forward_loop=lambda m: m(x, w, ids))
    path = moewire.save_scales(nv, tmp_path / f"nv{suffix}")

    fp8 = _fp8xfp4_model()
    moewire.quantize(fp8, _combine_recipe("nvfp4", 30.0))
    fp8.experts.combine_quantizer.constant_amax = None
    g = torch.Generator().manual_seed(1)
    x8 = torch.randn((12, 512), generator=g).bfloat16()
    before = fp8.experts.combine_quantizer.static_amax
    fp8(x8, w, ids)  # the module now knows its kernel leaves weighted rows
    with pytest.raises(ValueError, match="calibrated on unweighted combine rows"):
        moewire.load_scales(fp8, path)
    assert torch.equal(fp8.experts.combine_quantizer.static_amax, before)

    fresh = _fp8xfp4_model()
    moewire.quantize(fresh, _combine_recipe("nvfp4", 30.0))
    fresh.experts.combine_quantizer.constant_amax = None
    moewire.load_scales(fresh, path)  # before any forward: recorded, then refused at use
    with pytest.raises(RuntimeError, match="amax was calibrated on unweighted combine rows"):
        fresh(x8, w, ids)

    again = _Model(hidden=512)
    moewire.quantize(again, _combine_recipe("nvfp4"))
    moewire.load_scales(again, path)
    again(x, w, ids)


# -- fp4_fp4_mega_moe ------------------------------------------------------------------------


class _PostNormExperts(NVFP4MegaMoEExperts):
    """A module calling fp4_fp4_mega_moe (Muse Spark's runner in vLLM 0.34 does)."""

    def __init__(self):
        super().__init__(E, K, H, INTER, TMAX, device="cpu")
        self.kernel_name = "fp4_fp4_mega_moe"


def test_fp4_fp4_mega_moe_is_refused_once_quantized(monkeypatch):
    calls = []
    monkeypatch.setattr(deep_gemm, "fp4_fp4_mega_moe", lambda *a, **k: calls.append(1),
                        raising=False)
    module = _PostNormExperts()
    x, w, ids = _batch(5, "fp4fp4")
    module(x, w, ids)
    assert calls == [1]
    holder = nn.Module()
    holder.experts = module
    moewire.quantize(holder, _combine_recipe("mxfp8"))
    with pytest.raises(RuntimeError, match="calls fp4_fp4_mega_moe, which moewire does not"):
        module(x, w, ids)
    assert calls == [1]


# -- every packaged recipe on the NVFP4 kernel -----------------------------------------------


@pytest.mark.parametrize("name", moewire.recipes.names())
def test_every_packaged_recipe_runs_on_the_nvfp4_kernel(name):
    """Calibrated on one batch, each recipe re-sums the quantized rows with the FMA: the
    quantized output equals the weighted re-sum of the rows it quantized (combine); a
    dispatch quantizer changes the staged tokens."""
    model = _Model()
    x, w, ids = _batch(12, f"recipe-{name}")
    model(x, w, ids)
    plain_x = model.experts.get_symm_buffer().x[:12].clone()
    moewire.quantize(model, name, forward_loop=lambda m: m(x, w, ids))
    y = model(x, w, ids)
    assert torch.isfinite(y.float()).all()
    dispatch, combine = model.experts.dispatch_quantizer, model.experts.combine_quantizer
    assert "quantize" in (dispatch.mode, combine.mode)
    if dispatch.mode == "quantize":
        assert not torch.equal(model.experts.get_symm_buffer().x[:12], plain_x)
    if combine.mode == "quantize":
        buf = model.experts.get_symm_buffer()
        rows = layout.combine_rows(buf, "vllm-0.33", "nvfp4_mega_moe")
        dq = combine.fmt.dequantize if combine.accumulate == "fp32" else combine.fmt.qdq
        want = resum(rows, buf.topk_idx[:12], 12, weights=buf.topk_weights,
                     row_quantizer=lambda r: dq(r, combine.static_amax),
                     accumulate=combine.accumulate)
        assert torch.equal(y.view(torch.int16), want.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "fp8"])
@pytest.mark.parametrize("fused", [0, 1], ids=["routed", "fused-shared"])
def test_nvfp4_kernel_layer_on_cuda_takes_the_weighted_fused_kernel(fmt, fused, monkeypatch):
    """On CUDA the NVFP4 layer's combine runs the fused kernel's weighted mode (the
    one-pass check and quantize, then the plain kernel path once checked) and gives the
    bits of the torch path (``MOEWIRE_DISABLE_KERNELS=1``) on the same rows."""
    from moewire import kernels

    if not kernels.available():
        pytest.skip("moewire.kernels unavailable (no Triton)")
    amax = 40.0 if formats.get(fmt).needs_amax else None
    x, w, ids = _batch(19, f"cuda{fmt}{fused}")
    x, w, ids = x.cuda(), w.cuda(), ids.cuda()
    outs = []
    for disable in ("0", "1"):
        monkeypatch.setenv("MOEWIRE_DISABLE_KERNELS", disable)
        layout_check.reset_layout_checks()
        model = _Model(fused=fused, device="cuda")
        moewire.quantize(model, _combine_recipe(fmt, amax))
        calls = []
        real = kernels.fused_combine

        def recording(*a, _calls=calls, _real=real, **kw):
            _calls.append(kw.get("weights"))
            return _real(*a, **kw)

        monkeypatch.setattr(kernels, "fused_combine", recording)
        outs.append([model(x, w, ids) for _ in range(2)])
        monkeypatch.setattr(kernels, "fused_combine", real)
        if disable == "0":
            assert len(calls) == 2 and all(c is not None for c in calls), "weighted kernel"
        else:
            assert calls == []
    for fast, slow in zip(outs[0], outs[1], strict=True):
        np.testing.assert_array_equal(_bits(fast), _bits(slow))
