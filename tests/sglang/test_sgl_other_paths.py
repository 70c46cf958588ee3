"""SGLang 0.5.23's Mega-MoE paths with no site entry, refused at load with the path's name.

Each test runs the released module's own weight preparation on a layer (FlashInfer's three
``prepare_*_moe_weights_for_flashinfer_megamoe``, ``mega_moe.build_mega_moe_experts_weights``
handing over to FlyDSL on ROCm, Muse Spark's ``build_bf16_megamoe_weights`` and
``bind_megamoe_shared_weights``), then moewire's load step (``quantize_sglang_model``, what
the plugin's AFTER hook on ``ModelRunner.load_model`` calls) and checks the refusal: the
layer, the path, the cause and the fix, before any forward.
"""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch
from _released import FLASHINFER_MEGAMOE, MEGA_MOE, MUSE_SPARK_MEGAMOE
from torch import nn

from moewire.integrations import sglang as sg
from moewire.integrations.sglang import paths

pytestmark = pytest.mark.sglang

E, H, INTER = 4, 128, 128
MX = "moe_combine_mxfp8"
NAME = "layers.0.mlp.experts"


class Layer(nn.Module):
    """What SGLang's prepare functions read of a ``FusedMoE`` layer (one EP rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_id, self.num_experts, self.num_local_experts = 0, E, E
        self.hidden_size, self.intermediate_size_per_partition = H, INTER
        self.moe_ep_size, self.moe_ep_rank, self.top_k = 1, 0, 2
        self.moe_runner_config = types.SimpleNamespace(
            is_gated=True, activation="silu", swiglu_limit=None,
            apply_router_weight_on_input=False)
        self.quant_config = types.SimpleNamespace(use_per_token_activation=False)
        g = torch.Generator().manual_seed(7)
        for name, shape in (("w13_weight", (E, 2 * INTER, H)), ("w2_weight", (E, H, INTER)),
                            ("w13_weight_scale", (E, 2 * INTER, H // 16)),
                            ("w2_weight_scale", (E, H, INTER // 16)),
                            ("w13_weight_scale_inv", (E, 2 * INTER // 128, H // 128)),
                            ("w2_weight_scale_inv", (E, H // 128, INTER // 128))):
            setattr(self, name, nn.Parameter(torch.randn(shape, generator=g),
                                             requires_grad=False))
        self.g1_alphas = self.g1_alphas_up = torch.full((E,), 0.5)
        self.w13_input_scale_quant = torch.tensor(2.0)


class Model(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].mlp = nn.Module()
        self.layers[0].mlp.experts = experts


def _refused(model: nn.Module, path: str, *musts: str) -> str:
    with pytest.raises(RuntimeError) as info:
        sg.quantize_sglang_model(model, MX)
    message = str(info.value)
    assert message.startswith(f"{NAME}: this layer runs SGLang's {path} path"), message
    for must in musts:
        assert re.search(must, message), (must, message)
    return message


@pytest.mark.parametrize("prepare", ["fp4", "mxfp8", "nvfp4"],
                         ids=["deepgemm-fp8xfp4", "mxfp8-cutedsl", "nvfp4-cutedsl"])
def test_flashinfer_layer_refused_at_load(sglang_other, prepare):
    layer = Layer()
    getattr(sglang_other[FLASHINFER_MEGAMOE],
            f"prepare_{prepare}_moe_weights_for_flashinfer_megamoe")(layer)
    assert layer._flashinfer_megamoe_layer is None  # built lazily at the first forward
    _refused(Model(layer), "flashinfer-megamoe", re.escape(FLASHINFER_MEGAMOE),
             "combine_quant region", "IN_KERNEL_FC2_REDUCE",
             "serve it without --moe-runner-backend / --moe-a2a-backend flashinfer_megamoe")


@pytest.mark.parametrize("dtype", ["bf16", "mxfp8", "nvfp4"])
def test_flashinfer_refusal_names_the_engine_combine(sglang_other, monkeypatch, dtype):
    """With SGLANG_FLASHINFER_MEGAMOE_COMBINE_DTYPE quantizing the wire, the refusal says
    FlashInfer already casts the combine cells, and which moewire format is that cast."""
    monkeypatch.setenv(paths.ENV_FLASHINFER_COMBINE, dtype)
    layer = Layer()
    sglang_other[FLASHINFER_MEGAMOE].prepare_mxfp8_moe_weights_for_flashinfer_megamoe(layer)
    assert sglang_other[FLASHINFER_MEGAMOE].resolve_flashinfer_megamoe_combine_dtype() == dtype
    message = _refused(Model(layer), "flashinfer-megamoe")
    said = f"FlashInfer already casts those cells to {dtype.upper()}"
    assert (said in message) == (dtype != "bf16"), message
    if dtype != "bf16":
        assert f"moewire's flashinfer_{dtype} format is that cast" in message
        from moewire import formats

        assert formats.get(f"flashinfer_{dtype}").name == f"flashinfer_{dtype}"


@pytest.mark.parametrize("mark", ["shuffled", "selected"],
                         ids=["flydsl-weights", "sglang-selection-only"])
def test_flydsl_layer_refused_at_load(sglang_other, monkeypatch, mark):
    """On ROCm with SGLANG_AMD_USE_FLYDSL_MEGA_MOE=1, mega_moe.py's own build hands the layer
    to FlyDSL, which sets ``_mega_moe_weights_built`` as the DeepGEMM path does: moewire must
    not take it for a DeepGEMM layer. Refused by FlyDSL's weights (``_mega_w1``) or, without
    them, by SGLang's own selection (``_use_amd_flydsl_mega_moe``)."""
    mega_moe = sglang_other[MEGA_MOE]
    monkeypatch.setattr(mega_moe, "_is_hip", True)
    monkeypatch.setenv("SGLANG_AMD_USE_FLYDSL_MEGA_MOE", "1")
    layer = Layer()
    mega_moe.build_mega_moe_experts_weights(layer)
    assert layer._mega_moe_weights_built and hasattr(layer, "_mega_w1")
    if mark == "selected":
        del layer._mega_w1
    _refused(Model(layer), "flydsl-megamoe", "MegaMoEV2", "MoRI",
             "SGLANG_AMD_USE_FLYDSL_MEGA_MOE=0")


