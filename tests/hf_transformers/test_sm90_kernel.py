"""``prepare(model, kernel="deepgemm-sm90")``: the transformers experts on DeepGEMM's SM90
``fp8_mega_moe``. On CPU the package is the fork's stand-in (``moewire.reference.sm90_fork``:
the same buffer, weight transform and FP8 128x128 block-scaled kernel, under PR #323's
``fp8_mega_moe`` name); on a Hopper GPU with the package, the real kernel (``real_kernel``)."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("transformers.integrations.moe")

import _tiny  # noqa: E402
import torch  # noqa: E402

import moewire  # noqa: E402
from moewire.integrations import deepgemm_sm90 as sm90  # noqa: E402
from moewire.reference import sm90_fork  # noqa: E402

T = 48


def _package() -> types.ModuleType:
    """The fork's stand-in under PR #323's names: ``fp8_mega_moe`` takes the recipe and the
    activation by keyword and must be given the FP8 128x128 recipe and SwiGLU."""
    calls = []

    def fp8_mega_moe(y, l1, l2, buf, *, recipe, activation, **kwargs):
        calls.append((recipe, activation))
        assert recipe == (128, 128, 128) and activation == "swiglu"
        sm90_fork.fp8_mega_moe_sm90(y, l1, l2, buf, **kwargs)

    pkg = types.ModuleType("deep_gemm_sm90_stand_in")
    pkg.fp8_mega_moe = fp8_mega_moe
    pkg.fp8_fp4_mega_moe = None  # present, as in PR #323 (never called here)
    for name in ("get_symm_buffer_for_sm90_mega_moe", "transform_weights_for_mega_moe_sm90",
                 "utils"):
        setattr(pkg, name, getattr(sm90_fork, name))
    pkg.calls = calls
    return pkg


@pytest.fixture
def stand_in_package(monkeypatch):
    """DeepGEMM's SM90 package replaced by the fork's stand-in, on one rank (group None)."""
    pkg = _package()
    monkeypatch.setattr(sm90, "_import_deep_gemm", lambda: pkg)
    monkeypatch.setattr(sm90, "available", lambda: (True, ""))
    monkeypatch.setattr(sm90, "one_rank_group", lambda: None)
    return pkg


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """The real kernel's tests start a one-rank NCCL world (``sm90.one_rank_group``, directly
    or through ``prepare``); it is destroyed after each, with the buffers cached over it, so
    the real-kernel tier's own ``ep_group`` can start one later in the same process."""
    import torch.distributed as dist

    had = dist.is_initialized()
    yield
    if not had and dist.is_initialized():
        from transformers.integrations.deepgemm import destroy_megamoe_buffers

        destroy_megamoe_buffers()
        dist.destroy_process_group()


def _model(mt, implementation: str = "moewire", hidden: int = 512, intermediate: int = 256):
    import transformers as tf

    cfg = _tiny.config("qwen3_moe", hidden=hidden, intermediate=intermediate, layers=1)
    cfg._experts_implementation = implementation
    with torch.random.fork_rng():
        torch.manual_seed(3)
        model = tf.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
        experts = model.model.layers[0].mlp.experts
        with torch.no_grad():
            experts.gate_up_proj.normal_(0.0, experts.gate_up_proj.shape[-1] ** -0.5)
            experts.down_proj.normal_(0.0, experts.down_proj.shape[-1] ** -0.5)
    return model, experts


def _routing(experts, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden, num_experts = experts.gate_up_proj.shape[-1], experts.gate_up_proj.shape[0]
    x = torch.randn((T, hidden), generator=g).bfloat16()
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:2] for _ in range(T)])
    w = torch.rand((T, 2), generator=g) * 2.5
    return x, idx, w


