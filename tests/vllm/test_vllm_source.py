"""vLLM 0.33's and 0.34's ``DeepGemmMegaMoEExperts`` loaded from their released source files
on the 0.32 install, against the stand-in build their bundled DeepGEMM matches (vllm-0.33).

``make test-vllm`` fetches the files (tests/vllm/fetch_vllm_src.py) into
``.venv-vllm/vllm-<version>-src``; the rest of each release is not needed: the module imports
only names 0.32 also has, plus the release's ``prepare_megamoe`` (and 0.34's
``eplb_triton``), loaded from their files too.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import _standin as standin
import _vllm_world as setup
import pytest
import torch
from _vllm_world import INTER, E, H, K

pytestmark = pytest.mark.vllm

vllm_mod = pytest.importorskip("moewire.integrations.vllm")
SRC_DIR = Path(os.environ.get("MOEWIRE_VLLM_SRC_DIR", ".venv-vllm"))
# Released versions and a layer-number offset each (vLLM refuses duplicate layer names).
VERSIONS = {"0.33.0": 100, "0.34.0": 200}
FUSED = "vllm.model_executor.layers.fused_moe."


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=list(VERSIONS), ids=[f"vllm-{v}" for v in VERSIONS])
def v033(request):
    """The release's deep_gemm_mega_moe module, registered with moewire; ``.layer(n)`` gives
    a layer prefix unique to the release."""
    version = request.param
    src = SRC_DIR / f"vllm-{version}-src"
    if not (src / "deep_gemm_mega_moe.py").is_file():
        pytest.fail(f"vLLM {version} sources missing in {src}: run `make test-vllm`")
    if (src / "eplb_triton.py").is_file():
        _load(FUSED + "eplb_triton", src / "eplb_triton.py")
    _load(FUSED + "prepare_megamoe", src / "prepare_megamoe.py")
    name = f"vllm{version.replace('.', '')}_deep_gemm_mega_moe"
    module = _load(name, src / "deep_gemm_mega_moe.py")
    site = vllm_mod.ExpertsSite(name, "DeepGemmMegaMoEExperts", read_from=version)
    assert vllm_mod.recognise(module.DeepGemmMegaMoEExperts, site) is None
    vllm_mod.register_site(module.DeepGemmMegaMoEExperts, site)
    offset = VERSIONS[version]
    module.layer = lambda n: f"model.layers.{offset + n}.ffn.experts"
    return module


def _make_033(module, config, prefix: str):
    experts = module.DeepGemmMegaMoEExperts(
        config,
        num_experts=E,
        num_local_experts=E,
        experts_start_idx=0,
        top_k=K,
        hidden_size=H,
        intermediate_size=INTER,
        activation=module.MegaMoEActivation(clamp=10.0),
        weight_format=module.MEGA_MOE_MXFP4,
        prefix=prefix,
    )
    # The same checkpoint as the 0.32 experts, written by vLLM 0.33's own weight loader.
    reference = setup.make_experts(config, prefix=prefix + ".ckpt")
    for e in range(E):
        for which, ours in (("w13", "w13"), ("w2", "w2")):
            for suffix in ("weight", "weight_scale"):
                data = getattr(reference, f"{ours}_{suffix}").data[e]
                param = getattr(experts, f"{which}_{suffix}")
                name = f"{prefix}.{which}_{suffix}"
                shards = [("w2", data)] if which == "w2" else [
                    ("w1", data[:INTER]), ("w3", data[INTER:])
                ]
                for shard_id, shard in shards:
                    experts.weight_loader(param, shard, name, shard_id, e)
    return experts, reference


def test_033_class_equals_032_class_bit_for_bit(vllm_config, v033):
    from vllm.forward_context import create_forward_context, override_forward_context

    vllm_mod.register_vllm_experts()
    x, ids, w = setup.routing(8, seed=5)
    pad = torch.zeros(8, dtype=torch.bool)
    pad[2] = True
    with standin.use_reference_deep_gemm("vllm-0.33"):
        experts, old = _make_033(v033, vllm_config, v033.layer(40))
        old.finalize_weights()
        context = create_forward_context(None, vllm_config, is_padding=pad)
        with override_forward_context(context):
            y_new = experts(x, w, ids)
            buffer = experts.get_symm_buffer()
            rows = setup.oracle_rows(buffer, K)
            expected = setup.oracle_resum(rows, buffer.topk_idx, 8)
            y_old = old(x, w, ids, activation_clamp=10.0)
        assert vllm_mod.kernel_flavour(experts) == "vllm-0.33"
    assert torch.equal(y_new.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(y_new.view(torch.int16), y_old.view(torch.int16))
    assert torch.equal(y_new[2], torch.zeros_like(y_new[2]))


def test_033_unfused_shared_expert_is_added_after_the_kernel(vllm_config, v033):
    """0.33's forward adds an unfused shared expert itself; moewire needs nothing more."""
    vllm_mod.register_vllm_experts()
    with standin.use_reference_deep_gemm("vllm-0.33"):
        experts, _ = _make_033(v033, vllm_config, v033.layer(41))
        x, ids, w = setup.routing(4, seed=6)
        shared = torch.nn.Linear(H, H, bias=False).bfloat16()
        y = experts(x, w, ids, shared_experts=shared)
        buffer = experts.get_symm_buffer()
        routed = setup.oracle_resum(setup.oracle_rows(buffer, K), buffer.topk_idx, 4)
    expected = routed.clone()
    expected += shared(x)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


