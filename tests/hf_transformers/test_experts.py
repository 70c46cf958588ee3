"""The "moewire" transformers experts implementation against transformers' eager experts,
a float64 oracle, the layout flags, the quantize/calibrate/scales/unquantize cycle and the
serving names."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers.integrations.moe")

import _tiny  # noqa: E402
import torch  # noqa: E402

import moewire
from moewire.integrations.vllm.sites import SITES

FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral")
T = 64


def _experts(family: str, implementation: str = "moewire", dtype: torch.dtype = torch.bfloat16):
    import transformers as tf

    cfg = _tiny.config(family)
    cfg._experts_implementation = implementation
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = tf.AutoModelForCausalLM.from_config(cfg).to(dtype)
        experts = model.model.layers[0].mlp.experts
        with torch.no_grad():
            experts.gate_up_proj.normal_(0.0, experts.gate_up_proj.shape[-1] ** -0.5)
            experts.down_proj.normal_(0.0, experts.down_proj.shape[-1] ** -0.5)
    return cfg, experts


def _routing(generator: torch.Generator,
             n: int = T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn((n, 128), generator=generator).bfloat16()
    idx = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(n)])
    w = torch.rand((n, 2), generator=generator) * 2.5  # a routed_scaling_factor's range
    return x, idx, w


def _bf(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def _oracle(experts, x, idx, w, clamp=None):
    """float64: the exact expert sum, and the same with the Mega-MoE BF16 build's rounding
    points (weights and tokens in BF16, L1 out, the weighted activation and each L2 row in
    BF16; the sum in FP32 then BF16)."""
    w1, w2, xs = experts.gate_up_proj.double(), experts.down_proj.double(), x.double()
    exact = torch.zeros((x.shape[0], 128), dtype=torch.float64)
    emulated = torch.zeros_like(exact)
    for s in range(idx.shape[1]):
        e, ws = idx[:, s], w[:, s, None].double()
        gate, up = torch.einsum("tij,tj->ti", w1[e], xs).chunk(2, dim=-1)
        bf_gate, bf_up = torch.einsum("tij,tj->ti", _bf(w1)[e], _bf(xs)).chunk(2, dim=-1)

        def act(g, u):
            if clamp is not None:
                g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
            return torch.nn.functional.silu(g) * u

        exact += ws * torch.einsum("tij,tj->ti", w2[e], act(gate, up))
        h = _bf(act(_bf(bf_gate), _bf(bf_up)) * ws)
        emulated += _bf(torch.einsum("tij,tj->ti", _bf(w2)[e], h))
    return exact, _bf(emulated)


@pytest.mark.parametrize("family", FAMILIES)
def test_quantizers_off_equals_eager_within_summation_order(family):
    """moewire == the float64 emulation of the kernel's rounding points except where an FP32
    summation order flips an intermediate BF16 rounding (a few elements, <= 2 BF16 ulps of
    the token's largest output), and its error to the exact float64 sum is no larger than
    transformers' eager experts' (about 0.4% vs 0.46% relative L2 here)."""
    cfg, experts = _experts(family)
    x, idx, w = _routing(torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours = experts(x, idx, w).double()
        cfg._experts_implementation = "eager"
        eager = experts(x, idx, w).double()
    exact, emulated = _oracle(experts, x, idx, w)
    token_max = emulated.abs().amax(dim=1, keepdim=True)
    assert ((ours - emulated).abs() <= token_max * 2.0**-7).all()
    assert (ours != emulated).float().mean() < 0.01
    rel = lambda y: ((y - exact).norm() / exact.norm()).item()  # noqa: E731
    assert rel(ours) < 2.0**-7
    assert rel(ours) <= 1.1 * rel(eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_model_in_another_dtype_gets_its_dtype_back_with_the_kernels_values(dtype):
    """An FP32 or FP16 model: the kernel runs on its weights and tokens rounded to BF16 and
    returns y in the model's dtype, holding the kernel's BF16 values (the float64 emulation
    of its rounding points, to the same summation-order flips as the BF16 model), not the
    16 bits of y reinterpreted nor the unrounded FP32 weights' products."""
    _, experts = _experts("qwen3_moe", dtype=dtype)
    x, idx, w = _routing(torch.Generator().manual_seed(11))
    x, w = x.to(dtype) * 1.7, w.to(dtype)  # tokens off the BF16 grid in FP32 and FP16
    assert x.float().ne(x.float().bfloat16().float()).any()
    with torch.no_grad():
        ours = experts(x, idx, w)
    assert ours.dtype == dtype
    exact, emulated = _oracle(experts, x, idx, w)
    emulated = emulated.to(dtype).double()
    token_max = emulated.abs().amax(dim=1, keepdim=True)
    assert ((ours.double() - emulated).abs() <= token_max * 2.0**-7).all()
    assert (ours.double() != emulated).float().mean() < 0.01
    assert ((ours.double() - exact).norm() / exact.norm()).item() < 2.0**-7


def test_a_batch_longer_than_the_buffer_equals_its_chunks_run_one_by_one(moewire_registered):
    """500 tokens through a buffer of 384 tokens: two chunks, 384 and 116 tokens, the
    second with routing weights three times the first's. Bit for bit the two chunks run
    alone, the last first, on a module of the same capacity: each chunk stages its own
    tokens, ids and weights."""
    mt = moewire_registered
    _, experts = _experts("qwen3_moe")
    _, alone = _experts("qwen3_moe")
    x, idx, w = _routing(torch.Generator().manual_seed(13), n=500)
    w[384:] *= 3.0
    mt.prepare(experts, max_num_tokens=384)
    mt.prepare(alone, max_num_tokens=384)
    assert experts._moewire_mega.buffer.num_max_tokens_per_rank == 384
    with torch.no_grad():
        ours = experts(x, idx, w)
        last = alone(x[384:], idx[384:], w[384:])
        first = alone(x[:384], idx[:384], w[:384])
    assert ours.shape == x.shape
    assert torch.equal(ours.view(torch.int16), torch.cat([first, last]).view(torch.int16))


def test_swiglu_limit_becomes_the_activation_clamp():
    """DeepSeek-V4's experts clamp gate and up at swiglu_limit (its _apply_gate); the kernel
    gets it as activation_clamp, and the oracle with the clamp matches, without it not."""
    import transformers as tf

    cfg = tf.DeepseekV4Config(hidden_size=128, intermediate_size=128, num_local_experts=8,
                              num_experts_per_tok=2, swiglu_limit=0.05)
    cfg._experts_implementation = "moewire"
    experts = tf.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts(cfg)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for weights in (experts.gate_up_proj, experts.down_proj):
            weights.copy_(torch.randn(weights.shape, generator=gen) / 128**0.5)
    experts.to(torch.bfloat16)
    x, idx, w = _routing(torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = experts(x, idx, w).double()
    _, clamped = _oracle(experts, x, idx, w, clamp=0.05)
    _, unclamped = _oracle(experts, x, idx, w)
    token_max = clamped.abs().amax(dim=1, keepdim=True)
    assert ((ours - clamped).abs() <= token_max * 2.0**-7).all()
    assert (ours - unclamped).abs().max() > 10 * (ours - clamped).abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_routes_every_experts_module(family, checkpoints, moewire_registered):
    """A saved tiny checkpoint loads with experts_implementation="moewire"; each experts
    module stages into its own buffer, and the logits stay within BF16 rounding of eager."""
    import transformers as tf

    mt = moewire_registered
    path = checkpoints(family)
    ids = torch.randint(0, _tiny.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    eager = tf.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    ours = mt.prepare(
        tf.AutoModelForCausalLM.from_pretrained(path, experts_implementation="moewire")
    )
    names = [n for n, _ in mt.experts_modules(ours)]
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    with torch.no_grad():
        a, b = eager(ids).logits.float(), ours(ids).logits.float()
    # A token near a routing tie may pick another expert downstream: L2, not max.
    assert (a - b).norm() <= 0.05 * a.norm()
    assert not torch.equal(a, b)  # the kernel ran: its rounding points are not eager's
    for _, module in mt.experts_modules(ours):
        staged = module._moewire_mega.buffer.topk_idx[:24]
        assert (staged >= 0).all()


def test_fp8xfp4_build_is_opt_in(checkpoints, moewire_registered):
    """fp8xfp4 quantizes the weights to FP4 and the tokens to FP8: further from eager than
    the BF16 build, still close."""
    import transformers as tf

    mt = moewire_registered
    path = _tiny.checkpoint("qwen3_moe", checkpoints("qwen3_moe").parent / "q512",
                            hidden=512, intermediate=512, layers=1)
    ids = torch.randint(0, _tiny.VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    eager = tf.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")

    def load():
        return tf.AutoModelForCausalLM.from_pretrained(path, experts_implementation="moewire")

    bf16, fp4 = mt.prepare(load()), mt.prepare(load(), "fp8xfp4")
    with torch.no_grad():
        ref = eager(ids).logits.float()
        err = {k: (m(ids).logits.float() - ref).norm() / ref.norm() for k, m in
               (("bf16", bf16), ("fp4", fp4))}
    assert err["bf16"] < err["fp4"] < 0.5


def test_fp4xfp4_build_runs_deepgemm_28s_nvfp4_kernel(checkpoints, moewire_registered):
    """fp4xfp4: NVFP4 weights with per-expert global scales (the alphas) and NVFP4 tokens, on
    the stand-in of DeepGEMM 2.8.0's fp4_fp4_mega_moe (flavour deepgemm-2.8): the BF16 wire
    is the kernel's own output bit for bit, an NVFP4 combine changes it, and the model stays
    as close to eager as the FP8 x FP4 build (both quantize the weights to 4 bits)."""
    import transformers as tf

    import moewire

    mt = moewire_registered
    path = _tiny.checkpoint("qwen3_moe", checkpoints("qwen3_moe").parent / "q512-fp4",
                            hidden=512, intermediate=512, layers=1)
    ids = torch.randint(0, _tiny.VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    eager = tf.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")

    def load(mma):
        return mt.prepare(tf.AutoModelForCausalLM.from_pretrained(
            path, experts_implementation="moewire"), mma, max_num_tokens=32)

    ours, fp8 = load("fp4xfp4"), load("fp8xfp4")
    (_, module), = mt.experts_modules(ours)
    assert module._moewire_mega.flavour == "deepgemm-2.8"
    assert set(module._moewire_mega.extra) == {"l1_alphas", "l2_alphas"}
    with torch.no_grad():
        ref, plain, other = (m(ids).logits.float() for m in (eager, ours, fp8))
        moewire.quantize(ours, {"quant_cfg": [
            {"quantizer_name": "*combine_quantizer", "cfg": {"format": "bf16"}}]})
        assert torch.equal(ours(ids).logits.float(), plain)
        moewire.quantize(ours, {"quant_cfg": [
            {"quantizer_name": "*combine_quantizer", "cfg": {"format": "nvfp4"}}]},
            lambda m: m(ids))
        assert not torch.equal(ours(ids).logits.float(), plain)
    err, err_fp8 = ((m - ref).norm() / ref.norm() for m in (plain, other))
    assert 0 < err < 2 * err_fp8 and err < 0.8


def test_quantize_calibrate_scales_unquantize(checkpoints, moewire_registered, tmp_path):
    import transformers as tf

    mt = moewire_registered
    path = checkpoints("qwen3_moe")
    ids = torch.randint(0, _tiny.VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))

    def load():
        return mt.prepare(tf.AutoModelForCausalLM.from_pretrained(
            path, experts_implementation="moewire"))

    model = load()
    with torch.no_grad():
        wire_bf16 = model(ids).logits
    moewire.quantize(model, "moe_fp8_dispatch_nvfp4_combine", lambda m: m(ids))
    names = [n for n, *_ in moewire.megamoe.api.quantizers(model)]
    assert names[:2] == ["model.layers.0.mlp.experts.dispatch_quantizer",
                         "model.layers.0.mlp.experts.combine_quantizer"]
    with torch.no_grad():
        quantized = model(ids).logits
    assert not torch.equal(quantized, wire_bf16)
    scales = moewire.save_scales(model, tmp_path / "scales.json")

    other = load()
    moewire.quantize(other, "moe_fp8_dispatch_nvfp4_combine")
    moewire.load_scales(other, scales)
    with torch.no_grad():
        assert torch.equal(other(ids).logits, quantized)

    moewire.unquantize(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, wire_bf16)


def test_serving_scales_carry_the_engines_names(checkpoints, moewire_registered, tmp_path):
    import json

    import transformers as tf

    mt = moewire_registered
    model = mt.prepare(tf.AutoModelForCausalLM.from_pretrained(
        checkpoints("mixtral"), experts_implementation="moewire"))
    ids = torch.randint(0, _tiny.VOCAB, (1, 8))
    moewire.quantize(model, "moe_fp8", lambda m: m(ids))
    path = mt.save_serving_scales(model, tmp_path / "vllm.json", "vllm")
    names = sorted(json.loads(path.read_text())["quantizers"])
    assert names[0] == "model.layers.0.block_sparse_moe.experts.combine_quantizer"
    assert len(names) == 4


@pytest.mark.parametrize(
    ("name", "model_type", "host", "expected"),
    [
        ("model.layers.3.mlp.experts.combine_quantizer", "deepseek_v4", "vllm",
         "model.layers.3.ffn.experts.combine_quantizer"),
        ("model.layers.3.mlp.experts.combine_quantizer", "deepseek_v4", "sglang",
         "model.layers.3.mlp.experts.combine_quantizer"),
        ("model.layers.12.mlp.experts", "deepseek_v3", "sglang", "model.layers.12.mlp.experts"),
        ("model.layers.0.mlp.experts.dispatch_quantizer", "mixtral", "vllm",
         "model.layers.0.block_sparse_moe.experts.dispatch_quantizer"),
        ("model.layers.5.mlp.experts.dispatch_quantizer", "qwen3_moe", "vllm",
         "model.layers.5.mlp.experts.dispatch_quantizer"),
    ],
    ids=["v4-vllm-ffn", "v4-sglang", "v3-sglang-module", "mixtral-vllm", "qwen3-vllm"],
)
def test_serving_name(name, model_type, host, expected, moewire_registered):
    assert moewire_registered.serving_name(name, model_type, host) == expected


def test_vllm_sites_named_by_the_mapping_exist(moewire_registered):
    """Every family's vLLM Mega-MoE experts class is a site entry moewire hooks in vLLM."""
    sites = {(s.module, s.cls_name) for s in SITES}
    named = [a.vllm_site for a in moewire_registered.ARCHITECTURES if a.vllm_site]
    assert named and all(site in sites for site in named)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("model.layers.3.mlp.experts", "deepseek_v3", "trtllm"), "host must be"),
        (("model.layers.3.mlp.experts", "llama", "vllm"), "unknown architecture 'llama'"),
        (("model.layers.3.mlp.gate", "deepseek_v3", "vllm"), "not a transformers experts"),
    ],
    ids=["unknown-host", "unknown-architecture", "not-experts"],
)
def test_serving_name_refusals(args, message, moewire_registered):
    with pytest.raises(ValueError, match=message):
        moewire_registered.serving_name(*args)


def _flagged(flag: str, value):
    cfg, experts = _experts("qwen3_moe")
    setattr(experts, flag, value)
    return experts


def _fp8_weights():
    _, experts = _experts("qwen3_moe")
    experts.gate_up_proj = torch.nn.Parameter(
        experts.gate_up_proj.detach().to(torch.float8_e4m3fn), requires_grad=False)
    return experts


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_fp8_weights, "weights are torch.float8_e4m3fn; moewire quantizes BF16"),
        (lambda: _flagged("has_bias", True), "has_bias=True: the Mega-MoE kernel has no expert"),
        (lambda: _flagged("has_gate", False), "has_gate=False"),
        (lambda: _flagged("has_post_expert_norm", True), "has_post_expert_norm=True"),
        (lambda: _experts("gpt_oss")[1], "gpt-oss's experts have biases"),
    ],
    ids=["fp8-weights", "bias", "no-gate", "post-norm", "gpt-oss"],
)
def test_layouts_the_kernel_cannot_express_are_refused(make, message):
    experts = make()
    x, idx, w = _routing(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=message):
        experts(x, idx, w)


