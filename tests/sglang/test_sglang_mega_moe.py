"""SGLang 0.5.23's released Mega-MoE path on a Hopper (``mega_moe.run_mega_routed_experts``
handing over to ``mega_moe_sm90.run_sm90_mega_routed``) quantized through moewire's SGLang
integration, on the CPU stand-in of sgl-deep-gemm (``_sgl_standin``)."""

from __future__ import annotations

import contextlib
import sys
import types
import zlib

import pytest
import torch
from torch import nn

import moewire
from moewire.integrations import sglang as sg
from moewire.integrations.sglang import refusals as sg_refusals
from moewire.integrations.sglang import trampolines as sg_trampolines
from moewire.integrations.sglang.sites import SITES
from moewire.megamoe import layout_check
from moewire.megamoe.flavours import get
from moewire.megamoe.layout import combine_rows

pytestmark = pytest.mark.sglang

T, H, INTER, E, K = 10, 256, 128, 4, 3


class Experts(nn.Module):
    """What SGLang's SM90 path reads of ``moe.experts`` once
    ``build_sm90_mega_moe_experts_weights`` ran (FP8 weights, 128x128 FP32 scales)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(zlib.crc32(b"sglang-sm90-weights"))
        self.num_experts = E
        self._mega_moe_weights_built = True
        self._mega_moe_sm90_fp8_weights = True
        # Set by SGLang's FusedMoE.__init__; mega_moe.py's _mega_moe_mma_type reads them.
        self._mega_moe_nvfp4 = False
        self._mega_moe_w4a4 = False
        w1 = (torch.randn(E, 2 * INTER, H, generator=g) * 8).to(torch.float8_e4m3fn)
        w2 = (torch.randn(E, H, INTER, generator=g) * 8).to(torch.float8_e4m3fn)
        self.mega_l1_weights = (w1, torch.full((E, 2 * INTER // 128, H // 128), 2.0**-6))
        self.mega_l2_weights = (w2, torch.full((E, H // 128, INTER // 128), 2.0**-6))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """SGLang's non-Mega path (batches above the token cap): no Mega-MoE call."""
        return torch.zeros_like(hidden_states)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = Experts()


def batch(tag: str, n: int = T):
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    x = torch.randn(n, H, generator=g).bfloat16()
    w, ids = torch.randn(n, E, generator=g).softmax(-1).topk(K)
    masked = torch.rand(n, K, generator=g) < 0.3
    masked[-2:] = True  # padding tokens: no valid slot
    return x, ids.masked_fill(masked, -1).int(), w.masked_fill(masked, 0.0)


@pytest.fixture(autouse=True)
def _small_cap(monkeypatch):
    """SGLang's token cap per rank (its buffer's capacity), small for the CPU."""
    monkeypatch.setenv("SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK", "16")


def mega_moe():
    return sys.modules["sglang.srt.layers.moe.mega_moe"]


def run_mega(experts, x, ids, w, rsf=1.0, **kwargs):
    """SGLang's ``_run_mega_routed`` call (SM100 and, on Hopper, the SM90 hand-off)."""
    return mega_moe().run_mega_routed_experts(
        experts, x, ids, w, hidden_size=H, intermediate_size=INTER, top_k=K,
        num_tokens=x.shape[0], routed_scaling_factor=rsf, **kwargs)


def mega_buffer():
    """The buffer ``run_mega_routed_experts`` uses (SGLang's ``_MEGA_MOE_SYMM_BUFFER``)."""
    [buf] = mega_moe()._MEGA_MOE_SYMM_BUFFER.values()
    return buf


def run(sm90, experts, buf, x, ids, w, rsf=1.0, n=None):
    n = x.shape[0] if n is None else n
    return sm90.run_sm90_mega_routed(experts, x, ids, w, buf, n, hidden_size=H,
                                     routed_scaling_factor=rsf)


def new_buffer():
    return sys.modules["deep_gemm"].get_symm_buffer_for_sm90_mega_moe(None, E, 16, K, H, INTER)


def ascending_sum(rows, ids, n):
    acc = torch.zeros(n, H)
    for s in range(K):
        acc = torch.where((ids[:n, s] >= 0)[:, None], acc + rows[s, :n].float(), acc)
    return acc.bfloat16()


