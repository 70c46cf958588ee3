"""vLLM main's third wave on CPU, against stand-ins written to each contract.

No vLLM needed (these run in ``make test``). Stand-in modules play both the experts' module
and the bridge, registered through moewire's own site entries
(``moewire.integrations.vllm.sites.SITES``, module name replaced), on the stand-in kernel:

- Kimi-K3's latent Mega-MoE as vLLM main's ``vllm/models/kimi_k3/nvidia/model.py`` (ed51064)
  writes it (``_main_kimi``): the experts call ``deep_gemm.fp8_fp4_mega_moe`` themselves with
  SiTU spelled ``activation_beta``/``activation_linear_beta``, on the build that spelling
  belongs to (``deepgemm-vllm-situ``); quantized, calibrated and undone at latent width;
- DeepSeek-V4's fused shared expert on by default (``_main_backend`` with a fused shared
  expert) on vllm-project/DeepGEMM's dev head (``deepgemm-vllm-dev``, 63aa62a), and the
  serial fallback of ``VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION=1``, with a dispatch
  quantizer;
- the refusals: FlashInfer's Kimi-K3 experts, AMD's aiter Mega-MoE (one class has the
  NVIDIA class's name), told apart by their modules.
"""

from __future__ import annotations

import dataclasses
import sys
import zlib

import _main_backend
import _main_kimi
import pytest
import torch

import moewire
from layout_proof import slots_proven
from moewire import formats
from moewire.integrations.vllm import sites as vllm_sites
from moewire.megamoe import flavours, layout_check, registry
from moewire.megamoe.registry import adapter_for, register_experts_class
from moewire.reference import deep_gemm, forward_context

# Kimi-K3 at a small scale: model hidden 1024, latent 512 (Kimi-K3: 7168 and 3584).
HIDDEN, LATENT, E, K, INTER, T = 1024, 512, 8, 3, 512, 24
KIMI = _main_kimi.__name__


def _kimi_site(**changes) -> vllm_sites.ExpertsSite:
    site = next(s for s in vllm_sites.SITES
                if s.cls_name == "KimiK3MegaMoEExperts" and "fp8_fp4_mega_moe(" in s.calls)
    return dataclasses.replace(site, **changes)


def _register(cls, site, module) -> None:
    register_experts_class(cls, vllm_sites.site_adapter(
        site, cls, forward_module=module.__name__, stage_globals=site.stage_fns,
        flavour=lambda m: flavours.detect(module.deep_gemm).name,
        ep_group=lambda m: None, runtime=lambda: "a vLLM main stand-in"))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(registry, "_ADAPTERS", dict(registry._ADAPTERS))
    monkeypatch.setenv(deep_gemm.ENV_FLAVOUR, "deepgemm-vllm-situ")
    monkeypatch.delenv(flavours.ENV_FLAVOUR, raising=False)
    monkeypatch.setattr(_main_kimi.KimiK3MegaMoEExperts, "_kimi_symm_buffer_cache", {})
    monkeypatch.setattr(_main_kimi.KimiK3MegaMoEExperts, "_synchronized_ep_groups", set())
    monkeypatch.setattr(_main_kimi, "BARRIERS", [])
    layout_check.reset_layout_checks()
    _register(_main_kimi.KimiK3MegaMoEExperts, _kimi_site(module=KIMI), _main_kimi)
    yield
    layout_check.reset_layout_checks()