class _SharedMLP(torch.nn.Module):
    """vLLM's shared-expert shape: ``gate_up_proj`` BF16 [2S, H], ``down_proj`` [H, S]."""

    def __init__(self, size: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_up_proj = torch.nn.Linear(H, 2 * size, bias=False).bfloat16()
        self.down_proj = torch.nn.Linear(size, H, bias=False).bfloat16()
        self.gate_up_proj.weight.data = (torch.randn(2 * size, H, generator=g) / 8).bfloat16()
        self.down_proj.weight.data = (torch.randn(H, size, generator=g) / 8).bfloat16()


def _make_033_bf16_fused(module, config, prefix: str, seed: int):
    shared = _SharedMLP(INTER, seed)
    experts = module.DeepGemmMegaMoEExperts(
        config,
        num_experts=E,
        num_local_experts=E,
        experts_start_idx=0,
        top_k=K,
        hidden_size=H,
        intermediate_size=INTER,
        activation=module.MegaMoEActivation(clamp=10.0),
        weight_format=module.MEGA_MOE_BF16,
        shared_experts=shared,
        prefix=prefix,
    )
    g = torch.Generator().manual_seed(seed + 1)
    for e in range(E):
        w13 = (torch.randn(2 * INTER, H, generator=g) / 16).bfloat16()
        w2 = (torch.randn(H, INTER, generator=g) / 16).bfloat16()
        experts.weight_loader(experts.w13_weight, w13[:INTER], f"{prefix}.w13_weight", "w1", e)
        experts.weight_loader(experts.w13_weight, w13[INTER:], f"{prefix}.w13_weight", "w3", e)
        experts.weight_loader(experts.w2_weight, w2, f"{prefix}.w2_weight", "w2", e)
    gate_up = shared.gate_up_proj.weight.data
    experts.load_shared_expert_weight(f"{prefix}.shared_experts.w1.weight", gate_up[:INTER])
    experts.load_shared_expert_weight(f"{prefix}.shared_experts.w3.weight", gate_up[INTER:])
    experts.load_shared_expert_weight(
        f"{prefix}.shared_experts.w2.weight", shared.down_proj.weight.data
    )
    return experts


@pytest.mark.parametrize(
    ("flavour", "shared_slot"), [("vllm-0.32", "last"), ("vllm-0.33", "first")],
    ids=["vllm-0.32", "vllm-0.33"]
)
def test_033_fused_shared_expert_in_flavour_order(vllm_config, v033, flavour, shared_slot):
    from vllm.forward_context import create_forward_context, override_forward_context

    vllm_mod.register_vllm_experts()
    # vLLM caches buffers per shape across layers; a new flavour needs a new buffer.
    v033.DeepGemmMegaMoEExperts._symm_buffers.clear()
    pad = torch.zeros(6, dtype=torch.bool)
    pad[4] = True
    x, ids, w = setup.routing(6, seed=7)
    with standin.use_reference_deep_gemm(flavour):
        prefix = v033.layer(50 + flavour.endswith("0.33"))
        experts = _make_033_bf16_fused(v033, vllm_config, prefix, seed=8)
        assert experts.has_fused_shared_experts
        with override_forward_context(create_forward_context(None, vllm_config, is_padding=pad)):
            y = experts(x, w, ids)
        buffer = experts.get_symm_buffer()
        assert vllm_mod.kernel_flavour(experts) == flavour
    rows = setup.oracle_rows(buffer, K + 1, flavour)
    expected = setup.oracle_resum(rows, buffer.topk_idx, 6, shared=shared_slot)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
    # A padding token still gets the shared expert: its row is always valid.
    shared_row = rows[K, 4]
    assert torch.equal(y[4].view(torch.int16), shared_row.view(torch.int16))


api = pytest.importorskip("moewire.megamoe.api")
formats = pytest.importorskip("moewire.formats")


def _forward_033(config, experts, x, ids, w, pad, shared=None):
    from vllm.forward_context import create_forward_context, override_forward_context

    with override_forward_context(create_forward_context(None, config, is_padding=pad)):
        return experts(x, w, ids, shared_experts=shared)


def _batch(seed: int):
    x, ids, w = setup.routing(6, seed)
    pad = torch.zeros(6, dtype=torch.bool)
    pad[3] = True
    return torch.where(pad[:, None], x * 1000, x), ids, w, pad


def _quantized_resum(buffer, num_tokens, amax, shared_slot):
    """Routed rows NVFP4-quantized (reference), the fused shared row as the kernel wrote it."""
    nvfp4 = formats.get("nvfp4")
    slots = K + (shared_slot is not None)
    rows = setup.oracle_rows(buffer, slots, buffer._moewire_flavour)[:, :num_tokens]
    shared_index = None if shared_slot is None else K
    quantized = torch.stack(
        [rows[s] if s == shared_index else nvfp4.reference(rows[s], amax) for s in range(slots)]
    )
    return setup.oracle_resum(quantized, buffer.topk_idx, num_tokens, shared=shared_slot)


class _RecordingShared(torch.nn.Module):
    """An unfused shared expert that remembers the tokens it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(H, H, bias=False).bfloat16()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.clone())
        return self.proj(x)


def test_033_unfused_shared_gets_unquantized_tokens_after_combine(vllm_config, v033):
    vllm_mod.register_vllm_experts()
    with standin.use_reference_deep_gemm("vllm-0.33"):
        experts, _ = _make_033(v033, vllm_config, v033.layer(60))
        model = torch.nn.ModuleDict({"experts": experts})

        def loop(m):
            for seed in (81, 82):
                _forward_033(vllm_config, m["experts"], *_batch(seed))

        api.quantize(model, "moe_fp8_dispatch_nvfp4_combine", forward_loop=loop)
        shared = _RecordingShared()
        x, ids, w, pad = _batch(83)
        y = _forward_033(vllm_config, experts, x, ids, w, pad, shared)
        buffer = experts.get_symm_buffer()
    assert torch.equal(shared.seen[-1], x)
    xq = formats.get("fp8").reference(x, experts.dispatch_quantizer.amax)
    staged = torch.empty(6, H, dtype=torch.float8_e4m3fn)
    sf = torch.empty(6, H // 128, dtype=torch.int32)
    idx, wo = torch.empty(6, K, dtype=torch.int64), torch.empty(6, K)
    standin.prepare_megamoe_inputs_reference(xq, w, ids, staged, sf, idx, wo, is_padding=pad)
    assert torch.equal(buffer.x[:6].view(torch.uint8), staged.view(torch.uint8))
    expected = _quantized_resum(buffer, 6, experts.combine_quantizer.amax, None)
    expected += shared.proj(x)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize(
    ("flavour", "shared_slot"), [("vllm-0.32", "last"), ("vllm-0.33", "first")],
    ids=["vllm-0.32", "vllm-0.33"]
)
def test_033_fused_shared_combine_quantized_in_flavour_order(
    vllm_config, v033, flavour, shared_slot
):
    vllm_mod.register_vllm_experts()
    v033.DeepGemmMegaMoEExperts._symm_buffers.clear()
    with standin.use_reference_deep_gemm(flavour):
        prefix = v033.layer(70 + flavour.endswith("0.33"))
        experts = _make_033_bf16_fused(v033, vllm_config, prefix, seed=9)
        model = torch.nn.ModuleDict({"experts": experts})

        def loop(m):
            for seed in (91, 92):
                _forward_033(vllm_config, m["experts"], *_batch(seed))

        api.quantize(model, "moe_combine_nvfp4", forward_loop=loop)
        y = _forward_033(vllm_config, experts, *_batch(93))
        buffer = experts.get_symm_buffer()
    expected = _quantized_resum(buffer, 6, experts.combine_quantizer.amax, shared_slot)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


def test_033_fused_shared_expert_keeps_the_original_tokens(vllm_config, v033):
    """0.33's own forward with a fused shared expert and a dispatch quantizer: moewire's
    second launch gives the shared expert the original tokens; the output is the routed
    rows of a plain run on q(x) and the shared row of a plain run on x, shared first."""
    vllm_mod.register_vllm_experts()
    v033.DeepGemmMegaMoEExperts._symm_buffers.clear()
    with standin.use_reference_deep_gemm("vllm-0.33"):
        experts = _make_033_bf16_fused(v033, vllm_config, v033.layer(80), seed=10)
        model = torch.nn.ModuleDict({"experts": experts})
        api.quantize(
            model, "moe_dispatch_fp8",
            forward_loop=lambda m: _forward_033(vllm_config, m["experts"], *_batch(94)),
        )
        x, ids, w, pad = _batch(95)
        y = _forward_033(vllm_config, experts, x, ids, w, pad)
        buffer = experts.get_symm_buffer()
        amax = experts.dispatch_quantizer.amax
        twin = _make_033_bf16_fused(v033, vllm_config, v033.layer(81), seed=10)
        _forward_033(vllm_config, twin, x, ids, w, pad)
        shared_row = setup.oracle_rows(twin.get_symm_buffer(), K + 1, "vllm-0.33")[K].clone()
        xq = formats.get("fp8").reference(x, amax)
        _forward_033(vllm_config, twin, xq, ids, w, pad)
        rows = setup.oracle_rows(twin.get_symm_buffer(), K + 1, "vllm-0.33").clone()
        assert twin.get_symm_buffer() is buffer  # one buffer for the shape (vLLM's cache)
    assert not torch.equal(rows[K, :6], shared_row[:6])  # the shared row shows its input
    rows[K] = shared_row
    expected = setup.oracle_resum(rows, buffer.topk_idx, 6, shared="first")
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("kernel_adds", ["first", "last"], ids=["right-end", "wrong-end"])
def test_fused_shared_combine_on_order_visible_rows(vllm_config, v033, kernel_adds, monkeypatch):
    """Combine-only with the fused shared expert on the build this release bundles (shared
    row added first): bit-exact to the re-sum where the order shows; a kernel adding it at
    the other end fails the layout check."""
    from moewire.quantizer import WireQuantizer
    from moewire.reference import deep_gemm as reference

    vllm_mod.register_vllm_experts()
    v033.DeepGemmMegaMoEExperts._symm_buffers.clear()
    with standin.use_reference_deep_gemm("vllm-0.33"):
        experts = _make_033_bf16_fused(
            v033, vllm_config, v033.layer(90 + (kernel_adds == "last")), seed=11
        )
        # After construction: vLLM reads the kernel's signature to decide on fusion.
        monkeypatch.setattr(
            reference, "bf16_mega_moe",
            setup.order_visible_kernel(reference.bf16_mega_moe, K, kernel_adds == "first"),
        )
        assert vllm_mod.kernel_flavour(experts) == "vllm-0.33"
        model = torch.nn.ModuleDict({"experts": experts})
        api.quantize(model, "moe_combine_nvfp4")
        experts.combine_quantizer = WireQuantizer("mxfp8")  # keeps -2^24 and 0.5 exact
        x, ids, w, pad = _batch(95)
        ids[0] = torch.arange(K)
        if kernel_adds == "last":
            with pytest.raises(RuntimeError, match=r"added first\) does not reproduce"):
                _forward_033(vllm_config, experts, x, ids, w, pad)
            return
        y = _forward_033(vllm_config, experts, x, ids, w, pad)
        buffer = experts.get_symm_buffer()
    mxfp8 = formats.get("mxfp8")
    rows = setup.oracle_rows(buffer, K + 1, "vllm-0.33")[:, :6]
    quantized = torch.stack([mxfp8.reference(r, None) for r in rows[:K]] + [rows[K]])
    expected = setup.oracle_resum(quantized, buffer.topk_idx, 6, shared="first")
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
    assert y[0, 0].item() == 0.5
    wrong = setup.oracle_resum(quantized, buffer.topk_idx, 6, shared="last")
    assert not torch.equal(wrong.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("skip", ["0", "1"], ids=["skip-padding-0", "skip-padding-1"])
def test_padding_stays_out_of_calibrated_amaxes(vllm_config, v033, skip, monkeypatch):
    """VLLM_MOE_SKIP_PADDING=1: the forward passes is_padding and staging writes id -1;
    =0: it passes none, and the padding rows reach staging with the router's ids, -1 for
    padding. Either way the padding tokens (here 1000x larger) stay out of both amaxes."""
    monkeypatch.setenv("VLLM_MOE_SKIP_PADDING", skip)
    vllm_mod.register_vllm_experts()
    seen = []
    real = standin.prepare_megamoe_inputs_reference

    def recording(*args, **kwargs):
        seen.append(kwargs.get("is_padding"))
        return real(*args, **kwargs)

    monkeypatch.setattr(standin, "prepare_megamoe_inputs_reference", recording)
    with standin.use_reference_deep_gemm("vllm-0.33"):
        experts, _ = _make_033(v033, vllm_config, v033.layer(96 + int(skip)))
        model = torch.nn.ModuleDict({"experts": experts})
        x, ids, w, pad = _batch(97)
        ids = torch.where(pad[:, None], -1, ids)

        def loop(m):
            _forward_033(vllm_config, m["experts"], x, ids, w, pad)

        api.quantize(model, "moe_fp8_dispatch_nvfp4_combine", forward_loop=loop)
        buffer = experts.get_symm_buffer()
    assert (seen[-1] is None) == (skip == "0")
    assert float(experts.dispatch_quantizer.amax) == float(x[~pad].float().abs().max())
    rows = setup.oracle_rows(buffer, K, "vllm-0.33")[:, :6]
    valid = (buffer.topk_idx[:6] >= 0).T
    assert float(experts.combine_quantizer.amax) == float(rows[valid].float().abs().max())