def _fp8_oracle(experts, x, idx, w):
    """float64 over FP8-dequantized operands: x per 128 columns, each weight per 128x128
    block (``sf = max(amax, 1e-4) / 448``, ml_dtypes' E4M3 rounding), the weighted
    activation cast again per 128; the expert sum exact. The kernel's BF16 rounding points
    (L1's output, the activation before its cast, each row) move it by about 2%, a third of
    the FP8 error (about 6% from the BF16 experts on these data)."""
    import ml_dtypes
    import numpy as np

    def fp8(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
        n, k = a.shape
        blocks = a.reshape(n // rows, rows, k // cols, cols)
        sf = np.maximum(np.abs(blocks).max(axis=(1, 3), keepdims=True), 1e-4) / 448.0
        q = (blocks / sf).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        return (q * sf).reshape(n, k)

    w1 = experts.gate_up_proj.detach().double().numpy()
    w2 = experts.down_proj.detach().double().numpy()
    xs = x.double().numpy()
    xq = np.concatenate([fp8(xs[t : t + 1], 1, 128) for t in range(T)])
    out = np.zeros_like(xs)
    inter = w2.shape[-1]
    for t in range(T):
        for s in range(idx.shape[1]):
            e = int(idx[t, s])
            gate_up = fp8(w1[e], 128, 128) @ xq[t]
            gate, up = gate_up[:inter], gate_up[inter:]
            act = gate / (1 + np.exp(-gate)) * up * float(w[t, s])
            out[t] += fp8(act[None], 1, 128)[0] @ fp8(w2[e], 128, 128).T
    return torch.from_numpy(out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_experts_run_the_fp8_block_scaled_kernel(stand_in_package, moewire_registered):
    """The output is the FP8 x FP8 kernel's (close to the FP8 oracle, farther from the BF16
    experts by the FP8 error), and the kernel got the 128x128 recipe and SwiGLU."""
    mt = moewire_registered
    model, experts = _model(mt)
    x, idx, w = _routing(experts)
    with torch.no_grad():
        eager = _model(mt, "eager")[1](x, idx, w)
        mt.prepare(model, kernel="deepgemm-sm90")
        y = experts(x, idx, w)
    oracle = _fp8_oracle(experts, x, idx, w)
    assert stand_in_package.calls == [((128, 128, 128), "swiglu")]
    assert experts.__dict__["_moewire_mega"].flavour == "deepgemm-sm90"
    assert _rel(y, oracle) < 0.03
    assert _rel(y, eager) > 3 * _rel(y, oracle)


def test_quantize_cycle_on_the_sm90_kernel(stand_in_package, moewire_registered):
    """moewire's quantizers run on the SM90 build (flavour deepgemm-sm90: the combine rows
    re-summed where PR #323 leaves them) and unquantize restores the kernel's output."""
    from moewire.eval import pair_entries

    mt = moewire_registered
    model, experts = _model(mt)
    x, idx, w = _routing(experts)
    with torch.no_grad():
        mt.prepare(model, kernel="deepgemm-sm90")
        plain = experts(x, idx, w)
        recipe = {"quant_cfg": pair_entries("fp8", "nvfp4")}
        moewire.quantize(model, recipe, lambda m: experts(x, idx, w))
        try:
            names = {n for n, _ in model.named_modules() if n.endswith("_quantizer")}
            assert names == {f"model.layers.0.mlp.experts.{k}_quantizer"
                             for k in ("dispatch", "combine")}
            quantized = experts(x, idx, w)
        finally:
            moewire.unquantize(model)
        again = experts(x, idx, w)
    assert torch.equal(again, plain)
    assert 1e-3 < _rel(quantized, plain) < 0.2


def _no_package(monkeypatch):
    monkeypatch.setattr(sm90, "available", lambda: (False, "no CUDA device"))


@pytest.mark.parametrize(
    ("setup", "kwargs", "error", "message"),
    [
        (_no_package, {}, RuntimeError, "cannot run here \\(no CUDA device\\).*kernel='stand-in'"),
        (None, {"mma_type": "bf16xbf16"}, ValueError,
         "kernel 'deepgemm-sm90' has the builds \\('fp8xfp8',\\), got mma_type='bf16xbf16'"),
        (None, {"kernel": "cutlass"}, ValueError, "kernel must be one of"),
        (None, {"hidden": 192}, ValueError, "H=192 and I=256 must be multiples of 128"),
        (None, {"hidden": 256}, ValueError,
         "H must be a multiple of 512 and I of 256; got H=256, I=256"),
    ],
    ids=["no-package", "stand-in-build", "unknown-kernel", "hidden-not-128", "hidden-not-512"],
)
def test_sm90_refusals(setup, kwargs, error, message, stand_in_package, moewire_registered,
                       monkeypatch):
    if setup is not None:
        setup(monkeypatch)
    model, _ = _model(moewire_registered, hidden=kwargs.pop("hidden", 512))
    kwargs.setdefault("kernel", "deepgemm-sm90")
    with pytest.raises(error, match=message):
        moewire_registered.prepare(model, **kwargs)


@pytest.mark.gpu
@pytest.mark.real_kernel
def test_real_sm90_kernel_against_the_fp8_oracle(moewire_registered):
    """On a Hopper GPU with DeepGEMM PR #323's package: the same check on the real kernel."""
    ok, why = sm90.available()
    if not ok:
        pytest.skip(f"real SM90 Mega-MoE kernel unavailable: {why}")
    mt = moewire_registered
    model, experts = _model(mt)
    x, idx, w = _routing(experts)
    oracle = _fp8_oracle(experts, x, idx, w)
    with torch.no_grad():
        eager = _model(mt, "eager")[1](x, idx, w)
    model.cuda()
    with torch.no_grad():
        mt.prepare(model, kernel="deepgemm-sm90")
        y = experts(x.cuda(), idx.cuda(), w.cuda()).cpu()
    to_oracle, to_eager = _rel(y, oracle), _rel(y, eager)
    # The real kernel rounds its L1 output to BF16 and takes a fast-math SiLU before the FP8
    # cast of the activations, which the float64 oracle does not: looser than the stand-in's
    # 3%, still well inside the FP8 error that separates it from the BF16 experts.
    assert to_oracle < 0.05, (to_oracle, to_eager)
    assert to_eager > 1.5 * to_oracle, (to_oracle, to_eager)


def _ep_run_equals_plain_run(mt, device: str) -> None:
    """``"moewire"`` with ``kernel="deepgemm-sm90"``: the model under transformers' EP on a
    one-rank EP group (transformers' ``apply_expert_parallelism``, ``ep_implementation=
    "moewire"``: ``MegaMoeEP``) gives the non-EP model's output bit for bit, unquantized and
    quantized, for the experts and the whole model."""
    import _ep

    from moewire.eval import pair_entries

    ids = torch.arange(5, 21)[None].to(device)
    recipe = {"quant_cfg": pair_entries("fp8", "nvfp4")}
    outputs = []
    for under_ep in (False, True):
        model, experts = _model(mt)
        model.to(device)
        x, idx, w = (t.to(device) for t in _routing(experts))
        group = _ep.apply_ep(model, "moewire", device=device) if under_ep else None
        with torch.no_grad():
            mt.prepare(model, kernel="deepgemm-sm90", group=group)
            plain, logits = experts(x, idx, w), model(ids).logits
            batch = (x, idx, w)
            moewire.quantize(model, recipe, lambda m, e=experts, b=batch: e(*b))
            quantized = experts(x, idx, w)
        outputs.append((plain, logits, quantized))
    for a, b in zip(*outputs, strict=True):
        assert torch.equal(a, b)


def test_ep_on_one_rank_equals_the_plain_run_on_the_stand_in(stand_in_package,
                                                              moewire_registered, one_rank):
    """On CPU with the fork's stand-in of the SM90 package (the real kernel: below)."""
    _ep_run_equals_plain_run(moewire_registered, "cpu")


@pytest.mark.gpu
@pytest.mark.real_kernel
def test_real_sm90_kernel_under_transformers_ep_equals_the_plain_run(moewire_registered):
    """On a Hopper GPU with DeepGEMM PR #323's package: transformers' EP on a one-rank NCCL
    group changes nothing in the real kernel's output, bit for bit."""
    ok, why = sm90.available()
    if not ok:
        pytest.skip(f"real SM90 Mega-MoE kernel unavailable: {why}")
    sm90.one_rank_group()  # the NCCL world of one rank the EP mesh is made over
    _ep_run_equals_plain_run(moewire_registered, "cuda")
