"""vLLM main's Mega-MoE paths on CPU, against stand-ins written to their contracts.

No vLLM needed (these run in ``make test``): each stand-in module plays both the experts'
module and the bridge, and is registered through moewire's own site entry for the path
(``moewire.integrations.vllm.sites.SITES``, module name replaced), with the stand-in
kernel ``moewire.reference.deep_gemm`` as the DeepGEMM build:

- the backend shape (``DeepGemmSm100MegaMoEBackend.run_mega_moe``): ``_main_backend``;
- gpt-oss's modular ``DeepGemmMegaExperts`` held by the MoE layer: ``_main_gptoss``;
- upstream DeepGEMM's ``bf16_mega_moe`` (54e2261): the stand-in experts on ``deepgemm-main``.

vLLM main's Hopper ``DeepseekV4MegaMoESM90Experts`` runs in ``tests/real_kernel`` (CPU and
H200). The oracle re-sums the quantized rows itself (ascending valid slots in FP32, one
BF16 rounding, the fused shared row at its build's end).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
import zlib

import _main_backend
import _main_gptoss
import pytest
import torch
from torch import nn

import moewire
from layout_proof import slots_proven
from moewire import formats
from moewire.integrations.vllm import sites as vllm_sites
from moewire.megamoe import flavours, layout_check
from moewire.megamoe.convert import is_converted
from moewire.megamoe.registry import register_experts_class
from moewire.reference import MegaMoEExperts, deep_gemm, forward_context

E, K, H, INTER, T = 8, 3, 512, 512, 24


def _site(name: str, **changes) -> vllm_sites.ExpertsSite:
    site = next(s for s in vllm_sites.SITES if s.cls_name == name)
    return dataclasses.replace(site, **changes)


def _register(cls, site, module) -> None:
    register_experts_class(
        cls if site.holder is None else vllm_sites.holder_class(site),
        vllm_sites.site_adapter(
            site, cls, forward_module=module.__name__, stage_globals=site.stage_fns,
            flavour=lambda m: flavours.detect(module.deep_gemm).name,
            ep_group=lambda m: None, runtime=lambda: "a vLLM main stand-in"))


BACKEND_SITE = _site("DeepseekV4MegaMoEExperts", module=_main_backend.__name__,
                     cls_name="BackendExperts", access_modules=())
GPTOSS_SITE = _site("DeepGemmMegaExperts", module=_main_gptoss.__name__,
                    holder_class=f"{_main_gptoss.__name__}:MoELayer")
_register(_main_backend.BackendExperts, BACKEND_SITE, _main_backend)
_register(_main_gptoss.DeepGemmMegaExperts, GPTOSS_SITE, _main_gptoss)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    # The stand-in's build: vLLM 0.33's (fused shared row first) unless a test says another.
    monkeypatch.setenv(deep_gemm.ENV_FLAVOUR, "vllm-0.33")
    layout_check.reset_layout_checks()
    monkeypatch.setitem(sys.modules, "deep_gemm", deep_gemm)  # `import deep_gemm` (gpt-oss)
    yield
    layout_check.reset_layout_checks()


def _batch(tag: str, experts: int = E):
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    x = torch.randn(T, H, generator=g).bfloat16()
    w, ids = torch.randn(T, experts, generator=g).softmax(-1).topk(K)
    masked = torch.rand(T, K, generator=g) < 0.25
    masked[-2:] = True
    return x, w.masked_fill(masked, 0.0), ids.masked_fill(masked, -1)


def _oracle(buf, t, fmt=None, amax=None, shared=None) -> torch.Tensor:
    """Per token: FP32 from +0.0, the valid rows (each through ``fmt``) in slot order, the
    fused shared row (unquantized) ``"first"`` or ``"last"``; one BF16 rounding."""
    rows = buf.combine_rows()[:, :t]
    ids = buf.topk_idx[:t]
    routed = rows[:K] if fmt is None else formats.fake_quant(rows[:K], fmt, amax)
    acc = torch.zeros(t, H)
    order = [*(["s"] if shared == "first" else []), *range(K), *(["s"] if shared == "last" else [])]
    for s in order:
        acc = acc + rows[K].float() if s == "s" else torch.where(
            (ids[:, s] >= 0)[:, None], acc + routed[s].float(), acc)
    return acc.bfloat16()


def _same(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _combine(fmt, amax=None):
    cfg = {"format": fmt, **({"constant_amax": amax} if amax is not None else {})}
    return {"quant_cfg": [{"quantizer_name": "*combine_quantizer", "cfg": cfg}]}


def _dispatch(fmt, amax):
    return {"quant_cfg": [{"quantizer_name": "*dispatch_quantizer",
                           "cfg": {"format": fmt, "constant_amax": amax}}]}


# -- the backend shape -------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused-shared-first"])
def test_backend_shape_is_recognised_and_its_combine_bit_exact(fused):
    """run_mega_moe passes the shared weights and None activation arguments by keyword;
    moewire's combine equals the oracle, the fused shared row added first (vllm-0.33).
    Break: reading the shared row last (vllm-0.32) fails the layout check below."""
    assert vllm_sites.recognise(_main_backend.BackendExperts, BACKEND_SITE) is None
    experts = _main_backend.BackendExperts(E, K, H, INTER, T, fused_shared=fused)
    x, w, ids = _batch("backend")
    pad = torch.zeros(T, dtype=torch.bool)
    pad[:2] = True
    with forward_context(pad):
        y_plain = experts(x, w, ids, activation_clamp=10.0)
        buf = experts.get_symm_buffer()
        assert (buf.topk_idx[:2] == -1).all()
        assert _same(_oracle(buf, T, shared="first" if fused else None), y_plain)
        moewire.quantize(experts, _combine("bf16"))
        assert _same(experts(x, w, ids, activation_clamp=10.0), y_plain)
        assert slots_proven(buf)
        moewire.quantize(experts, _combine("mxfp8"))
        y = experts(x, w, ids, activation_clamp=10.0)
    assert _same(_oracle(buf, T, "mxfp8", shared="first" if fused else None), y)
    assert not _same(y, y_plain)


def _one_row_early(buf, nbytes, where):
    return buf.buffer.numel() - nbytes - 2 * buf.hidden


def _wrong_layout(monkeypatch, shared: str | None) -> None:
    """Read fp8_fp4_mega_moe's rows one token row early (``MOEWIRE_FLAVOUR``); the rule
    and the flavour live for this test only."""
    name = f"test-one-row-early-{shared}"
    monkeypatch.setitem(flavours.BASE_RULES, "test_one_row_early", _one_row_early)
    monkeypatch.setitem(flavours._REGISTRY, name, flavours.Flavour(name, {
        "fp8_fp4_mega_moe": flavours.KernelLayout("test_one_row_early", shared)}))
    monkeypatch.setenv(flavours.ENV_FLAVOUR, name)


def test_backend_shape_with_a_wrong_layout_is_refused(monkeypatch):
    """Break: a base rule one row early; refused in the first batch, y never replaced."""
    experts = _main_backend.BackendExperts(E, K, H, INTER, T, fused_shared=True)
    _wrong_layout(monkeypatch, "first")
    moewire.quantize(experts, _combine("bf16"))
    with pytest.raises(RuntimeError, match="layout check failed"):
        experts(*_batch("wrong-layout"), activation_clamp=10.0)
    assert not layout_check.layout_checked(experts.get_symm_buffer())


def test_backend_dispatch_reaches_the_staging_global():
    experts = _main_backend.BackendExperts(E, K, H, INTER, T)
    x, w, ids = _batch("dispatch")
    amax = float(x.float().abs().max())
    xq = formats.fake_quant(x, "fp8", amax)
    assert not _same(xq, x)
    experts(xq, w, ids, activation_clamp=None)
    buf = experts.get_symm_buffer()
    want = buf.x[:T].clone()
    moewire.quantize(experts, _dispatch("fp8", amax))
    experts(x, w, ids, activation_clamp=None)
    assert torch.equal(buf.x[:T].view(torch.int8), want.view(torch.int8))


_OLD_MAIN = '''
from torch import nn
deep_gemm = None  # vllm.utils.deep_gemm, imported at module level
def prepare_megamoe_inputs(*args, **kwargs):
    pass
class DeepseekV4MegaMoEExperts(nn.Module):
    def forward(self, x, w, ids):
        prepare_megamoe_inputs(x)
        deep_gemm.fp8_fp4_mega_moe(x)
        return x
'''


def test_older_main_shape_without_the_backend_is_refused(tmp_path, monkeypatch):
    """Two stored main versions of model.py call deep_gemm.fp8_fp4_mega_moe on vLLM's
    utils module, never through the backend: what that name resolves to is not read here,
    so the site does not recognise the shape."""
    (tmp_path / "old_main_dsv4.py").write_text(_OLD_MAIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("old_main_dsv4")
    why = vllm_sites.recognise(module.DeepseekV4MegaMoEExperts,
                               _site("DeepseekV4MegaMoEExperts", module="old_main_dsv4"))
    assert why == "old_main_dsv4 never calls run_mega_moe(...)"


def test_a_fifth_unknown_kernel_fails_closed(monkeypatch):
    """A backend calling a Mega-MoE kernel no build describes: the forward runs, then
    moewire refuses (the combine was never hooked), naming the kernels it knows."""
    namespace = types.ModuleType("deep_gemm")
    namespace.__dict__.update({n: getattr(deep_gemm, n) for n in dir(deep_gemm)
                               if not n.startswith("__")})
    namespace.fp16_mega_moe = deep_gemm.fp8_fp4_mega_moe
    experts = _main_backend.BackendExperts(E, K, H, INTER, T)
    monkeypatch.setattr(_main_backend, "KERNEL", "fp16_mega_moe")
    monkeypatch.setattr(_main_backend, "deep_gemm", namespace)
    moewire.quantize(experts, _combine("bf16"))
    with pytest.raises(RuntimeError, match="finished without reaching moewire's kernel hook"):
        experts(*_batch("fifth"), activation_clamp=None)


# -- gpt-oss's modular experts -------------------------------------------------------------


def test_gptoss_modular_experts_quantized_through_the_holding_layer(monkeypatch):
    """Only the layer holding a DeepGemmMegaExperts is converted; the inline cast (gran_k
    32, packed) stages fake_quant(x); the combine equals the oracle (deepgemm-main)."""
    monkeypatch.setenv(deep_gemm.ENV_FLAVOUR, "deepgemm-main")
    model = nn.ModuleDict({
        "mega": _main_gptoss.MoELayer(E, K, H, INTER, T),
        "other": _main_gptoss.MoELayer(E, K, H, INTER, T, mega=False),
    })
    layer = model["mega"]
    buf = layer.quant_method.moe_kernel.fused_experts.buffer
    x, w, ids = _batch("gptoss")
    y_plain = layer(x, w, ids)
    assert _same(_oracle(buf, T), y_plain)
    moewire.quantize(model, _combine("mxfp8"))
    assert is_converted(layer) and not is_converted(model["other"])
    y = layer(x, w, ids)
    assert flavours.detect(deep_gemm).name == "deepgemm-main"
    assert _same(_oracle(buf, T, "mxfp8"), y) and not _same(y, y_plain)
    amax = float(x.float().abs().max())
    layer.combine_quantizer.disable()
    layer(formats.fake_quant(x, "fp8", amax), w, ids)
    want = (buf.x[:T].clone(), buf.x_sf[:T].clone())
    moewire.quantize(model, _dispatch("fp8", amax))
    layer(x, w, ids)
    assert torch.equal(buf.x[:T].view(torch.int8), want[0].view(torch.int8))
    assert torch.equal(buf.x_sf[:T], want[1])


def test_gptoss_wrong_layout_is_refused(monkeypatch):
    monkeypatch.setenv(deep_gemm.ENV_FLAVOUR, "deepgemm-main")
    layer = _main_gptoss.MoELayer(E, K, H, INTER, T)
    _wrong_layout(monkeypatch, None)
    moewire.quantize(layer, _combine("bf16"))
    with pytest.raises(RuntimeError, match="layout check failed"):
        layer(*_batch("gptoss-wrong"))


# -- upstream DeepGEMM's bf16_mega_moe ------------------------------------------------------


def test_bf16_mega_moe_on_deepgemm_main_is_quantized(monkeypatch):
    """Refused before (deepgemm-main listed fp8_fp4_mega_moe only): now the combine region
    last, weighted rows, ascending order; bit-exact with a BF16 combine, the oracle with
    MXFP8."""
    monkeypatch.setenv(deep_gemm.ENV_FLAVOUR, "deepgemm-main")
    experts = MegaMoEExperts(E, K, H, INTER, T, mma_type="bf16xbf16", device="cpu")
    assert flavours.detect(deep_gemm).name == "deepgemm-main"
    x, w, ids = _batch("bf16")
    y_plain = experts(x, w, ids)
    moewire.quantize(experts, _combine("bf16"))
    assert _same(experts(x, w, ids), y_plain)
    assert layout_check.layout_checked(experts.symm_buffer)
    moewire.quantize(experts, _combine("mxfp8"))
    y = experts(x, w, ids)
    assert _same(_oracle(experts.symm_buffer, T, "mxfp8"), y) and not _same(y, y_plain)


def test_bf16_buffer_with_a_region_after_the_combine_read_as_main_is_refused(monkeypatch):
    """A bf16 buffer whose combine region is not last (vLLM 0.33's: a combine_norm_buffer
    follows it) read with deepgemm-main's last-region rule: a clear refusal."""
    monkeypatch.setenv(deep_gemm.ENV_FLAVOUR, "vllm-0.33")
    experts = MegaMoEExperts(E, K, H, INTER, T, mma_type="bf16xbf16", device="cpu")
    monkeypatch.setenv(flavours.ENV_FLAVOUR, "deepgemm-main")
    moewire.quantize(experts, _combine("bf16"))
    with pytest.raises(RuntimeError, match="layout check failed"):
        experts(*_batch("bf16-wrong"))


@pytest.mark.modelopt
def test_a_holder_class_is_left_out_of_modelopt():
    """ModelOpt converts every instance of a registered class; the MoE layer class is
    moewire's only for instances holding the modular experts, so it is not registered
    there. Break: dropping the filter in modelopt._register_classes registers it."""
    modelopt = pytest.importorskip("moewire.integrations.modelopt")
    modelopt._register_classes([_main_gptoss.MoELayer])
    assert _main_gptoss.MoELayer not in modelopt.registered_classes()
