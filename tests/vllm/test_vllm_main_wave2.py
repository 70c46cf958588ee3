"""vLLM main's second wave on CPU, against stand-ins written to each contract.

No vLLM needed (these run in ``make test``). The stand-in modules play both the experts'
module and the bridge and are registered through moewire's own site entries
(``moewire.integrations.vllm.sites.SITES``, module name replaced), on the stand-in kernel:

- the common ``DeepGemmMegaMoEExperts`` (``vllm/models/common/deep_gemm_mega_moe.py``,
  6dfb263): fp8xfp4 through the staging global, bf16xbf16 by a plain copy whose dispatch
  is the forward's own ``hidden_states`` (``_main_common``);
- the refusals: FlashInfer's megakernel experts, an unproven plain copy, a plain copy
  followed by a staging call, DeepGEMM 2.8.0's ``fp4_fp4_mega_moe``;
- the DeepGEMM 2.8.0 build entry, recognised on a namespace with its exported signatures.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import zlib

import _main_common
import pytest
import torch
from torch import nn

import moewire
from moewire import formats
from moewire.integrations.vllm import sites as vllm_sites
from moewire.megamoe import api, flavours, layout_check, registry
from moewire.megamoe.registry import register_experts_class
from moewire.reference import deep_gemm

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


def test_deepgemm_28_layouts_and_its_nvfp4_kernel_refused():
    build = flavours.get("deepgemm-2.8")
    assert build.layout("fp8_mega_moe") == flavours.get("deepgemm-sm90").layout("fp8_mega_moe")
    assert build.layout("fp8_fp4_mega_moe").shared_position == "first"
    assert "fp4_fp4_mega_moe" in build.refused
    assert "fp4_fp4_mega_moe" in flavours.UNSUPPORTED_KERNELS
    assert "fp8_mega_moe" not in flavours.UNSUPPORTED_KERNELS


# -- DeepSeek V3.2 / GLM-5.2: NVFP4 x NVFP4 ------------------------------------------------------


def _never_runs(*args, **kwargs):
    raise AssertionError("moewire must refuse fp4_fp4_mega_moe before it runs")


@pytest.mark.parametrize(("flavour", "why"),
                         [("deepgemm-2.8", "794783a"), ("vllm-0.33", "post_expert_norm_gamma")],
                         ids=["deepgemm-2.8", "vllm-0.33"])
@pytest.mark.parametrize("which", ["dispatch", "combine"])
def test_the_nvfp4_x_nvfp4_kernel_is_refused_with_its_builds_reason(flavour, why, which,
                                                                     monkeypatch):
    """The V3.2 site is recognised; its kernel is refused with any quantizer enabled (the
    dispatch one too: the combine is unread either way), naming the reason of the build
    the layer runs on. Break: drop fp4_fp4_mega_moe from deepgemm-2.8's refused."""
    cls = _main_common.DeepseekV32MegaMoEExperts
    site = _site("vllm.models.deepseek_v32.nvidia.mega_moe.DeepseekV32MegaMoEExperts",
                 module=COMMON)
    assert vllm_sites.recognise(cls, site) is None
    monkeypatch.setattr(deep_gemm, "fp4_fp4_mega_moe", _never_runs, raising=False)
    register_experts_class(cls, vllm_sites.site_adapter(
        site, cls, forward_module=COMMON, stage_globals=site.stage_fns,
        flavour=lambda m: flavour, ep_group=lambda m: None, runtime=lambda: "a stand-in"))
    experts = cls(E, K, H, INTER, T)
    cfg = _dispatch("fp8", 4.0) if which == "dispatch" else {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "bf16"}}]}
    moewire.quantize(experts, cfg)
    x, w, ids = _batch("v32")
    with pytest.raises(RuntimeError, match=f"calls fp4_fp4_mega_moe.*{why}"):
        experts(x, w, ids)


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
    assert layout_check.layout_checked(experts.symm_buffer)
    assert experts._moewire_adapter.flavour(experts) == "deepgemm-2.8"


def test_a_model_holding_flashinfer_experts_is_refused_before_conversion():
    from moewire.integrations import vllm as vllm_mod

    site = next(s for s in vllm_sites.SITES if s.cls_name == "DeepseekV4MegaMoEExpertsFI")
    model = nn.ModuleDict({"experts": _FlashInferExperts()})
    with pytest.raises(RuntimeError, match="experts is a vllm.models.deepseek_v4.nvidia.fi_moe"):
        vllm_mod._refuse_sites(model, [(_FlashInferExperts, site)])
    vllm_mod._refuse_sites(model, [(_FlashInferExperts, COMMON_SITE)])