MX = {"quant_cfg": [
    {"quantizer_name": "*dispatch_quantizer", "cfg": {"format": "mxfp8"}},
    {"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}}]}


def test_quantized_matches_the_kernel_on_quantized_tokens_and_rows(sglang_sm90):
    model, buf = Model(), new_buffer()
    x, ids, w = batch("mx")
    rsf = 2.5
    plain = run(sglang_sm90, model.experts, buf, moewire.formats.fake_quant(x, "mxfp8"),
                ids, w, rsf)
    rows = combine_rows(buf, get(sg_trampolines._flavour(model.experts)), "fp8_mega_moe")
    want = ascending_sum(moewire.formats.fake_quant(rows[:, :T], "mxfp8"), ids, T)
    assert sg.quantize_sglang_model(model, MX) == 1
    y = run(sglang_sm90, model.experts, buf, x, ids, w, rsf)
    assert layout_check.layout_checked(buf)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(y.view(torch.int16), plain.view(torch.int16))
    assert torch.equal(y[-2:].float(), torch.zeros(2, H))  # padding tokens give +0
    assert torch.equal(buf.topk_weights[:T], w * torch.tensor(rsf))


def test_through_run_mega_routed_experts(sglang_sm90):
    """The SM90 hand-off: the buffer comes from SGLang's cache, both sites' runners nest."""
    model = Model()
    x, ids, w = batch("mega")
    plain = run_mega(model.experts, x, ids, w, 2.5)
    buf = mega_buffer()
    rows = combine_rows(buf, get(sg_trampolines._flavour(model.experts)), "fp8_mega_moe")
    assert torch.equal(plain.view(torch.int16), ascending_sum(rows, ids, T).view(torch.int16))
    sg.quantize_sglang_model(model, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}}]})
    y = run_mega(model.experts, x, ids, w, 2.5)
    assert mega_buffer() is buf and layout_check.layout_checked(buf)
    want = ascending_sum(moewire.formats.fake_quant(rows[:, :T], "mxfp8"), ids, T)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


def test_identity_formats_are_bit_exact(sglang_sm90):
    model, buf = Model(), new_buffer()
    x, ids, w = batch("bf16")
    plain = run(sglang_sm90, model.experts, buf, x, ids, w, 0.75)
    sg.quantize_sglang_model(model, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "bf16"}}]})
    y = run(sglang_sm90, model.experts, buf, x, ids, w, 0.75)
    assert layout_check.layout_checked(buf)
    assert torch.equal(y.view(torch.int16), plain.view(torch.int16))


def test_sites_recognised_by_structure(sglang_sm90, monkeypatch):
    assert [sg.recognise_site(site) for site in SITES] == [None, None]
    monkeypatch.setitem(sys.modules, sg.MEGA_MOE, None)
    assert "does not import" in sg.recognise_site(SITES[0])


def test_wrong_call_shape_fails(sglang_sm90, monkeypatch):
    """The stand-in takes sgl-deep-gemm's signature: a staging call SGLang does not make
    (here: group_size 32) is refused, so a wrong guess about the call shape fails."""
    dg = sys.modules["deep_gemm"]
    original = dg.mega_moe_pre_dispatch_sm90
    monkeypatch.setattr(dg, "mega_moe_pre_dispatch_sm90",
                        lambda *a, **k: original(*a, **{**k, "group_size": 32}))
    with pytest.raises(ValueError, match="group_size must be 128"):
        run(sglang_sm90, Model().experts, new_buffer(), *batch("shape"))


def _quantized(sglang_sm90, cfg=MX):
    model = Model()
    sg.quantize_sglang_model(model, cfg)
    return model.experts


def _tagged(experts, x):
    """Mark ``x`` as written into the buffer by the op before the MoE (SGLang's own tag)."""
    mm = mega_moe()
    buf = mm._mega_moe_buffer(types.SimpleNamespace(
        experts=experts, config=types.SimpleNamespace(
            num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=INTER),
        num_fused_shared_experts=0, mega_shared_l1_weights=None))
    mm.MegaMoeInput(buf, x.shape[0], None, None, None, 0).mark(x)
    return x


REFUSALS = [
    ("mega-gate", "Mega-Gate .* SGLANG_OPT_DEEPGEMM_MEGA_GATE=0"),
    ("input-in-buffer", r"mega_moe_input_target.* SGLANG_OPT_DEEPGEMM_MEGA_GATE=0"),
    ("fp8-combine", "DG_USE_FP8_COMBINE=1 makes .* unset DG_USE_FP8_COMBINE"),
    ("unknown-mma-type", "mma_type='fp8xfp8', which moewire does not know"),
    ("mxfp4-on-sm90", "mma_type='mxf4xmxf4', which moewire does not know for "
                      r"sglang\.srt\.layers\.moe\.mega_moe_sm90"),
]


@contextlib.contextmanager
def _in_mode(mode: str, experts, tmp_path):
    """Quantizing, or calibrating (SGLang's ``calibrating``: every enabled quantizer collects,
    and the scales are saved on a normal exit)."""
    if mode == "quantizing":
        yield
        return
    with sg.calibrating(experts, str(tmp_path / "scales-{rank}.pt")):
        assert {q.mode for q in (experts.dispatch_quantizer, experts.combine_quantizer)
                if q.mode != "disabled"} == {"calibrate"}
        yield