def test_flydsl_off_is_the_deepgemm_site(sglang_other, monkeypatch):
    """The same layer on CUDA (``_is_hip`` false): SGLang's DeepGEMM path; no FlyDSL refusal."""
    monkeypatch.setenv("SGLANG_AMD_USE_FLYDSL_MEGA_MOE", "1")
    layer = Layer()
    layer._mega_moe_weights_built = True
    assert paths.runs_other_path(layer) is None


class MuseLayer(nn.Module):
    """What Muse Spark's Mega-MoE reads of its TRT-LLM experts layer (BF16 checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        self.global_num_experts = self.num_local_experts = E
        self.hidden_size, self.intermediate_size_per_partition = H, INTER
        self.local_expert_offset, self.top_k = 0, 2
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * INTER, H).bfloat16(),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.randn(E, H, INTER).bfloat16(), requires_grad=False)


@pytest.mark.parametrize("stage", ["metadata", "bound"])
def test_muse_spark_layer_refused_at_load(sglang_other, stage):
    """Refused with the post-expert norm as the reason: the rows in the buffer are not what
    the kernel adds."""
    muse = sglang_other[MUSE_SPARK_MEGAMOE]
    layer = MuseLayer()
    muse.build_bf16_megamoe_weights(layer)
    if stage == "bound":
        muse.bind_megamoe_shared_weights(layer, "bf16xbf16")
        assert layer._megamoe_weights_built
    _refused(Model(layer), "muse-spark-megamoe", re.escape(MUSE_SPARK_MEGAMOE),
             "post_expert_norm, applied before the route-weighted sum: the combine "
             "RMS-normalises each expert row before summing",
             "--enable-megamoe-for-layernorm-sp")


def test_unread_path_refused_at_load(sglang_other):
    """A layer some other path marked as prepared (a true ``*megamoe*built`` attribute)."""
    layer = Layer()
    layer._newer_megamoe_weights_built = True
    with pytest.raises(RuntimeError, match=(
            rf"^{re.escape(NAME)}: this layer carries _newer_megamoe_weights_built, the mark "
            r"of an SGLang Mega-MoE path moewire has not read .*unset MOEWIRE_RECIPE$")):
        sg.quantize_sglang_model(Model(layer), MX)


def test_path_flags_are_not_marks(sglang_other):
    """``_use_mega_moe`` / ``use_megamoe`` (a model that may use a path) and SGLang's own
    ``_mega_moe_weights_built = False`` on every ``FusedMoE`` refuse nothing."""
    layer = Layer()
    layer._use_mega_moe = layer.use_megamoe = True
    layer._mega_moe_weights_built = False
    assert paths.runs_other_path(layer) is None
    assert paths._unknown(layer) == []
    with pytest.raises(RuntimeError, match="has no Mega-MoE experts"):
        sg.quantize_sglang_model(Model(layer), MX)


#: What moewire does on each platform ``mega_moe_hook.check_mega_moe_compat`` lets
#: ``--moe-a2a-backend megamoe`` run on: a site (``sites.SITES``) or a refused path
#: (``paths.OTHER_PATHS``).
HOOK_PLATFORMS = {"sm90": "mega-sm90", "sm100": "mega", "hip": "flydsl-megamoe"}


def _load_hook(monkeypatch, root, platform):
    """The released ``mega_moe_hook.py`` over the names it reads of the argument framework
    (``resolving_view`` returns the arguments, ``declare_resolution`` sets them)."""
    from _released import _load

    def declare(args, name, **values):
        args.__dict__.update(values)

    stubs = {
        "sglang.srt.arg_groups": {"__path__": [str(root / "sglang/srt/arg_groups")]},
        "sglang.srt.arg_groups.overrides": {
            "declare_resolution": declare, "resolving_view": lambda args: args,
            "model_config_of": lambda args: None},
        "sglang.srt.connector": {"ConnectorType": types.SimpleNamespace(INSTANCE="instance")},
        "sglang.srt.utils.common": {"ceil_align": lambda x, y: -(-x // y) * y,
                                    "parse_connector_type": lambda path: None},
    }
    for name, attrs in stubs.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    runtime = sys.modules["sglang.srt.runtime_context"]
    monkeypatch.setattr(runtime, "attn_dp_enabled_of", lambda cfg: False, raising=False)
    monkeypatch.setattr(runtime, "get_platform", lambda: platform, raising=False)
    name = "sglang.srt.arg_groups.mega_moe_hook"
    monkeypatch.setitem(sys.modules, name, None)  # removed again after the test
    return _load(root, name)


@pytest.mark.parametrize("platform", ["sm90", "sm100", "hip", "sm120", "cpu"])
def test_hook_runs_megamoe_only_where_moewire_has_an_answer(sglang_other, monkeypatch,
                                                             platform):
    """``--moe-runner-backend megamoe`` becomes ``--moe-a2a-backend megamoe``; every
    platform the released hook accepts for it has a site or a refused path in moewire, and
    the others are refused by SGLang itself."""
    from pathlib import Path

    from moewire.integrations.sglang.sites import SITES

    root = Path(sglang_other[MEGA_MOE].__file__).parents[4]  # the loaded wheel's root
    flags = dict.fromkeys(("is_cuda", "is_sm90", "is_sm100", "is_hip"), False)
    flags.update({"sm90": {"is_cuda": True, "is_sm90": True},
                  "sm100": {"is_cuda": True, "is_sm100": True},
                  "hip": {"is_hip": True}, "sm120": {"is_cuda": True}}.get(platform, {}))
    hook = _load_hook(monkeypatch, root, types.SimpleNamespace(**flags))
    args = types.SimpleNamespace(moe_runner_backend="megamoe", moe_a2a_backend="none",
                                 enable_two_batch_overlap=False,
                                 enable_single_batch_overlap=False)
    known = {s.name for s in SITES} | {p.name for p in paths.OTHER_PATHS}
    if platform in HOOK_PLATFORMS:
        hook.handle_mega_moe(args)
        assert (args.moe_a2a_backend, args.moe_runner_backend) == ("megamoe", "auto")
        assert HOOK_PLATFORMS[platform] in known
    else:
        with pytest.raises(ValueError, match="needs a CUDA SM90 GPU"):
            hook.handle_mega_moe(args)
