"""vLLM main's second wave on CPU, against stand-ins written to each contract.

No vLLM needed (these run in ``make test``). The stand-in modules play both the experts'
module and the bridge and are registered through moewire's own site entries
(``moewire.integrations.vllm.sites.SITES``, module name replaced), on the stand-in kernel:

- the common ``DeepGemmMegaMoEExperts`` (``vllm/models/common/deep_gemm_mega_moe.py``,
  6dfb263): fp8xfp4 through the staging global, bf16xbf16 by a plain copy whose dispatch
  is the forward's own ``hidden_states`` (``_main_common``);
- the refusals: FlashInfer's megakernel experts, an unproven plain copy, a plain copy
  followed by a staging call, vLLM 0.33/0.34's ``fp4_fp4_mega_moe`` (its build alone);
- the DeepGEMM 2.8.0 build entry, recognised on a namespace with its exported signatures;
- DeepSeek V3.2 / GLM-5.2's NVFP4 x NVFP4 experts (``vllm/models/deepseek_v32/nvidia/
  mega_moe.py``) quantized on the stand-in of DeepGEMM 2.8.0's ``fp4_fp4_mega_moe``:
  combine, dispatch, calibration without padding, ``unquantize``, a wrong base refused.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import zlib

import _main_common
import _main_modelopt
import pytest
import torch
from torch import nn

import moewire
from layout_proof import slots_proven
from moewire import formats
from moewire.integrations.vllm import sites as vllm_sites
from moewire.megamoe import api, flavours, layout_check, registry
from moewire.megamoe.builds import BASE_RULES, KernelLayout
from moewire.megamoe.registry import register_experts_class
from moewire.reference import deep_gemm, forward_context

E, K, H, INTER, T = 8, 3, 512, 512, 24
COMMON = _main_common.__name__


def _site(path: str, **changes) -> vllm_sites.ExpertsSite:
    """The entry for the class at ``path`` (vLLM's module.Class), with ``changes``."""
    site = next(s for s in vllm_sites.SITES if s.path == path)
    return dataclasses.replace(site, **changes)


def _register(cls, site) -> None:
    register_experts_class(cls, vllm_sites.site_adapter(
        site, cls, forward_module=COMMON, stage_globals=site.stage_fns,
        flavour=lambda m: flavours.detect(_main_common.deep_gemm).name,
        ep_group=lambda m: None, runtime=lambda: "a vLLM main stand-in"))


COMMON_SITE = _site("vllm.models.common.deep_gemm_mega_moe.DeepGemmMegaMoEExperts",
                    module=COMMON)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    # Every class a test registers is forgotten after it (the registry is process-wide).
    monkeypatch.setattr(registry, "_ADAPTERS", dict(registry._ADAPTERS))
    monkeypatch.setenv(deep_gemm.ENV_FLAVOUR, "vllm-0.33")
    layout_check.reset_layout_checks()
    _register(_main_common.DeepGemmMegaMoEExperts, COMMON_SITE)
    yield
    layout_check.reset_layout_checks()


def _batch(tag: str):
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    x = torch.randn(T, H, generator=g).bfloat16()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K)
    masked = torch.rand(T, K, generator=g) < 0.25
    masked[-2:] = True
    return x, w.masked_fill(masked, 0.0), ids.masked_fill(masked, -1)


