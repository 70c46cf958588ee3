"""vLLM main's sites through moewire's real vLLM integration (discovery, bridge, adapter).

The vLLM installed here is 0.32, which has none of main's new modules; the test loads
``tests/real_kernel/sm90_vllm_main.py`` (moewire's module written to vLLM main's
``DeepseekV4MegaMoESM90Experts`` contract, reaching DeepGEMM through vLLM's
``_import_deep_gemm()``) under main's module name, then runs ``experts_sites()`` and
``register_site()`` as the plugin does. The kernel is the stand-in of the fork's names,
``moewire.reference.sm90_fork``, which vLLM's ``_import_deep_gemm()`` returns.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types
import zlib
from pathlib import Path

import pytest
import torch

import moewire
from moewire.integrations.vllm import bridge as _vllm_bridge
from moewire.integrations.vllm import registration
from moewire.integrations.vllm import sites as vllm_sites
from moewire.megamoe import flavours, layout_check
from moewire.reference import sm90_fork

pytestmark = pytest.mark.vllm

vllm_mod = pytest.importorskip("moewire.integrations.vllm")
MAIN_SM90 = "vllm.models.deepseek_v4.nvidia.sm90_mega_moe"
SOURCE = Path(__file__).parents[1] / "real_kernel" / "sm90_vllm_main.py"
E, LOGICAL, H, INTER, K, T = 8, 4, 256, 128, 3, 24


@pytest.fixture()
def main_sm90(monkeypatch):
    """The contract module under vLLM main's name, DeepGEMM = the fork's stand-in."""
    monkeypatch.syspath_prepend(str(SOURCE.parent))
    spec = importlib.util.spec_from_file_location(MAIN_SM90, SOURCE)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, MAIN_SM90, module)
    spec.loader.exec_module(module)
    module.DeepseekV4MegaMoESM90Experts = module.VllmMainSM90Experts
    module.VLLM_ACCESS = True
    _vllm_bridge.set_kernel_override(lambda: sm90_fork)
    layout_check.reset_layout_checks()
    yield module
    _vllm_bridge.set_kernel_override(None)
    layout_check.reset_layout_checks()


def test_main_sm90_site_found_registered_and_quantized(main_sm90):
    """Found by structure at main's path (no staging global: the inline cast), registered
    through the bridge; the combine through vLLM's _import_deep_gemm() is bit-exact with a
    BF16 combine and the reference re-sum with MXFP8. Break: a site whose recognition
    wants a staging global refuses it (below)."""
    found = dict((site.cls_name, cls) for cls, site in vllm_mod.experts_sites())
    cls = found["DeepseekV4MegaMoESM90Experts"]
    assert cls is main_sm90.VllmMainSM90Experts
    site = next(s for s in vllm_sites.SITES if s.cls_name == "DeepseekV4MegaMoESM90Experts")
    vllm_mod.register_site(cls, site)
    experts = cls(group=None, num_experts=E, num_local_experts=E, top_k=K, hidden_size=H,
                  intermediate_size=INTER, max_num_tokens=T, num_logical_experts=LOGICAL)
    g = torch.Generator().manual_seed(zlib.crc32(b"main-sm90-site"))
    experts.load_bf16((torch.randn(E, 2 * INTER, H, generator=g) * H**-0.5).bfloat16(),
                      (torch.randn(E, H, INTER, generator=g) * INTER**-0.5).bfloat16())
    x = torch.randn(T, H, generator=g).bfloat16()
    w, ids = torch.randn(T, LOGICAL, generator=g).softmax(-1).topk(K)
    y_plain = experts(x, w, ids, activation_clamp=10.0)
    assert vllm_mod.kernel_flavour(experts) == "deepgemm-sm90-fork"
    moewire.quantize(experts, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "bf16"}}]})
    assert torch.equal(experts(x, w, ids, activation_clamp=10.0).view(torch.int16),
                       y_plain.view(torch.int16))
    buf = experts.get_symm_buffer()
    assert layout_check.layout_checked(buf)
    moewire.quantize(experts, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}}]})
    y = experts(x, w, ids, activation_clamp=10.0)
    tail = buf.buffer[buf.buffer.numel() - K * buf.num_max_tokens_per_rank * H * 2:]
    rows = moewire.formats.fake_quant(
        tail.view(torch.bfloat16).view(K, -1, H)[:, :T], "mxfp8")
    acc = torch.zeros(T, H)
    for s in range(K):
        acc = torch.where((buf.topk_idx[:T, s] >= 0)[:, None], acc + rows[s].float(), acc)
    assert torch.equal(y.view(torch.int16), acc.bfloat16().view(torch.int16))


def test_main_sm90_site_refuses_a_module_without_the_inline_cast(main_sm90, monkeypatch):
    site = next(s for s in vllm_sites.SITES if s.cls_name == "DeepseekV4MegaMoESM90Experts")
    strict = vllm_sites.ExpertsSite(site.module, site.cls_name, read_from="main")
    why = vllm_sites.recognise(main_sm90.VllmMainSM90Experts, strict)
    assert why == f"{MAIN_SM90} has no staging function prepare_megamoe_inputs"


def test_gptoss_holder_class_is_the_installed_routed_experts():
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    site = next(s for s in vllm_sites.SITES if s.cls_name == "DeepGemmMegaExperts")
    assert vllm_sites.holder_class(site) is RoutedExperts
    assert flavours.get("deepgemm-main").layout("fp8_fp4_mega_moe").base_rule == "last_region"


def test_the_bridge_rebinds_the_moved_deep_gemm_lookup_too(monkeypatch):
    """vLLM main moved _import_deep_gemm to vllm.foundation.utilities.deep_gemm (055e47c):
    the bridge rebinds it in every module of ACCESS_MODULES that imports, and the undo
    ledger puts both back. Break: drop the new path from ACCESS_MODULES."""
    from vllm.utils import deep_gemm as old

    from moewire import patches

    def moved_lookup():
        return None

    moved = types.ModuleType(vllm_sites.ACCESS_MODULES[1])
    moved._import_deep_gemm = moved_lookup
    monkeypatch.setitem(sys.modules, moved.__name__, moved)
    _vllm_bridge.install_access()
    try:
        assert old._import_deep_gemm is _vllm_bridge.import_deep_gemm
        assert moved._import_deep_gemm is _vllm_bridge.import_deep_gemm
    finally:
        patches.undo_all()
    assert moved._import_deep_gemm is moved_lookup


def test_a_site_finds_its_class_at_a_further_path(main_sm90):
    site = next(s for s in vllm_sites.SITES if s.cls_name == "DeepseekV4MegaMoESM90Experts")
    moved = dataclasses.replace(site, module="vllm.no_such_package.sm90", also_at=(MAIN_SM90,))
    found = vllm_mod.experts_sites((moved,))
    assert found == [(main_sm90.VllmMainSM90Experts, moved)]


_BASE_SRC = '''
from torch import nn
from vllm.utils.deep_gemm import _import_deep_gemm


def prepare_megamoe_inputs(hidden_states):
    return hidden_states


class Experts(nn.Module):
    def forward(self, hidden_states):
        _import_deep_gemm()
        return prepare_megamoe_inputs(hidden_states)
'''
_SUB_SRC = '''
from vllm.utils.deep_gemm import _import_deep_gemm
from {base} import Experts


def prepare_megamoe_inputs(hidden_states):
    return hidden_states


class {name}(Experts):
    def _ensure_backend(self):
        return _import_deep_gemm()

    def forward(self, hidden_states):
        self._ensure_backend()
        return prepare_megamoe_inputs(hidden_states)


class Inherits(Experts):
    pass
'''


def test_a_subclass_with_its_own_forward_elsewhere_is_registered(tmp_path, monkeypatch):
    """GLM-5-Next's shape: a subclass of a found class, defined in another module with a
    forward of its own, gets its own adapter and its own module's staging global rebound;
    a subclass that keeps the base's forward keeps the base's adapter. Break: skip
    _register_subclasses in quantize_vllm_model."""
    from moewire import patches
    from moewire.megamoe import registry

    monkeypatch.setattr(registry, "_ADAPTERS", dict(registry._ADAPTERS))
    (tmp_path / "wave2_base.py").write_text(_BASE_SRC)
    (tmp_path / "wave2_sub.py").write_text(_SUB_SRC.format(base="wave2_base", name="Glm5Next"))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("wave2_base", "wave2_sub"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    base = importlib.import_module("wave2_base")
    sub = importlib.import_module("wave2_sub")
    site = vllm_sites.ExpertsSite("wave2_base", "Experts")
    try:
        vllm_mod.register_site(base.Experts, site)
        model = torch.nn.ModuleList([base.Experts(), sub.Glm5Next(), sub.Inherits()])
        registration._register_subclasses(model, [(base.Experts, site)])
        base_adapter = registry.adapter_for(model[0])
        assert registry.adapter_for(model[2]) is base_adapter
        own = registry.adapter_for(model[1])
        assert own is not base_adapter
        assert own.stage_fn == _vllm_bridge.stage_global_name("wave2_sub")
        assert sub.prepare_megamoe_inputs._moewire_trampoline == own.stage_fn
    finally:
        patches.undo_all()