def _tokens(tag: str, t: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    return (torch.randn(t, HIDDEN, generator=g) * 2).bfloat16()


def _block(seed: int = 0) -> _main_kimi.KimiMoE:
    return _main_kimi.KimiMoE(HIDDEN, LATENT, E, K, INTER, T, seed=seed)


def _same(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _resum(rows: torch.Tensor, ids: torch.Tensor, fmt: str | None = None) -> torch.Tensor:
    """The kernel's combine, independently: FP32 from +0.0 over the valid slots in ascending
    order (each row through ``fmt``), one BF16 rounding."""
    routed = rows[:K, :T] if fmt is None else formats.fake_quant(rows[:K, :T], fmt)
    acc = torch.zeros(T, LATENT)
    for s in range(K):
        acc = torch.where((ids[:, s] >= 0)[:, None], acc + routed[s].float(), acc)
    return acc.bfloat16()


def _rows(experts) -> torch.Tensor:
    buf = experts.get_symm_buffer()
    nbytes = K * buf.num_max_tokens_per_rank * LATENT * 2
    flat = buf.buffer
    return flat[flat.numel() - nbytes:].view(torch.bfloat16).view(K, -1, LATENT).clone()


def _recipe(dispatch: dict | None, combine: dict | None) -> dict:
    entries = []
    if dispatch is not None:
        entries.append({"quantizer_name": "*dispatch_quantizer", "cfg": dispatch})
    if combine is not None:
        entries.append({"quantizer_name": "*combine_quantizer", "cfg": combine})
    return {"quant_cfg": entries}


# -- Kimi-K3 on DeepGEMM -----------------------------------------------------------------------


def test_kimi_k3_main_is_recognised_by_its_own_entry_only():
    """main's experts call the kernel themselves: the 0.32 entry (through a backend) does
    not take them, the main entry does."""
    cls = _main_kimi.KimiK3MegaMoEExperts
    assert vllm_sites.recognise(cls, _kimi_site(module=KIMI)) is None
    old = next(s for s in vllm_sites.SITES
               if s.cls_name == "KimiK3MegaMoEExperts" and "run_mega_moe(" in s.calls)
    why = vllm_sites.recognise(cls, dataclasses.replace(old, module=KIMI, access_modules=()))
    assert why == f"{KIMI} never calls run_mega_moe(...)"
    assert adapter_for(_block().experts).name == "vllm-KimiK3MegaMoEExperts"


def test_kimi_k3_quantized_end_to_end_at_latent_width():
    """Dispatch (FP8 on the latent tokens the kernel stages) and combine (MXFP8 on the
    latent rows, re-summed in the build's order before the transform): the block's output
    equals, bit for bit, the transform of the re-sum of quantized rows from the experts run
    on q(latent), plus the shared experts on the original hidden states; the router, the
    down-projection and the shared path keep what they read. Break: the staging hook
    quantizing the forward's hidden states of another width (the model's)."""
    block, twin = _block(), _block()
    x = _tokens("kimi-e2e")
    latent = block.down_project(x)
    amax = float(latent.float().abs().max())
    w, ids = block.route(x)
    latent_q = formats.fake_quant(latent, "fp8", torch.tensor(amax))
    twin.experts(latent_q, w, ids, activation_clamp=None)
    routed = _resum(_rows(twin.experts), ids, "mxfp8")
    want = twin.routed_output_transform(routed, residual=twin.shared_experts(x))
    moewire.quantize(block, _recipe({"format": "fp8", "constant_amax": amax},
                                    {"format": "mxfp8"}))
    y = block(x)
    assert _same(y, want)
    buf = block.experts.get_symm_buffer()
    assert buf.x.shape[1] == LATENT and buf.activation == "situ"
    assert layout_check.layout_checked(buf)
    assert not _same(y, _block()(x))


def test_kimi_k3_calibrated_and_undone():
    """Calibration sees the latent tokens with a routed slot (padding tokens carry 1000x
    values) and the valid latent rows; after ``moewire.unquantize`` the block is its plain
    self, bit for bit."""
    block = _block()
    batches = [_tokens(f"kimi-calib-{i}") for i in range(2)]
    pad = torch.zeros(T, dtype=torch.bool)
    pad[-2:] = True
    for x in batches:
        x[-2:] = 1000.0

    def loop(model):
        with forward_context(pad):
            for x in batches:
                model(x)

    moewire.quantize(block, "moe_fp8_dispatch_nvfp4_combine", forward_loop=loop)
    want_dispatch = max(float(block.down_project(x)[:-2].float().abs().max()) for x in batches)
    assert float(block.experts.dispatch_quantizer.static_amax) == want_dispatch
    assert float(block.experts.combine_quantizer.static_amax) > 0
    x = _tokens("kimi-undo")
    y_plain = _block()(x)
    assert not _same(block(x), y_plain)
    moewire.unquantize(block)
    assert type(block.experts) is _main_kimi.KimiK3MegaMoEExperts
    assert _same(block(x), y_plain)


def test_kimi_k3_buffer_cache_and_first_launch_barrier_are_kept():
    """Two layers of one shape share the class's buffer cache: moewire reads that one buffer
    (checked once for both) and the EP barrier runs once, before the first launch."""
    blocks = torch.nn.ModuleList([_block(0), _block(1)])
    moewire.quantize(blocks, _recipe(None, {"format": "mxfp8"}))
    x = _tokens("kimi-cache")
    for block in blocks:
        block(x)
    first, second = (b.experts for b in blocks)
    assert first.get_symm_buffer() is second.get_symm_buffer()
    assert first._moewire_adapter.get_symm_buffer(second) is first.get_symm_buffer()
    assert len(first._kimi_symm_buffer_cache) == 1
    assert layout_check.layout_checked(first.get_symm_buffer())
    assert _main_kimi.BARRIERS == [_main_kimi.EP_GROUP.cpu_group]


def test_kimi_k3_mains_spelling_is_refused_by_a_deepgemm_28_build(monkeypatch):
    """main's call spells SiTU as vllm-project/DeepGEMM's 2.6.1 line does; on a 2.8 build
    (vLLM 0.32's, where activation_beta is the up scale) it is refused, never misread."""
    monkeypatch.setenv(deep_gemm.ENV_FLAVOUR, "vllm-0.32")
    with pytest.raises(TypeError, match="it takes no activation_linear_beta"):
        _block()(_tokens("kimi-spelling"))


# -- DeepSeek-V4: the fused shared expert, on by default ----------------------------------------


def _backend_site():
    site = next(s for s in vllm_sites.SITES if s.cls_name == "DeepseekV4MegaMoEExperts"
                and s.module.endswith("nvidia.model"))
    return dataclasses.replace(site, module=_main_backend.__name__, cls_name="BackendExperts",
                               access_modules=())


@pytest.mark.parametrize("fused", [True, False],
                         ids=["fused-default", "VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION"])
def test_dsv4_dispatch_with_and_without_the_fused_shared_expert(fused, monkeypatch):
    """On vllm-project/DeepGEMM's dev head (``deepgemm-vllm-dev``: shared row added first):
    with the fusion on (the default), the dispatch quantizer changes only the routed experts'
    tokens: the output is the routed rows of a run on q(x) and the shared row of a run on x,
    summed shared-first; with it off (the env var: the serial shared MLP after the kernel),
    the kernel's output is that of a run on q(x). Both pass the layout check."""
    monkeypatch.setenv(deep_gemm.ENV_FLAVOUR, "deepgemm-vllm-dev")
    _register(_main_backend.BackendExperts, _backend_site(), _main_backend)
    experts = _main_backend.BackendExperts(E, K, 512, INTER, T, fused_shared=fused)
    g = torch.Generator().manual_seed(zlib.crc32(b"dsv4-shared"))
    x = (torch.randn(T, 512, generator=g) * 3).bfloat16()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K)
    ids[-3:, 1:] = -1
    amax = float(x.float().abs().max())
    xq = formats.fake_quant(x, "fp8", torch.tensor(amax))
    assert flavours.detect(_main_backend.deep_gemm).name == "deepgemm-vllm-dev"
    with forward_context(None):
        experts(x, w, ids, activation_clamp=None)
        buf = experts.get_symm_buffer()
        rows_x = _region(buf, fused).clone()
        y_xq = experts(xq, w, ids, activation_clamp=None)
        rows_xq = _region(buf, fused).clone()
        # A BF16 combine re-sums the rows unchanged: the layout check runs, y stays exact.
        moewire.quantize(experts, _recipe({"format": "fp8", "constant_amax": amax},
                                          {"format": "bf16"}))
        y = experts(x, w, ids, activation_clamp=None)
    if fused:
        acc = rows_x[K, :T].float()
        for s in range(K):
            acc = torch.where((ids[:, s] >= 0)[:, None], acc + rows_xq[s, :T].float(), acc)
        assert _same(y, acc.bfloat16())
        assert not _same(y, y_xq)
    else:
        assert _same(y, y_xq)
    assert slots_proven(buf)


def _region(buf, fused: bool) -> torch.Tensor:
    slots = K + int(fused)
    nbytes = slots * buf.num_max_tokens_per_rank * buf.hidden * 2
    flat = buf.buffer
    return flat[flat.numel() - nbytes:].view(torch.bfloat16).view(slots, -1, buf.hidden)


# -- recognised to be refused: FlashInfer, AMD --------------------------------------------------

_KIMI_FI = '''
from _main_kimi import KimiK3MegaMoEExperts


class KimiK3FlashInferMegaMoEExperts(KimiK3MegaMoEExperts):
    """vllm/models/kimi_k3/nvidia/fi_moe.py (a48554, 4cfcde0): FlashInfer's moe_ep."""

    def forward(self, hidden_states, topk_weights, topk_ids, *, activation_clamp,
                fast_math=True):
        from flashinfer.moe_ep import MoEEpTensors

        self.synchronize_first_launch()
        return self._flashinfer_layer(MoEEpTensors(hidden_states=hidden_states,
                                                   topk_ids=topk_ids,
                                                   topk_weights=topk_weights))
'''

_DSV4_FI = '''
from torch import nn


class DeepseekV4MegaMoEExpertsFI(nn.Module):
    """vllm/models/deepseek_v4/nvidia/fi_moe.py (055e47c): flashinfer imported in the forward."""

    def forward(self, hidden_states, topk_weights, topk_ids, *, activation_clamp,
                fast_math=True):
        from flashinfer.moe_ep import MoEEpTensors

        kernel, workspace, transformed = self._fast_ctx
        kernel.stage_inputs(MoEEpTensors(hidden_states=hidden_states), workspace,
                            quantize_input=True)
        return kernel.compute(workspace, transformed, output=None)
'''

_AMD_EXPERTS = '''
import torch
from torch import nn

from {runtime} import MegaMoERuntime


class DeepseekV4MegaMoEExperts(nn.Module):
    """vllm/models/deepseek_v4/amd/mega_moe_experts.py (ed837da): aiter's MegaMoEV2."""

    def __init__(self):
        super().__init__()
        self.register_buffer("anchor", torch.zeros(()))

    def forward(self, hidden_states, topk_weights, topk_ids):
        runtime = MegaMoERuntime.get(None, 0)
        with runtime.bind_weights(self, w1=None, w1_scale=None, w2=None, w2_scale=None) as moe:
            out = moe.forward(hidden_states, topk_weights, topk_ids)
        return out.clone()
'''

_AMD_RUNTIME = '''
class MegaMoERuntime:
    """vllm/models/deepseek_v4/amd/mega_moe_runtime.py (ed837da)."""

    def build(self, **weights):
        from aiter.ops.flydsl.kernels.mega_moe import MegaMoEV2

        self._moe = MegaMoEV2(**weights)
'''

_AMD_AITER = '''
import torch
from torch import nn


class DeepseekV4AiterMegaMoEExperts(nn.Module):
    """vllm/models/deepseek_v4/amd/mega_moe.py (7a6d2f8): aiter's MegaMoEV2."""

    def __init__(self):
        super().__init__()
        self.register_buffer("anchor", torch.zeros(()))

    def finalize_weights(self):
        from aiter.ops.flydsl.kernels.mega_moe import MegaMoEV2

        self._runtime = MegaMoEV2(rank=0, world_size=1)

    def forward(self, hidden_states, topk_weights, topk_ids):
        return self._runtime.forward(hidden_states.contiguous(), topk_weights, topk_ids)
'''


def _load(tmp_path, monkeypatch, name: str, source: str):
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = __import__(name)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _entry(module: str, cls_name: str) -> vllm_sites.ExpertsSite:
    return next(s for s in vllm_sites.SITES if s.module == module and s.cls_name == cls_name)


@pytest.fixture()
def amd(tmp_path, monkeypatch):
    runtime = _load(tmp_path, monkeypatch, "w3_amd_runtime", _AMD_RUNTIME)
    experts = _load(tmp_path, monkeypatch, "w3_amd_experts",
                    _AMD_EXPERTS.format(runtime=runtime.__name__))
    aiter = _load(tmp_path, monkeypatch, "w3_amd_aiter", _AMD_AITER)
    sites = {
        "experts": dataclasses.replace(
            _entry("vllm.models.deepseek_v4.amd.mega_moe_experts", "DeepseekV4MegaMoEExperts"),
            module=experts.__name__, access_modules=(runtime.__name__,)),
        "aiter": dataclasses.replace(
            _entry("vllm.models.deepseek_v4.amd.mega_moe", "DeepseekV4AiterMegaMoEExperts"),
            module=aiter.__name__),
    }
    return experts, aiter, sites


def test_amd_classes_are_told_from_nvidia_by_their_module(amd):
    """The AMD experts class has the NVIDIA class's name: each site recognises its own
    module's class and rejects the other (the AMD module stages nothing for DeepGEMM; the
    NVIDIA-shaped module imports no aiter). Break: recognise a class by its name."""
    experts, aiter, sites = amd
    nvidia = dataclasses.replace(_backend_site(), cls_name="DeepseekV4MegaMoEExperts")
    assert experts.DeepseekV4MegaMoEExperts.__name__ == nvidia.cls_name
    assert vllm_sites.recognise(experts.DeepseekV4MegaMoEExperts, sites["experts"]) is None
    assert vllm_sites.recognise(aiter.DeepseekV4AiterMegaMoEExperts, sites["aiter"]) is None
    assert vllm_sites.recognise(experts.DeepseekV4MegaMoEExperts, nvidia) == (
        f"{experts.__name__} has no staging function prepare_megamoe_inputs")
    assert vllm_sites.recognise(_main_backend.BackendExperts, dataclasses.replace(
        sites["experts"], module=_main_backend.__name__, cls_name="BackendExperts")) == (
        f"{_main_backend.__name__} never calls bind_weights(...)")
    _register(_main_backend.BackendExperts, _backend_site(), _main_backend)
    register_experts_class(experts.DeepseekV4MegaMoEExperts, vllm_sites.site_adapter(
        sites["experts"], experts.DeepseekV4MegaMoEExperts, forward_module=experts.__name__,
        stage_globals=(), flavour=lambda m: "vllm-0.33", ep_group=lambda m: None,
        runtime=lambda: "a stand-in"))
    nvidia_adapter = adapter_for(_main_backend.BackendExperts(E, K, 512, INTER, T))
    amd_adapter = adapter_for(experts.DeepseekV4MegaMoEExperts())
    assert nvidia_adapter.refusal is None
    assert amd_adapter.refusal == vllm_sites.AITER_REFUSAL


def _quantized_forward_of(layer, site, **call_kwargs):
    """``layer`` registered through ``site`` (the Kimi-K3 stand-in plays the bridge) and
    quantized; its forward on a batch, to run."""
    cls = type(layer)
    register_experts_class(cls, vllm_sites.site_adapter(
        site, cls, forward_module=KIMI, stage_globals=(), flavour=lambda m: "vllm-0.33",
        ep_group=lambda m: None, runtime=lambda: "a vLLM main stand-in"))
    moewire.quantize(layer, _recipe({"format": "fp8", "constant_amax": 4.0}, None))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, LATENT, generator=g).bfloat16()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K)
    return lambda: layer(x, w, ids, **call_kwargs)