def _same(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _dispatch(fmt, amax=None):
    cfg = {"format": fmt, **({"constant_amax": amax} if amax is not None else {})}
    return {"quant_cfg": [{"quantizer_name": "*dispatch_quantizer", "cfg": cfg}]}


def _experts(mma_type: str, cls=_main_common.DeepGemmMegaMoEExperts):
    return cls(E, K, H, INTER, T, mma_type=mma_type)


# -- the common experts ------------------------------------------------------------------------


def test_the_common_site_is_recognised_and_its_plain_copy_proven():
    assert vllm_sites.recognise(_main_common.DeepGemmMegaMoEExperts, COMMON_SITE) is None
    assert vllm_sites.prove_plain_copy(
        _main_common.DeepGemmMegaMoEExperts, COMMON_SITE.plain_copy, COMMON_SITE.stage_fns
    ) is None


@pytest.mark.parametrize("mma_type", ["fp8xfp4", "bf16xbf16"], ids=["staging-global", "plain-copy"])
def test_dispatch_quantizes_exactly_the_staged_tokens(mma_type):
    """Both branches: the quantized forward equals the unquantized forward on
    fake_quant(x) bit for bit, and the caller's x is untouched. Break: drop the plain
    copy's forward_dispatch (below: the bf16 branch then fails closed)."""
    experts = _experts(mma_type)
    x, w, ids = _batch(f"dispatch-{mma_type}")
    amax = float(x.float().abs().max())
    xq = formats.fake_quant(x, "fp8", torch.tensor(amax))
    y_on_xq = experts(xq, w, ids, activation_clamp=10.0)
    x_before = x.clone()
    moewire.quantize(experts, _dispatch("fp8", amax))
    y = experts(x, w, ids, activation_clamp=10.0)
    assert _same(y, y_on_xq)
    assert torch.equal(x, x_before) and not torch.equal(xq, x)


def test_plain_copy_calibration_sees_only_routed_tokens():
    """Calibrating, the dispatch amax is max|x| over tokens with a valid slot, collected at
    the kernel call once the ids are staged (the last two tokens are padding here)."""
    experts = _experts("bf16xbf16")
    x, w, ids = _batch("calib-plain")
    x[-1] = 1000.0  # a padding token: must stay out of the amax
    moewire.quantize(experts, {"quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "fp8"}}]})
    with api.calibrating(experts):
        experts(x, w, ids, activation_clamp=10.0)
    valid = (ids >= 0).any(dim=1)
    assert float(experts.dispatch_quantizer.static_amax) == float(x[valid].float().abs().max())


@pytest.mark.parametrize(
    ("cls", "site", "match"),
    [
        (_main_common.DeepGemmMegaMoEExperts,
         dataclasses.replace(COMMON_SITE, plain_copy=None),
         "finished without reaching moewire's staging hook"),
        (_main_common.ResidualExperts, COMMON_SITE,
         r"uses hidden_states in `y \+ hidden_states`"),
        (_main_common.TwiceStagedExperts, COMMON_SITE, "would be quantized twice"),
    ],
    ids=["no-plain-copy-entry", "tokens-feed-the-output", "copied-then-staged"],
)
def test_a_plain_copy_dispatch_is_never_silently_skipped(cls, site, match):
    _register(cls, site)
    experts = _experts("bf16xbf16", cls)
    moewire.quantize(experts, _dispatch("fp8", 4.0))
    with pytest.raises(RuntimeError, match=match):
        experts(*_batch("skip"), activation_clamp=10.0)


_PROOFS = {
    "rebinds": ("def forward(self, hidden_states):\n    hidden_states = hidden_states * 2\n"
                "    b.x[:1].copy_(hidden_states)\n", "rebinds hidden_states"),
    "other-call": ("def forward(self, hidden_states):\n    b.x[:1].copy_(hidden_states)\n"
                   "    return f(hidden_states)\n", r"uses hidden_states in `f\(hidden_states\)`"),
    "no-copy": ("def forward(self, hidden_states):\n    return hidden_states.shape\n",
                "never copies hidden_states"),
    "other-view": ("def forward(self, hidden_states):\n    b.y[:1].copy_(hidden_states)\n",
                   r"uses hidden_states in `b.y\[:1\].copy_"),
    "no-param": ("def forward(self, x):\n    b.x[:1].copy_(x)\n", "has no parameter"),
}


def _experts_with_forward(case: str, source: str, tmp_path, monkeypatch) -> type:
    """A class ``Experts`` whose ``forward`` is ``source``, in a module of its own (the proof
    reads the forward's source)."""
    path = tmp_path / f"proof_{case.replace('-', '_')}.py"
    body = "".join(f"    {line}\n" for line in source.splitlines())
    path.write_text(f"class Experts:\n{body}")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(path.stem)
    monkeypatch.delitem(sys.modules, path.stem)
    return module.Experts


@pytest.mark.parametrize("case", sorted(_PROOFS), ids=sorted(_PROOFS))
def test_prove_plain_copy_refuses(case, tmp_path, monkeypatch):
    source, match = _PROOFS[case]
    experts = _experts_with_forward(case, source, tmp_path, monkeypatch)
    why = vllm_sites.prove_plain_copy(experts, vllm_sites.PlainCopy("mma_type", "bf16"))
    assert why is not None and __import__("re").search(match, why), why


_COPY = "def forward(self, hidden_states, w):\n    b.x[:1].copy_(hidden_states)\n"
#: case -> the staging call after the plain copy, and the refusal (None: proven).
_STAGED = {
    "first": ("prepare_megamoe_inputs(hidden_states, w)", None),
    "second": ("prepare_megamoe_inputs(w, hidden_states)",
               r"uses hidden_states in `prepare_megamoe_inputs\(w, hidden_states\)` \(line 3\)"),
    "third": ("prepare_megamoe_inputs(w, w, hidden_states, w)",
              r"uses hidden_states in `prepare_megamoe_inputs\(w, w, hidden_states, w\)`"),
    "keyword": ("prepare_megamoe_inputs(w, x=hidden_states)",
                r"uses hidden_states in `x=hidden_states`"),
}


@pytest.mark.parametrize("case", list(_STAGED), ids=list(_STAGED))
def test_the_tokens_may_feed_a_staging_function_only_as_its_first_argument(
        case, tmp_path, monkeypatch):
    """The staging hook quantizes a staging function's first argument: the tokens passed
    there are the other branch's staged tokens; passed in any other position they feed an
    argument no hook quantizes, and the proof fails, naming the call."""
    call, refused = _STAGED[case]
    experts = _experts_with_forward(f"staged-{case}", f"{_COPY}    {call}\n", tmp_path,
                                    monkeypatch)
    why = vllm_sites.prove_plain_copy(experts, vllm_sites.PlainCopy("mma_type", "bf16"),
                                      (vllm_sites.STAGE_FN,))
    if refused is None:
        assert why is None, why
    else:
        assert why is not None and __import__("re").search(refused, why), why


# -- refusals ----------------------------------------------------------------------------------


class _FlashInferExperts(nn.Module):
    """A stand-in of the FlashInfer experts' shape (stages through the megakernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("anchor", torch.zeros(()))

    def forward(self, hidden_states, topk_weights, topk_ids):
        return hidden_states.clone()


def test_flashinfer_megakernel_experts_are_refused_with_the_switch_named():
    site = next(s for s in vllm_sites.SITES if s.cls_name == "DeepseekV4MegaMoEExpertsFI")
    assert site.refusal == vllm_sites.FLASHINFER_REFUSAL
    register_experts_class(_FlashInferExperts, vllm_sites.site_adapter(
        site, _FlashInferExperts, forward_module=COMMON, stage_globals=(),
        flavour=lambda m: "vllm-0.33", ep_group=lambda m: None, runtime=lambda: "a stand-in"))
    experts = _FlashInferExperts()
    moewire.quantize(experts, _dispatch("fp8", 4.0))
    with pytest.raises(RuntimeError, match="--moe-backend deep_gemm_mega_moe") as err:
        experts(*_batch("fi"))
    assert "per-(token, slot) combine rows" in str(err.value)


def test_a_flashinfer_site_without_a_refusal_is_an_error():
    with pytest.raises(ValueError, match="give its refusal"):
        vllm_sites.ExpertsSite("m", "C", stage_fn=None,
                               kernel_access=vllm_sites.FLASHINFER_ACCESS)


# -- DeepGEMM 2.8.0 ----------------------------------------------------------------------------


def _namespace(*, with_28: bool) -> types.SimpleNamespace:
    """DeepGEMM's exported Mega-MoE signatures: 2.8.0 (0274ad7) or PR #323's SM90 port."""

    def get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk,
                                     hidden, intermediate_hidden, num_shared_experts=0,
                                     use_fp8_dispatch=None, mma_type="fp8xfp4",
                                     activation="swiglu"): ...

    def get_symm_buffer_for_sm90_mega_moe(group, num_experts, num_max_tokens_per_rank,
                                          num_topk, hidden, intermediate_hidden,
                                          use_fp8_dispatch=True, activation="swiglu"): ...

    def fp4_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, shared_l1_weights=None,
                         shared_l2_weights=None, x_bf16=None, l1_alphas=None, l2_alphas=None,
                         a2_scales=None, routed_scaling_factor=1.0): ...

    def kernel(y, l1_weights, l2_weights, sym_buffer): ...

    names = dict(get_symm_buffer_for_sm90_mega_moe=get_symm_buffer_for_sm90_mega_moe,
                 fp8_mega_moe=kernel, fp8_fp4_mega_moe=kernel)
    if with_28:
        names.update(get_symm_buffer_for_mega_moe=get_symm_buffer_for_mega_moe,
                     transform_weights_for_mega_moe_sm90=kernel, bf16_mega_moe=kernel,
                     fp4_fp4_mega_moe=fp4_fp4_mega_moe)
    return types.SimpleNamespace(**names)


@pytest.mark.parametrize(("with_28", "name"), [(True, "deepgemm-2.8"), (False, "deepgemm-sm90")],
                         ids=["2.8.0", "pr-323"])
def test_deepgemm_28_is_told_from_pr_323_by_structure(with_28, name, monkeypatch):
    monkeypatch.delenv(flavours.ENV_FLAVOUR, raising=False)
    assert flavours.detect(_namespace(with_28=with_28)).name == name


def test_deepgemm_28_layouts_and_its_nvfp4_kernel_supported():
    """fp4_fp4_mega_moe is modelled on DeepGEMM 2.8.0 and refused on vLLM 0.33/0.34's build
    alone: the refusal is the build's, not the name's. Break: put it back into deepgemm-2.8's
    refused."""
    build = flavours.get("deepgemm-2.8")
    assert build.layout("fp8_mega_moe") == flavours.get("deepgemm-sm90").layout("fp8_mega_moe")
    assert build.layout("fp8_fp4_mega_moe").shared_position == "first"
    assert build.layout("fp4_fp4_mega_moe") == KernelLayout(
        "after_l2_scales", "last", routed_scale="routed_scaling_factor")
    assert "fp4_fp4_mega_moe" not in build.refused
    assert "post_expert_norm_gamma" in flavours.get("vllm-0.33").refused["fp4_fp4_mega_moe"]
    assert "fp4_fp4_mega_moe" in flavours.kernel_functions()


# -- DeepSeek V3.2 / GLM-5.2: NVFP4 x NVFP4 ------------------------------------------------------

V32 = "vllm.models.deepseek_v32.nvidia.mega_moe.DeepseekV32MegaMoEExperts"


def _never_runs(*args, **kwargs):
    raise AssertionError("moewire must refuse fp4_fp4_mega_moe before it runs")


def _v32(flavour=None):
    """vLLM main's V3.2 experts (the contract stand-in) on the deepgemm-2.8 stand-in,
    registered through its site entry; ``flavour`` overrides the detected build."""
    cls = _main_common.DeepseekV32MegaMoEExperts
    site = _site(V32, module=COMMON)
    assert vllm_sites.recognise(cls, site) is None
    register_experts_class(cls, vllm_sites.site_adapter(
        site, cls, forward_module=COMMON, stage_globals=site.stage_fns,
        flavour=(lambda m: flavours.detect(_main_common.deep_gemm).name) if flavour is None
        else (lambda m: flavour),
        ep_group=lambda m: None, runtime=lambda: "a vLLM main stand-in"))
    return cls(E, K, H, INTER, T)


@pytest.fixture()
def fp4_build():
    with deep_gemm.use_flavour("deepgemm-2.8"):
        yield


def _combine(fmt, amax=None):
    cfg = {"format": fmt, **({"constant_amax": amax} if amax is not None else {})}
    return {"quant_cfg": [{"quantizer_name": "*combine_quantizer", "cfg": cfg}]}


def _oracle_resum(rows, ids, fmt, amax):
    """The routed rows fake-quantized (the format's torch reference), summed in ascending
    slot order in FP32 from +0.0 over the valid slots, one BF16 rounding."""
    k = ids.shape[1]
    q = formats.get(fmt).reference(rows[:k, : ids.shape[0]], torch.tensor(amax))
    acc = torch.zeros(q.shape[1:], dtype=torch.float32)
    for s in range(k):
        acc = torch.where((ids[:, s] >= 0).unsqueeze(1), acc + q[s].float(), acc)
    return acc.bfloat16()


def test_v32_nvfp4_x_nvfp4_combine_is_quantized(fp4_build):
    """V3.2's experts on DeepGEMM 2.8.0's kernel: the BF16 combine reproduces the kernel bit
    for bit (the layout check passes), and an FP8 combine equals the oracle's re-sum of the
    kernel's own rows. Break: the layout's base rule (below) or its routed_scale."""
    experts = _v32()
    x, w, ids = _batch("v32-combine")
    y_plain = experts(x, w, ids)
    rows = experts.get_symm_buffer().combine_rows().clone()
    moewire.quantize(experts, _combine("bf16"))
    assert _same(experts(x, w, ids), y_plain)
    assert layout_check.layout_checked(experts.get_symm_buffer())
    moewire.unquantize(experts)
    amax = float(rows[:K, :T][(ids >= 0).T].float().abs().max())
    moewire.quantize(experts, _combine("fp8", amax))
    y = experts(x, w, ids)
    assert _same(y, _oracle_resum(rows, ids, "fp8", amax)) and not _same(y, y_plain)


def test_v32_dispatch_quantizes_the_staged_tokens_only(fp4_build):
    """The dispatch quantizer acts before vLLM main's prepare_megamoe_nvfp4_inputs: the
    quantized forward equals the unquantized one on fake_quant(x), the caller's x kept."""
    experts = _v32()
    x, w, ids = _batch("v32-dispatch")
    amax = float(x.float().abs().max())
    y_on_xq = experts(formats.fake_quant(x, "fp8", torch.tensor(amax)), w, ids)
    before = x.clone()
    moewire.quantize(experts, _dispatch("fp8", amax))
    assert _same(experts(x, w, ids), y_on_xq) and torch.equal(x, before)


def test_v32_calibration_leaves_padding_out(fp4_build):
    """Calibrating under vLLM's forward context: padding tokens (is_padding, ids staged -1
    by the staging) stay out of both amaxes, whatever their values."""
    experts = _v32()
    x, w, ids = _batch("v32-calib")
    pad = torch.zeros(T, dtype=torch.bool)
    pad[-3:] = True
    x[-3:] = 1000.0
    moewire.quantize(experts, {"quant_cfg": [
        {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "fp8"}},
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "fp8"}}]})
    with forward_context(is_padding=pad), api.calibrating(experts):
        experts(x, w, ids)
    staged = experts.get_symm_buffer().topk_idx[:T]
    routed = (staged >= 0).any(dim=1)
    assert not routed[-3:].any()
    assert float(experts.dispatch_quantizer.static_amax) == float(x[routed].float().abs().max())
    rows = experts.get_symm_buffer().combine_rows()[:K, :T][(staged >= 0).T]
    assert float(experts.combine_quantizer.static_amax) == float(rows.float().abs().max())


def test_v32_unquantize_restores_the_layer(fp4_build):
    experts = _v32()
    x, w, ids = _batch("v32-undo")
    y_plain = experts(x, w, ids)
    moewire.quantize(experts, _combine("fp8", 1.0))
    assert not _same(experts(x, w, ids), y_plain)
    moewire.unquantize(experts)
    assert type(experts) is _main_common.DeepseekV32MegaMoEExperts
    assert _same(experts(x, w, ids), y_plain)


@pytest.mark.parametrize("which", ["dispatch", "combine"])
def test_vllm_034s_nvfp4_x_nvfp4_kernel_is_refused_on_its_build(which, monkeypatch):
    """The kernel of the same name in vLLM 0.33/0.34's DeepGEMM normalises its rows at
    combine time: refused with that build's reason, before it runs, with either quantizer
    enabled. Break: drop fp4_fp4_mega_moe from vllm-0.33's refused."""
    with deep_gemm.use_flavour("deepgemm-2.8"):
        experts = _v32(flavour="vllm-0.33")
    monkeypatch.setattr(deep_gemm, "fp4_fp4_mega_moe", _never_runs)
    moewire.quantize(experts, _dispatch("fp8", 4.0) if which == "dispatch" else _combine("bf16"))
    with pytest.raises(RuntimeError, match="calls fp4_fp4_mega_moe.*post_expert_norm_gamma"):
        experts(*_batch("v32-refused"))


def test_v32_wrong_base_rule_is_refused_by_the_layout_check(fp4_build, monkeypatch):
    """A build entry that reads the rows one token row early fails the first batch's layout
    check (never a wrong number); the region is the buffer's last, so the tail rule and
    the after-L2-scales rule agree on this buffer."""
    experts = _v32()
    buf = experts.get_symm_buffer()
    layout = flavours.get("deepgemm-2.8").layout("fp4_fp4_mega_moe")
    nbytes = buf.num_slots * buf.num_max_tokens_per_rank * H * 2
    assert BASE_RULES["last_region"](buf, nbytes, "t") == layout.combine_base(buf, nbytes, "t")
    monkeypatch.setitem(BASE_RULES, "test-one-row-early",
                        lambda b, n, w: BASE_RULES["after_l2_scales"](b, n, w) - 2 * H)
    wrong = flavours.Flavour("test-early", {"fp4_fp4_mega_moe": dataclasses.replace(
        layout, base_rule="test-one-row-early")})
    monkeypatch.setitem(flavours._REGISTRY, wrong.name, wrong)
    experts = _v32(flavour=wrong.name)
    moewire.quantize(experts, _combine("bf16"))
    with pytest.raises(RuntimeError, match="layout check failed"):
        experts(*_batch("v32-wrong"))


def test_deepgemm_28_guess_is_proven_by_the_layout_check(monkeypatch):
    """DeepGEMM 2.8.0's SM100 combine is a guess (vLLM 0.33's 2.8.1: after the L2 scales,
    fused shared row first): the first batch's layout check proves it bit for bit on a
    stand-in of that layout. (A shared row at the other end is refused by the same check on
    rows whose order survives BF16: tests/megamoe/test_megamoe_layout_ulp.py.)"""
    from moewire.reference import MegaMoEExperts

    monkeypatch.setenv(flavours.ENV_FLAVOUR, "deepgemm-2.8")
    experts = MegaMoEExperts(E, K, H, INTER, T, num_fused_shared_experts=1, device="cpu")
    x, w, ids = _batch("guess")
    y_plain = experts(x, w, ids)
    moewire.quantize(experts, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "bf16"}}]})
    assert _same(experts(x, w, ids), y_plain)
    assert slots_proven(experts.symm_buffer)
    assert experts._moewire_adapter.flavour(experts) == "deepgemm-2.8"