#: A refusal must fire while calibrating too: calibration would otherwise collect from a call
#: whose tokens never pass a hook (no amax, or none of these tokens) or whose rows moewire
#: misreads, and save scales from it.
MODES = ["quantizing", "calibrating"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("case", "match"), REFUSALS, ids=[case for case, _ in REFUSALS])
def test_refusals_through_sglang(sglang_sm90, monkeypatch, tmp_path, case, match, mode):
    """Each path moewire cannot see, refused by name before SGLang's function runs, with the
    quantizers quantizing or calibrating; no scales are saved from a refused call."""
    cfg = MX
    if case == "mxfp4-on-sm90":
        cfg = {"quant_cfg": [
            {"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}}]}
    experts = _quantized(sglang_sm90, cfg)
    x, ids, w = batch(case)
    kwargs = {}
    if case == "mega-gate":
        kwargs["routing_in_buffer"] = True
    elif case == "input-in-buffer":
        x = _tagged(experts, x)
    elif case == "fp8-combine":
        monkeypatch.setenv("DG_USE_FP8_COMBINE", "1")
    elif case == "unknown-mma-type":  # a later SGLang with another kind
        monkeypatch.setattr(mega_moe(), "_mega_moe_mma_type", lambda e: "fp8xfp8")
    else:
        experts._mega_moe_w4a4 = True
    with pytest.raises(RuntimeError, match=match) as info, _in_mode(mode, experts, tmp_path):
        if case == "mxfp4-on-sm90":  # the SM90 site alone (sgl-deep-gemm's SM90 buffer
            run(sglang_sm90, experts, new_buffer(), x, ids, w)  # asserts FP8 before it)
        else:
            run_mega(experts, x, ids, w, **kwargs)
    assert str(info.value).startswith(f"{experts._moewire_name}: ")
    assert not list(tmp_path.iterdir())
    del info  # its traceback holds the converted experts (the leak check)


def test_w4a4_combine_only_is_not_refused_by_the_mega_site(sglang_sm90):
    experts = _quantized(sglang_sm90, {"quant_cfg": [
        {"quantizer_name": "*combine_quantizer", "cfg": {"format": "mxfp8"}}]})
    experts._mega_moe_nvfp4 = True
    assert sg_refusals._refusal(SITES[0], experts, {}) is None


@pytest.mark.parametrize("mode", MODES)
def test_post_expert_norm_refused(sglang_sm90, tmp_path, mode):
    experts = _quantized(sglang_sm90)
    calls = []
    guard = sg_refusals._refuse_post_norm(lambda *a, **k: calls.append(k))
    with (pytest.raises(RuntimeError, match="post_expert_norm=True.*without post_expert_norm"),
          _in_mode(mode, experts, tmp_path)):
        experts.moewire_run(guard, torch.zeros(1, H), post_expert_norm=True)
    assert not calls
    assert not list(tmp_path.iterdir())


def test_outside_a_mega_call_fails_closed(sglang_sm90):
    experts = _quantized(sglang_sm90)
    with pytest.raises(RuntimeError, match="without reaching moewire's staging hook"):
        experts(torch.zeros(1, H))
    with pytest.raises(RuntimeError, match="no SGLang Mega-MoE call is in progress.*raise the"):
        sg_trampolines._symm_buffer(experts)


def test_no_experts_refused(sglang_sm90):
    with pytest.raises(RuntimeError, match="--moe-a2a-backend megamoe"):
        sg.quantize_sglang_model(nn.Linear(2, 2), MX)


def test_calibrate_then_save_and_load(sglang_sm90, tmp_path):
    model, buf = Model(), new_buffer()
    x, ids, w = batch("calib")
    sg.quantize_sglang_model(model, "moe_fp8")
    with sg.calibrating(model, str(tmp_path / "scales-{rank}.pt")):
        run(sglang_sm90, model.experts, buf, x, ids, w)
    assert (tmp_path / "scales-0.pt").is_file()
    y = run(sglang_sm90, model.experts, buf, x, ids, w)
    other = Model()
    sg.quantize_sglang_model(other, "moe_fp8", str(tmp_path / "scales-{rank}.pt"))
    assert torch.equal(run(sglang_sm90, other.experts, new_buffer(), x, ids, w).view(torch.int16),
                       y.view(torch.int16))


def _scheduler_module():
    """Stands in for ``sglang.srt.managers.scheduler`` (it imports the whole server)."""
    module = types.ModuleType("sglang.srt.managers.scheduler")
    module.Scheduler = type("Scheduler", (), {})
    return module


def test_plugin_registers_the_load_model_hook_and_the_rpcs(sglang_sm90, monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    scheduler = _scheduler_module()
    monkeypatch.setitem(sys.modules, scheduler.__name__, scheduler)
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    monkeypatch.delenv("MOEWIRE_RECIPE", raising=False)
    sg.register()
    assert not HookRegistry._hooks
    assert callable(scheduler.Scheduler.moewire_begin_calibration)
    monkeypatch.setenv("MOEWIRE_RECIPE", "moe_fp8")
    sg.register()
    target = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
    [(kind, hook, _)] = HookRegistry._hooks[target]
    assert kind is HookType.AFTER
    runner = types.SimpleNamespace(model=Model())
    assert hook("loaded", runner) == "loaded"
    assert type(runner.model.experts).__name__.startswith("Quant")


def test_sglangs_plugin_loader_finds_moewire_through_its_entry_point(sglang_sm90, monkeypatch):
    """SGLang's own loader (``load_plugins_by_group``, as released) reaches moewire's plugin
    through the installed ``sglang.srt.plugins`` entry point, at the host package's path."""
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    monkeypatch.setenv("SGLANG_PLUGINS", "moewire")
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert list(plugins) == ["moewire"]
    func, dist = plugins["moewire"]
    assert func is sg.register and dist == "moewire"
    assert sg.register.__module__ == "moewire.integrations.sglang"


def test_calibration_rpcs_save_what_serving_loads(sglang_sm90, tmp_path):
    """Engine.collective_rpc("moewire_begin_calibration", ...), prompts, then
    "moewire_finish_calibration": the scheduler's model is calibrated and its scales saved;
    a server started with MOEWIRE_SCALES loads them (the load_model hook)."""
    scheduler = types.SimpleNamespace(
        tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=Model())))
    model = scheduler.tp_worker.model_runner.model
    x, ids, w = batch("rpc")
    with pytest.raises(RuntimeError, match="no calibration in progress"):
        sg.SchedulerCalibration.moewire_finish_calibration(scheduler, "unused")
    sg.SchedulerCalibration.moewire_begin_calibration(scheduler, recipe="moe_fp8")
    assert model.experts.combine_quantizer.mode == "calibrate"
    buf = new_buffer()
    run(sys.modules["sglang.srt.layers.moe.mega_moe_sm90"], model.experts, buf, x, ids, w)
    path = str(tmp_path / "rank{rank}.pt")
    sg.SchedulerCalibration.moewire_finish_calibration(scheduler, scales_path=path)
    assert (tmp_path / "rank0.pt").is_file()
    y = run(sglang_sm90, model.experts, buf, x, ids, w)
    served = Model()
    sg.quantize_sglang_model(served, "moe_fp8", path)
    assert torch.equal(run(sglang_sm90, served.experts, new_buffer(), x, ids, w).view(torch.int16),
                       y.view(torch.int16))


class _Layers(nn.Module):
    """SGLang's module tree around the experts: ``layers.N.mlp.experts``."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(count):
            layer = nn.Module()
            layer.mlp = Model()
            self.layers.append(layer)


def test_eval_mixed_recipe_loads_through_the_plugin(sglang_sm90, monkeypatch, tmp_path):
    """The mixed recipe ``moewire eval --per-layer`` writes (its own writer), served through
    MOEWIRE_RECIPE: exactly the named layers get the 4-bit pair, every other one the high
    pair (``layers.1`` is not ``layers.10``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from moewire.eval import mixed_recipe_yaml

    path = tmp_path / "mixed_recipe.yaml"
    path.write_text(mixed_recipe_yaml(("nvfp4", "nvfp4"), [1, 3], ("fp8", "fp8"), "mixed"))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.scheduler", _scheduler_module())
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    monkeypatch.setenv("MOEWIRE_RECIPE", str(path))
    monkeypatch.delenv("MOEWIRE_SCALES", raising=False)
    sg.register()
    [(_, hook, _)] = HookRegistry._hooks[
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model"]
    runner = types.SimpleNamespace(model=_Layers(11))
    hook("loaded", runner)
    formats = {
        (n, q): getattr(layer.mlp.experts, q).fmt.name
        for n, layer in enumerate(runner.model.layers)
        for q in ("dispatch_quantizer", "combine_quantizer")
    }
    assert {key for key, fmt in formats.items() if fmt == "nvfp4"} == {
        (n, q) for n in (1, 3) for q in ("dispatch_quantizer", "combine_quantizer")}
    assert {fmt for fmt in formats.values()} == {"nvfp4", "fp8"}