@pytest.mark.parametrize("which", ["experts", "aiter"], ids=["flydsl-experts", "aiter-experts"])
def test_amd_mega_moe_is_refused_naming_its_backend_and_the_switch(amd, which):
    experts, aiter, sites = amd
    cls = (experts.DeepseekV4MegaMoEExperts if which == "experts"
           else aiter.DeepseekV4AiterMegaMoEExperts)
    forward = _quantized_forward_of(cls(), sites[which])
    with pytest.raises(RuntimeError, match=r"moewire does not quantize .*aiter's MegaMoEV2 .*"
                       r"--moe-backend flydsl_mega_moe.*Serve with --moe-backend "
                       r"deep_gemm_mega_moe"):
        forward()


def test_kimi_k3_flashinfer_experts_are_recognised_and_refused(tmp_path, monkeypatch):
    """A subclass of the quantizable Kimi-K3 experts whose forward runs FlashInfer's
    megakernel: its own entry recognises it (flashinfer imported inside the forward), the
    Kimi-K3 entry does not (no staging global), and a quantized forward is refused before
    it runs."""
    module = _load(tmp_path, monkeypatch, "w3_kimi_fi", _KIMI_FI)
    cls = module.KimiK3FlashInferMegaMoEExperts
    site = dataclasses.replace(
        _entry("vllm.models.kimi_k3.nvidia.fi_moe", "KimiK3FlashInferMegaMoEExperts"),
        module=module.__name__)
    assert vllm_sites.recognise(cls, site) is None
    assert vllm_sites.recognise(cls, _kimi_site(module=module.__name__)) == (
        f"{module.__name__} has no staging function prepare_megamoe_inputs")
    layer = cls(E, K, LATENT, INTER, T, activation="situ", activation_beta=4.0,
                activation_linear_beta=25.0)
    forward = _quantized_forward_of(layer, site, activation_clamp=None)
    with pytest.raises(RuntimeError, match=r"FlashInfer's moe_ep megakernel \(--moe-backend "
                       r"flashinfer_moe_ep_mega_\*.*KimiK3MegaMoEExperts, which moewire "
                       r"quantizes"):
        forward()


def test_flashinfer_experts_importing_flashinfer_inside_the_forward_are_recognised(
        tmp_path, monkeypatch):
    """vLLM main's DeepseekV4MegaMoEExpertsFI imports ``MoEEpTensors`` from
    ``flashinfer.moe_ep`` inside its forward (``from ... import``): that reaches FlashInfer.
    Break: count ``import flashinfer.moe_ep`` statements only."""
    module = _load(tmp_path, monkeypatch, "w3_dsv4_fi", _DSV4_FI)
    site = dataclasses.replace(
        _entry("vllm.models.deepseek_v4.nvidia.fi_moe", "DeepseekV4MegaMoEExpertsFI"),
        module=module.__name__)
    assert vllm_sites.recognise(module.DeepseekV4MegaMoEExpertsFI, site) is None


def test_a_refused_site_without_a_refusal_is_an_error():
    with pytest.raises(ValueError, match="reaching aiter.ops.flydsl.kernels.mega_moe has no "
                                         "DeepGEMM call to hook; give its refusal"):
        vllm_sites.ExpertsSite("m", "C", stage_fn=None, kernel_access=vllm_sites.AITER_ACCESS)