def test_a_model_holding_flashinfer_experts_is_refused_before_conversion():
    from moewire.integrations.vllm.quantize import _refuse_sites

    site = next(s for s in vllm_sites.SITES if s.cls_name == "DeepseekV4MegaMoEExpertsFI")
    model = nn.ModuleDict({"experts": _FlashInferExperts()})
    with pytest.raises(RuntimeError, match="experts is a vllm.models.deepseek_v4.nvidia.fi_moe"):
        _refuse_sites(model, [(_FlashInferExperts, site)])
    _refuse_sites(model, [(_FlashInferExperts, COMMON_SITE)])


# -- vLLM main's ModelOpt NVFP4 quant method on fp4_fp4_mega_moe ----------------------------

MODELOPT_SITE = _site("vllm.model_executor.layers.quantization.modelopt.ModelOptNvFp4MegaMoE",
                      module=_main_modelopt.__name__,
                      holder_class=f"{_main_modelopt.__name__}:MoELayer")


def _modelopt_layer(shared: bool):
    cls = _main_modelopt.ModelOptNvFp4MegaMoE
    assert vllm_sites.recognise(cls, MODELOPT_SITE) is None
    register_experts_class(_main_modelopt.MoELayer, vllm_sites.site_adapter(
        MODELOPT_SITE, cls, forward_module=_main_modelopt.__name__,
        stage_globals=MODELOPT_SITE.stage_fns,
        flavour=lambda m: flavours.detect(_main_modelopt.deep_gemm).name,
        ep_group=lambda m: None, runtime=lambda: "a vLLM main stand-in"))
    return _main_modelopt.MoELayer(E, K, H, INTER, T, shared=shared)


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "fused-shared-rsf"])
def test_modelopt_nvfp4_mega_moe_combine_is_quantized(shared, fp4_build):
    """The quant method held by the MoE layer: the layer is converted, its combine re-summed
    in the kernel's order (with a fused BF16 shared expert, the routed sum rounded and scaled
    by routed_scaling_factor before the shared row: a BF16 combine reproduces y bit for
    bit). Break: drop the site's fused_shared_attr (the shared row is then not read)."""
    layer = _modelopt_layer(shared)
    x, w, ids = _batch(f"modelopt-{shared}")
    y_plain = layer(x, w, ids)
    moewire.quantize(layer, _combine("bf16"))
    assert _same(layer(x, w, ids), y_plain)
    assert layer._moewire_adapter.fused_shared(layer) is shared
    assert layout_check.layout_checked(layer.quant_method._symm_buffer)
    moewire.quantize(layer, _combine("fp8", 4.0))
    assert not _same(layer(x, w, ids), y_plain)