def test_interleaved_transposed_layout_is_read_from_the_flags():
    """is_transposed / is_concatenated=False (gpt-oss's layout) give the same kernel L1/L2
    as the concatenated layout they were made from."""
    from moewire.integrations.transformers.state import _kernel_layout

    _, experts = _experts("qwen3_moe")
    l1, l2 = _kernel_layout(experts)
    gate, up = experts.gate_up_proj.detach().chunk(2, dim=1)
    interleaved = torch.stack([gate, up], dim=2).flatten(1, 2)  # gate0, up0, gate1, ...
    experts.gate_up_proj = torch.nn.Parameter(interleaved.transpose(1, 2).contiguous())
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().transpose(1, 2).contiguous())
    experts.is_transposed, experts.is_concatenated = True, False
    t1, t2 = _kernel_layout(experts)
    assert torch.equal(t1, l1) and torch.equal(t2, l2)


def test_prepare_refuses_a_model_without_moewire_experts(checkpoints, moewire_registered):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(checkpoints("mixtral"),
                                                   experts_implementation="eager")
    with pytest.raises(ValueError, match="no experts module running"):
        moewire_registered.prepare(model)


@pytest.mark.parametrize("kernel", ["stand-in", "deepgemm-sm90"])
def test_tiny_gpt_oss_checkpoint_is_refused_with_the_kernels_reason(kernel, checkpoints,
                                                                    moewire_registered):
    """gpt-oss loads with experts_implementation="moewire" and runs eagerly, but prepare
    refuses it for either kernel, naming the module, what gpt-oss needs and what DeepGEMM's
    Mega-MoE kernels (and vLLM main's caller) lack, with the sources."""
    import transformers as tf

    path = checkpoints("gpt_oss")
    eager = tf.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    with torch.no_grad():
        assert torch.isfinite(eager(torch.arange(8)[None]).logits).all()
    model = tf.AutoModelForCausalLM.from_pretrained(path, experts_implementation="moewire")
    with pytest.raises(ValueError) as info:
        moewire_registered.prepare(model, kernel=kernel)
    message = str(info.value)
    for needle in ("model.layers.0.mlp.experts: gpt-oss's experts have biases",
                   "(up + 1) * gate * sigmoid(alpha * gate)", "GptOssExperts._apply_gate",
                   "take no bias tensors and only activation='swiglu'",
                   "DeepGEMM PR #323, 8ddf7f9, deep_gemm/mega/__init__.py",
                   "vLLM main's DeepGemmMegaExperts", "experts_implementation='eager'"):
        assert needle in message


@pytest.mark.parametrize(
    ("mma_type", "message"),
    [
        ("fp8xfp4", r"model.layers.0.mlp.experts: the fp8xfp4 build cannot take these experts "
                    r"\(.*multiple of 512"),
        ("fp4xfp4", r"model.layers.0.mlp.experts: the fp4xfp4 build cannot take these experts "
                    r"\(.*hidden=128 must be a multiple of 512"),
        ("mxf4xmxf4", r"model.layers.0.mlp.experts: kernel 'stand-in' has the builds "
                      r"\('bf16xbf16', 'fp8xfp4', 'fp4xfp4'\), got mma_type='mxf4xmxf4'"),
    ],
    ids=["fp8xfp4-hidden-128", "fp4xfp4-hidden-128", "unknown-mma"],
)
def test_prepare_refuses_a_build_the_shapes_do_not_fit(mma_type, message, checkpoints,
                                                       moewire_registered):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(checkpoints("qwen3_moe"),
                                                   experts_implementation="moewire")
    with pytest.raises(ValueError, match=message):
        moewire_registered.prepare(model, mma_type)