def test_modelopt_dispatch_quantizes_the_staged_tokens(fp4_build):
    layer = _modelopt_layer(False)
    x, w, ids = _batch("modelopt-dispatch")
    amax = float(x.float().abs().max())
    y_on_xq = layer(formats.fake_quant(x, "fp8", torch.tensor(amax)), w, ids)
    moewire.quantize(layer, _dispatch("fp8", amax))
    assert _same(layer(x, w, ids), y_on_xq)


def test_modelopt_dispatch_with_a_fused_shared_expert_quantizes_the_routed_tokens_only(
        fp4_build):
    """A fused shared expert with the dispatch quantizer on: the kernel runs once on the
    original tokens with no routed slot (its shared row) and once on the quantized ones, so
    the output is the kernel's on q(x) staged with the shared expert on x (``x_bf16``), bit
    for bit; not the kernel's with the shared expert on q(x) too."""
    layer = _modelopt_layer(True)
    x, w, ids = _batch("modelopt-shared-dispatch")
    amax = float(x.float().abs().max())
    xq = formats.fake_quant(x, "fp8", torch.tensor(amax))
    routed_only = layer.quant_method.apply(layer, xq, w, ids, None, x)
    all_quantized = layer.quant_method.apply(layer, xq, w, ids, None, xq)
    assert not _same(routed_only, all_quantized)
    moewire.quantize(layer, _dispatch("fp8", amax))
    assert _same(layer(x, w, ids), routed_only)


def test_two_holder_sites_share_the_layer_class():
    """vLLM main's MoE layer holds gpt-oss's modular experts or ModelOpt's NVFP4 quant method:
    both adapters stay registered on the one class, each taking its own instances."""
    class Layer(nn.Module):
        def __init__(self, held):
            super().__init__()
            self.quant_method = held

    class A: ...

    class B: ...

    def adapter(name, kind):
        return registry.ExpertsAdapter(
            name=name, forward_module=COMMON, stage_fn=(), stage_hidden_arg=0,
            kernel_ns="deep_gemm", get_symm_buffer=lambda m: None, flavour=lambda m: "x",
            fused_shared=lambda m: False, ep_group=lambda m: None,
            applies=lambda m: isinstance(m.quant_method, kind))

    register_experts_class(Layer, adapter("a", A))
    register_experts_class(Layer, adapter("b", B))
    assert registry.adapter_for(Layer(A())).name == "a"
    assert registry.adapter_for(Layer(B())).name == "b"
    assert registry.adapter_for(Layer(object())) is None
