"""The experts wrapper on the stand-in kernel: bit-exactness, dispatch, combine, check."""

from __future__ import annotations

import mm_oracles as oracles
import numpy as np
import pytest
import torch
from mm_helpers import SHAPES, Layer, Model, batch, make_experts, region
from torch import nn

import moewire
from moewire.megamoe import hooks, layout_check, quant_experts
from moewire.megamoe.convert import convert
from moewire.megamoe.layout_check import layout_checked
from moewire.megamoe.registry import ExpertsAdapter, register_experts_class
from moewire.quantizer import WireQuantizer
from moewire.reference import MegaMoEExperts, MegaMoEWeights, deep_gemm, forward_context

T = 20
K_SLOTS = 4


@pytest.fixture(autouse=True)
def fresh_checks():
    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


@pytest.fixture(scope="module")
def fp8_model():
    # fp8xfp4 weights take seconds to build: one layer for the whole module.
    return Model(n=1, mma="fp8xfp4")


def converted(model: nn.Module) -> nn.Module:
    for name, module in model.named_modules():
        if isinstance(module, MegaMoEExperts):
            convert(module, name)
    return model


def experts_of(model, i=0):
    return model.layers[i].experts


def valid_rows_np(buf, t):
    """float32 region rows ``[num_slots, Tmax, H]`` and the staged ids ``[t, k]``."""
    return oracles.to_np(region(buf)), buf.topk_idx[:t].numpy()


# -- bit-identity when disabled ------------------------------------------------------------


@pytest.mark.parametrize(
    "fused,shared,debug",
    [(0, False, False), (0, True, False), (1, False, False), (0, False, True)],
    ids=["plain", "unfused-shared", "fused-shared", "debug-zeroing"],
)
def test_disabled_quantizers_are_bit_identical(fused, shared, debug, monkeypatch):
    if debug:
        monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", "1")
    model = Model(n=2, fused=fused, shared=shared)
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=3)
    before = [y.clone() for y in model(x, w, ids)]
    keys = set(model.state_dict())
    converted(model)
    after = model(x, w, ids)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(oracles.torch_bits(a), oracles.torch_bits(b))
    experts = experts_of(model)
    assert type(experts).__name__ == "QuantMegaMoEExperts"
    assert isinstance(experts, MegaMoEExperts)
    assert keys <= set(model.state_dict())
    assert experts.dispatch_quantizer.mode == "disabled"
    assert experts.combine_quantizer.mode == "disabled"


def test_convert_is_idempotent_and_keeps_names():
    model = converted(Model(n=1))
    experts = experts_of(model)
    assert convert(experts) is experts
    assert type(experts).__mro__[1] is quant_experts.QuantExperts
    assert [n for n, _ in model.named_modules()][:3] == ["", "layers", "layers.0"]
    assert experts._moewire_name == "layers.0.experts"


# -- combine ---------------------------------------------------------------------------------

FORMATS = [
    ("nvfp4", 0.75, oracles.nvfp4),
    ("fp8", 0.75, oracles.fp8_tensor),
    ("mxfp8", None, lambda r, _a: oracles.mxfp8(r)),
]


@pytest.mark.parametrize("fmt,amax,oracle", FORMATS, ids=[f[0] for f in FORMATS])
@pytest.mark.parametrize("fused", [0, 1], ids=["routed", "fused-shared"])
def test_combine_equals_oracle_resum(fmt, amax, oracle, fused):
    model = converted(Model(n=1, fused=fused))
    experts = experts_of(model)
    experts.combine_quantizer = WireQuantizer(fmt, constant_amax=amax)
    buf = experts.get_symm_buffer()
    region(buf).fill_(float("nan"))  # stale rows of invalid slots must never leak
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=5, scale=4.0)
    kernel_y = {}
    real = deep_gemm.bf16_mega_moe

    def recording(y, *args, **kwargs):
        kernel_y["ptr"] = y.data_ptr()
        return real(y, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deep_gemm, "bf16_mega_moe", recording)
        y = experts(x, w, ids)
    assert y.data_ptr() == kernel_y["ptr"]  # written in place
    rows, topk = valid_rows_np(buf, T)
    shared = "first" if fused else None  # the default stand-in build, vllm-0.33
    want = oracles.resum(rows, topk, T, shared, quant=lambda r: oracle(r[None], amax)[0])
    np.testing.assert_array_equal(oracles.torch_bits(y), want)
    plain = oracles.resum(rows, topk, T, shared)
    assert (plain != want).any()  # the quantization did something


def test_combine_fp8xfp4_nvfp4(fp8_model):
    experts = converted(fp8_model).layers[0].experts
    experts.combine_quantizer = WireQuantizer("nvfp4", constant_amax=0.5)
    try:
        x, w, ids = batch(T, SHAPES["fp8xfp4"][0], seed=6, scale=3.0)
        y = experts(x, w, ids)
        rows, topk = valid_rows_np(experts.get_symm_buffer(), T)
        want = oracles.resum(rows, topk, T, quant=lambda r: oracles.nvfp4(r[None], 0.5)[0])
        np.testing.assert_array_equal(oracles.torch_bits(y), want)
    finally:
        experts.combine_quantizer = WireQuantizer(enable=False)


def test_combine_runs_before_the_unfused_shared_expert():
    class Constant(nn.Module):
        def forward(self, x):
            return torch.full_like(x, 0.5)

    model = converted(Model(n=1))
    model.layers[0].shared = Constant()
    experts = experts_of(model)
    experts.combine_quantizer = WireQuantizer("mxfp8")
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=7)
    y = model(x, w, ids)[0]
    rows, topk = valid_rows_np(experts.get_symm_buffer(), T)
    resummed = oracles.resum(rows, topk, T, quant=lambda r: oracles.mxfp8(r[None])[0])
    want = oracles.bf16_bits((resummed.astype(np.uint32) << 16).view(np.float32) + np.float32(0.5))
    np.testing.assert_array_equal(oracles.torch_bits(y), want)


# -- dispatch --------------------------------------------------------------------------------


def test_dispatch_payload_is_the_staging_of_quantized_tokens(fp8_model):
    experts = converted(fp8_model).layers[0].experts
    experts.dispatch_quantizer = WireQuantizer("fp8", constant_amax=6.0)
    try:
        x, w, ids = batch(T, SHAPES["fp8xfp4"][0], seed=8, scale=2.0)
        original = x.clone()
        experts(x, w, ids)
        np.testing.assert_array_equal(oracles.torch_bits(x), oracles.torch_bits(original))
        xq = torch.from_numpy(oracles.fp8_tensor(oracles.to_np(x), 6.0)).bfloat16()
        q, sf = deep_gemm.per_token_cast_to_fp8(
            xq, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True
        )
        buf = experts.get_symm_buffer()
        assert torch.equal(buf.x[:T].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(buf.x_sf[:T], sf)
        q0, _ = deep_gemm.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
        assert not torch.equal(q0.view(torch.uint8), q.view(torch.uint8))
    finally:
        experts.dispatch_quantizer = WireQuantizer(enable=False)


def test_unfused_shared_expert_and_caller_see_unquantized_tokens():
    class Recorder(nn.Module):
        def forward(self, x):
            self.seen = x.clone()
            return torch.zeros_like(x)

    model = converted(Model(n=1))
    recorder = Recorder()
    model.layers[0].shared = recorder
    experts = experts_of(model)
    experts.dispatch_quantizer = WireQuantizer("mxfp8")
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=9)
    model(x, w, ids)
    np.testing.assert_array_equal(oracles.torch_bits(recorder.seen), oracles.torch_bits(x))
    staged = experts.get_symm_buffer().x[:T]
    want = oracles.bf16_bits(oracles.mxfp8(oracles.to_np(x)))
    np.testing.assert_array_equal(oracles.torch_bits(staged), want)


# -- the layout check ----------------------------------------------------------------------------


def combine_on(model):
    experts = experts_of(model)
    experts.combine_quantizer = WireQuantizer("mxfp8")
    return experts


def test_check_raises_on_a_wrong_flavour():
    # A vllm-0.33 bf16 buffer (a combine_norm_buffer follows the combine region) read as
    # vllm-0.32's build (region at the tail): the rows are the wrong bytes.
    model = converted(Model(n=1))
    experts = combine_on(model)
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=10)
    with deep_gemm.use_flavour("vllm-0.32"), pytest.raises(
        RuntimeError, match=r"layers\.0\.experts: .*layout check failed.*'vllm-0.32'"
    ):
        experts(x, w, ids)


def test_check_raises_under_debug_zeroing(monkeypatch):
    monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", "1")
    experts = combine_on(converted(Model(n=1)))
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=12)
    with pytest.raises(RuntimeError, match="DG_COMM_KERNEL_DEBUG=1 is set"):
        experts(x, w, ids)


def test_check_raises_on_a_corrupted_row(monkeypatch):
    experts = combine_on(converted(Model(n=1)))
    real = deep_gemm.bf16_mega_moe

    def corrupting(y, l1, l2, buf, **kwargs):
        real(y, l1, l2, buf, **kwargs)
        t, s = torch.nonzero(buf.topk_idx[: y.shape[0]] >= 0)[0].tolist()
        region(buf)[s, t, 3] += 1.0

    monkeypatch.setattr(deep_gemm, "bf16_mega_moe", corrupting)
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=13)
    with pytest.raises(RuntimeError, match=r"\(1 of \d+ compared tokens differ\)"):
        experts(x, w, ids)


def test_check_waits_through_an_all_padding_warm_up(monkeypatch):
    monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", "1")
    experts = combine_on(converted(Model(n=1)))
    buf = experts.get_symm_buffer()
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=14)
    for _ in range(2):
        with forward_context(is_padding=torch.ones(T, dtype=torch.bool)):
            experts(x, w, ids)
        experts(x[:0], w[:0], ids[:0])
    assert not layout_checked(buf)
    with pytest.raises(RuntimeError, match="layout check failed"):
        experts(x, w, ids)
    monkeypatch.delenv("DG_COMM_KERNEL_DEBUG")
    experts(x, w, ids)
    assert layout_checked(buf)


WATCHED = ("item", "tolist", "__bool__")


def test_check_runs_once_per_buffer_and_no_host_sync_after(monkeypatch):
    """After the check, moewire's code reads no tensor value into Python (item, tolist,
    bool). On CPU a format may still read a CPU amax (no device involved); the GPU test
    covers every sync with torch.cuda.set_sync_debug_mode."""
    model = converted(Model(n=2))
    for i in range(2):
        experts_of(model, i).combine_quantizer = WireQuantizer("nvfp4", constant_amax=1.0)
        experts_of(model, i).dispatch_quantizer = WireQuantizer("fp8", constant_amax=4.0)
    assert experts_of(model, 0).get_symm_buffer() is experts_of(model, 1).get_symm_buffer()
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=15)
    experts_of(model, 0)(x, w, ids)
    assert layout_checked(experts_of(model, 0).get_symm_buffer())

    calls = []
    real = deep_gemm.bf16_mega_moe

    def no_sync_kernel(*args, **kwargs):
        # The stand-in kernel itself syncs (nonzero, tolist); only moewire's code is watched.
        with monkeypatch.context() as inner:
            for attr in WATCHED:
                inner.setattr(torch.Tensor, attr, getattr(torch.Tensor, "_moewire_saved_" + attr))
            return real(*args, **kwargs)

    def refuse(name):
        def method(self, *a, **k):
            calls.append(name)
            raise AssertionError(f"host sync through Tensor.{name} after the layout check")

        return method

    for attr in WATCHED:
        monkeypatch.setattr(
            torch.Tensor, "_moewire_saved_" + attr, getattr(torch.Tensor, attr), raising=False
        )
        monkeypatch.setattr(torch.Tensor, attr, refuse(attr))
    monkeypatch.setattr(deep_gemm, "bf16_mega_moe", no_sync_kernel)
    with forward_context(is_padding=None):
        for i in range(2):
            experts_of(model, i)(x, w, ids)
    assert calls == []


# -- refusals --------------------------------------------------------------------------------


class _Unregistered(nn.Module):
    pass


class _BadGlobals(MegaMoEExperts):
    pass


class _NoSharedFlavour(MegaMoEExperts):
    pass


def _adapter(name, **changes):
    base = dict(
        name=name,
        forward_module="moewire.reference.experts",
        stage_fn="stage_mega_moe_inputs",
        stage_hidden_arg=0,
        kernel_ns="deep_gemm",
        get_symm_buffer=lambda m: m.get_symm_buffer(),
        flavour=lambda m: "vllm-0.33",
        fused_shared=lambda m: m.fused_shared,
        ep_group=lambda m: None,
    )
    base.update(changes)
    return ExpertsAdapter(**base)


register_experts_class(_BadGlobals, _adapter("bad-globals", stage_fn="no_such_function"))
register_experts_class(
    _NoSharedFlavour, _adapter("main-flavour", flavour=lambda m: "deepgemm-main")
)


def _run(experts):
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=16)
    return experts(x, w, ids)


def _combine_dynamic(fmt):
    def case():
        experts = converted(Model(n=1)).layers[0].experts
        experts.combine_quantizer = WireQuantizer(fmt)
        _run(experts)

    return case


def _unregistered():
    convert(_Unregistered())


def _bad_globals():
    h, i = SHAPES["bf16xbf16"]
    convert(_BadGlobals(8, 4, h, i, 24, mma_type="bf16xbf16", device="cpu"))


def _main_flavour_with_shared():
    h, i = SHAPES["bf16xbf16"]
    experts = convert(
        _NoSharedFlavour(
            8, 4, h, i, 24, mma_type="bf16xbf16", device="cpu", num_fused_shared_experts=1
        )
    )
    experts.combine_quantizer = WireQuantizer("mxfp8")
    _run(experts)


@pytest.mark.parametrize(
    "case,exc,match",
    [
        (
            _combine_dynamic("nvfp4"),
            RuntimeError,
            r"layers\.0\.experts: the combine quantizer needs a calibrated or constant amax \(each "
            r"rank re-quantizes rows from all expert ranks.*run calibration or set constant_amax",
        ),
        (_combine_dynamic("fp8"), RuntimeError, "needs a calibrated or constant amax"),
        (_unregistered, TypeError, "not a registered Mega-MoE experts class"),
        (_bad_globals, RuntimeError, "has no global 'no_such_function'"),
        (_main_flavour_with_shared, ValueError, "'deepgemm-main', bf16_mega_moe: this kernel"),
    ],
    ids=[
        "combine-dynamic-nvfp4",
        "combine-dynamic-fp8",
        "unregistered-class",
        "adapter-missing-global",
        "flavour-without-shared-slot",
    ],
)
def test_refusals(case, exc, match):
    with pytest.raises(exc, match=match):
        case()


def test_row_local_combine_needs_no_amax():
    experts = converted(Model(n=1)).layers[0].experts
    experts.combine_quantizer = WireQuantizer("mxfp8")
    assert experts.combine_quantizer.is_static_scale()
    _run(experts)


def test_passthrough_outside_quantized_forward():
    from moewire.reference import experts as experts_module

    converted(Model(n=1))
    assert isinstance(experts_module.stage_mega_moe_inputs, hooks._StagingProxy)
    plain = make_experts(seed=4)
    layer = Layer(plain)
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=17)
    y = layer(x, w, ids)
    rows, topk = valid_rows_np(plain.get_symm_buffer(), T)
    np.testing.assert_array_equal(oracles.torch_bits(y), oracles.resum(rows, topk, T))


def test_combine_calibration_excludes_the_fused_shared_slot():
    experts = experts_of(converted(Model(n=1, fused=1)))
    quantizer = WireQuantizer("nvfp4")
    experts.combine_quantizer = quantizer
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=18, scale=4.0)
    with quantizer.calibrating():
        experts(x, w, ids)
    rows, topk = valid_rows_np(experts.get_symm_buffer(), T)
    routed = max(
        float(np.abs(rows[s, t]).max()) for s in range(K_SLOTS) for t in range(T) if topk[t, s] >= 0
    )
    shared = float(np.abs(rows[K_SLOTS, :T]).max())
    assert shared > routed  # so that including the shared slot would show
    assert float(quantizer.static_amax) == routed


class _KeywordStaging(MegaMoEExperts):
    pass


register_experts_class(
    _KeywordStaging, _adapter("keyword-staging", stage_hidden_arg="hidden_states")
)


def test_stage_hidden_arg_by_keyword_name():
    h, i = SHAPES["bf16xbf16"]
    experts = convert(_KeywordStaging(8, 4, h, i, 24, mma_type="bf16xbf16", device="cpu"))
    experts.dispatch_quantizer = WireQuantizer("mxfp8")
    x, w, ids = batch(T, h, seed=19)
    experts(x, w, ids)
    staged = experts.get_symm_buffer().x[:T]
    want = oracles.bf16_bits(oracles.mxfp8(oracles.to_np(x)))
    np.testing.assert_array_equal(oracles.torch_bits(staged), want)


def _corrupting_kernel(real):
    def kernel(y, l1, l2, buf, **kwargs):
        real(y, l1, l2, buf, **kwargs)
        t, s = torch.nonzero(buf.topk_idx[: y.shape[0]] >= 0)[0].tolist()
        region(buf)[s, t, 3] += 1.0

    return kernel


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "corrupted"])
def test_capture_branch_records_an_assert_instead_of_syncing(corrupt, monkeypatch):
    # The branch taken under CUDA-graph capture, exercised on CPU: there
    # torch._assert_async raises at once, where on CUDA it fails the replay.
    monkeypatch.setattr(layout_check, "_capturing", lambda t: True)
    experts = combine_on(converted(Model(n=1)))
    if corrupt:
        monkeypatch.setattr(deep_gemm, "bf16_mega_moe", _corrupting_kernel(deep_gemm.bf16_mega_moe))
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=20)
    with pytest.warns(UserWarning, match="runs inside the CUDA graph being captured"):
        if corrupt:
            with pytest.raises(RuntimeError, match=r"layers\.0\.experts: the Mega-MoE layout"):
                experts(x, w, ids)
        else:
            experts(x, w, ids)
    assert not layout_checked(experts.get_symm_buffer())  # eager still checks later


# -- fail closed: a forward that bypasses a hook ---------------------------------------------


class _InlineStaging(MegaMoEExperts):
    """Stages inline with a plain copy (no staging call, no DeepGEMM cast), kernel through
    the namespace."""

    def forward(self, hidden_states, topk_weights, topk_ids, shared_experts=None):
        from moewire.reference import experts as experts_module

        buf, t = self.get_symm_buffer(), hidden_states.shape[0]
        buf.x[:t].copy_(hidden_states)
        buf.topk_idx[:t].copy_(topk_ids)
        buf.topk_weights[:t].copy_(topk_weights)
        y = torch.empty((t, self.hidden), dtype=torch.bfloat16)
        kernel = getattr(experts_module.deep_gemm, self.kernel_name)
        kernel(y, self.l1_weights, self.l2_weights, buf)
        return y


class _BoundKernel(MegaMoEExperts):
    """Stages through the hooked global, but calls a kernel function bound before moewire
    hooked anything (``from deep_gemm import bf16_mega_moe``)."""

    _kernel = staticmethod(deep_gemm.bf16_mega_moe)

    def forward(self, hidden_states, topk_weights, topk_ids, shared_experts=None):
        from moewire.reference import experts as experts_module

        buf, t = self.get_symm_buffer(), hidden_states.shape[0]
        experts_module.stage_mega_moe_inputs(hidden_states, topk_ids, topk_weights, buf)
        y = torch.empty((t, self.hidden), dtype=torch.bfloat16)
        self._kernel(y, self.l1_weights, self.l2_weights, buf)
        return y


def _bypassing(cls, which):
    h, i = SHAPES["bf16xbf16"]
    experts = convert(cls(8, 4, h, i, 24, mma_type="bf16xbf16", device="cpu"), "layers.7.experts")
    if which == "dispatch":
        experts.dispatch_quantizer = WireQuantizer("mxfp8")
    else:
        experts.combine_quantizer = WireQuantizer("mxfp8")
    return experts


@pytest.mark.parametrize(
    "cls,which,hook",
    [(_InlineStaging, "dispatch", "staging"), (_BoundKernel, "combine", "kernel")],
    ids=["inline-staging-dispatch", "bound-kernel-combine"],
)
def test_a_forward_that_bypasses_a_hook_raises(cls, which, hook):
    experts = _bypassing(cls, which)
    with pytest.raises(
        RuntimeError,
        match=rf"layers\.7\.experts: the forward of {cls.__name__} \(moewire's stand-in "
        rf"experts\) finished without reaching moewire's {hook} hook .*{which}_quantizer did "
        "not run",
    ):
        _run(experts)


@pytest.mark.parametrize(
    "cls,which",
    [(_InlineStaging, "combine"), (_BoundKernel, "dispatch")],
    ids=["inline-staging-combine", "bound-kernel-dispatch"],
)
def test_the_hook_a_quantizer_needs_is_the_one_checked(cls, which):
    # Inline staging with only a combine quantizer, or a bound kernel with only a dispatch
    # quantizer: the hook each enabled quantizer acts in was reached, so nothing is refused.
    _run(_bypassing(cls, which))


def test_calibration_fails_closed_too():
    experts = _bypassing(_BoundKernel, "combine")
    experts.combine_quantizer = WireQuantizer("nvfp4")
    with experts.combine_quantizer.calibrating(), pytest.raises(RuntimeError, match="kernel hook"):
        _run(experts)


# -- the blind spot: which stored row is the shared one ----------------------------------------


def _shared_stored_first(real):
    """A kernel build that stores the fused shared row at slot 0 (routed slot s at s + 1)
    and sums it first: the old ``sgl`` picture. With every slot valid, reading it as a
    build that stores the shared row at k adds the same rows and matches ``y``."""

    def kernel(y, l1, l2, buf, **kwargs):
        real(y, l1, l2, buf, **kwargs)
        rows = region(buf)
        rows.copy_(torch.cat([rows[-1:], rows[:-1]]))

    return kernel


def test_all_valid_batches_do_not_prove_which_row_is_shared(monkeypatch):
    # The wrong storage slot passes the sum check when every
    # slot is valid and no token is padding, so such batches must not mark the buffer.
    experts = combine_on(converted(Model(n=1, fused=1)))
    monkeypatch.setattr(deep_gemm, "bf16_mega_moe", _shared_stored_first(deep_gemm.bf16_mega_moe))
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=30, masked=0.0)
    for _ in range(2):
        experts(x, w, ids)  # the sums match: no error, yet nothing proven
        assert not layout_checked(experts.get_symm_buffer())
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=32, masked=0.0)
    ids[5, 2] = -1  # a token with an invalid slot tells the readings apart
    with pytest.raises(RuntimeError, match="layout check failed"):
        experts(x, w, ids)


def test_a_padding_token_proves_the_shared_row(monkeypatch):
    model = converted(Model(n=1, fused=1))
    assert "layout proof open" not in moewire.summary(model)  # no batch yet
    experts = combine_on(model)
    buf = experts.get_symm_buffer()
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=31, masked=0.0)
    experts(x, w, ids)
    assert not layout_checked(buf)  # every slot valid: the right reading is not proven yet
    pad = torch.zeros(T, dtype=torch.bool)
    pad[3] = True  # a padding token gets the shared row only
    with forward_context(is_padding=pad):
        experts(x, w, ids)
    # Every other slot is ruled out; rows this ordinary cannot show first from last.
    assert layout_check.unproven_readings(buf) == ("shared row added last",)
    assert ("layers.0.experts: layout proof open (each eager batch is checked until its rows "
            "tell these apart): shared row added last") in moewire.summary(model)
    monkeypatch.setattr(deep_gemm, "bf16_mega_moe", _shared_stored_first(deep_gemm.bf16_mega_moe))
    layout_check.reset_layout_checks()
    with forward_context(is_padding=pad), pytest.raises(RuntimeError, match="layout check"):
        experts(x, w, ids)


def _shared_summed_last(real):
    """Token 0 gets rows whose FP32 sum order survives the BF16 rounding (routed 2^16, 1,
    1, 0 and the shared row 2^24 at slot k), and ``y`` as a build adding it last."""

    def kernel(y, l1, l2, buf, **kwargs):
        real(y, l1, l2, buf, **kwargs)
        rows = region(buf)
        rows[:, 0, 0] = torch.tensor([2.0**16, 1.0, 1.0, 0.0, 2.0**24], dtype=torch.bfloat16)
        y[0, 0] = 2.0**24 + 2.0**17  # shared first would give 2^24

    return kernel


@pytest.mark.parametrize(
    "flavour,raises", [("vllm-0.32", False), ("vllm-0.33", True)], ids=["last", "first"]
)
def test_check_sees_where_the_shared_row_is_added(flavour, raises, monkeypatch):
    with deep_gemm.use_flavour(flavour):
        experts = combine_on(converted(Model(n=1, fused=1)))
        monkeypatch.setattr(
            deep_gemm, "bf16_mega_moe", _shared_summed_last(deep_gemm.bf16_mega_moe)
        )
        x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=33)
        ids[0] = torch.arange(4)
        if raises:
            with pytest.raises(RuntimeError, match=r"added first\) does not reproduce"):
                experts(x, w, ids)
        else:
            experts(x, w, ids)


def test_a_weighted_layout_on_a_kernel_with_weighted_rows_fails_the_layout_check(monkeypatch):
    # A flavour that says the combine multiplies unweighted rows by the router weights (the
    # NVFP4 kernel's) on a kernel whose rows are already weighted: the FMA re-sum weights
    # them twice, and the layout check must catch it before anything is quantized.
    from moewire.megamoe import flavours

    weighted = flavours.Flavour(
        "test-weighted", {"bf16_mega_moe": flavours.KernelLayout("last_region", None, True)}
    )
    monkeypatch.setitem(flavours._REGISTRY, weighted.name, weighted)
    experts = combine_on(converted(Model(n=1)))
    monkeypatch.setenv(flavours.ENV_FLAVOUR, "test-weighted")  # the reference adapter detects
    x, w, ids = batch(T, SHAPES["bf16xbf16"][0], seed=34)
    with pytest.raises(RuntimeError, match="layout check failed"):
        experts(x, w, ids)


class _LocalImport(MegaMoEExperts):
    """Imports DeepGEMM inside the forward (vLLM main's ``DeepGemmMegaExperts`` shape): no
    module global of the forward is involved in the kernel call."""

    def forward(self, hidden_states, topk_weights, topk_ids, shared_experts=None):
        import importlib

        from moewire.reference import experts as experts_module

        dg = importlib.import_module("moewire.reference.deep_gemm")
        buf, t = self.get_symm_buffer(), hidden_states.shape[0]
        experts_module.stage_mega_moe_inputs(hidden_states, topk_ids, topk_weights, buf)
        y = torch.empty((t, self.hidden), dtype=torch.bfloat16)
        dg.bf16_mega_moe(y, self.l1_weights, self.l2_weights, buf)
        return y


def test_a_local_deep_gemm_import_is_hooked_on_the_module_object():
    experts = _bypassing(_LocalImport, "combine")
    assert isinstance(deep_gemm, hooks._HookedModule)
    y = _run(experts)
    rows, topk = valid_rows_np(experts.get_symm_buffer(), T)
    want = oracles.resum(rows, topk, T, quant=lambda r: oracles.mxfp8(r[None])[0])
    np.testing.assert_array_equal(oracles.torch_bits(y), want)
    assert (oracles.resum(rows, topk, T) != want).any()  # the combine did quantize


# -- inline staging through DeepGEMM's own cast (vLLM main's DeepGemmMegaExperts) ----------


class _DeepGemmMegaExpertsShape(MegaMoEExperts):
    """Shaped like vLLM main's ``DeepGemmMegaExperts.apply``: the deep_gemm module
    looked up inside the forward, tokens cast with ``deep_gemm.utils.per_token_cast_to_fp8``
    and copied into ``buf.x[:T]``, the kernel called through the module.

    ``via``: ``"utils"`` or ``"top"`` (the top-level re-export) for the staging cast;
    ``extra``: ``"before"`` casts ``hidden_states`` a second time before the kernel,
    ``"after"`` casts ``y`` after it; ``bound_kernel`` calls a kernel bound at import.
    """

    via, extra, bound_kernel = "utils", None, False
    _bound = staticmethod(deep_gemm.fp8_fp4_mega_moe)

    def forward(self, hidden_states, topk_weights, topk_ids, shared_experts=None):
        from moewire.reference import deep_gemm as dg

        cast = dg.utils.per_token_cast_to_fp8 if self.via == "utils" else dg.per_token_cast_to_fp8
        buf, t = self.get_symm_buffer(), hidden_states.shape[0]
        q, sf = cast(hidden_states, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
        if self.extra == "before":
            dg.per_token_cast_to_fp8(hidden_states, use_ue8m0=True)
        buf.x[:t].copy_(q)
        buf.x_sf[:t].copy_(sf)
        buf.topk_idx[:t].copy_(topk_ids)
        buf.topk_weights[:t].copy_(topk_weights)
        y = torch.empty((t, self.hidden), dtype=torch.bfloat16)
        kernel = self._bound if self.bound_kernel else dg.fp8_fp4_mega_moe
        kernel(y, self.l1_weights, self.l2_weights, buf)
        if self.extra == "after":
            dg.utils.per_token_cast_to_fp8(y, use_ue8m0=True)
        return y


def _main_shaped(reference, **attrs):
    """A converted ``_DeepGemmMegaExpertsShape`` on ``reference``'s weights (and buffer)."""
    weights = MegaMoEWeights(
        reference.local_experts, "fp8xfp4",
        (reference.w13_weight, reference.w13_weight_scale),
        (reference.w2_weight, reference.w2_weight_scale), None, None,
    )
    h, i = SHAPES["fp8xfp4"]
    experts = _DeepGemmMegaExpertsShape(
        8, K_SLOTS, h, i, 24, mma_type="fp8xfp4", weights=weights, device="cpu"
    )
    experts.__dict__.update(attrs)
    return convert(experts, "layers.9.experts")


@pytest.mark.parametrize("via", ["utils", "top"])
@pytest.mark.parametrize("fmt,amax", [("fp8", 6.0), ("mxfp8", None)])
def test_inline_staging_through_deepgemms_cast_is_quantized(fp8_model, via, fmt, amax):
    # Bit for bit what the staging hook gives with the same quantizer: staged x and its
    # scales, and the kernel's y; the caller's tensor is unchanged.
    reference = converted(fp8_model).layers[0].experts
    main = _main_shaped(reference, via=via)
    x, w, ids = batch(T, SHAPES["fp8xfp4"][0], seed=40, scale=2.0)
    original = x.clone()
    got = {}
    try:
        for name, experts in (("staging", reference), ("cast", main), ("plain", main)):
            if name != "plain":
                experts.dispatch_quantizer = WireQuantizer(fmt, constant_amax=amax)
            else:
                experts.dispatch_quantizer = WireQuantizer(enable=False)
            y = experts(x, w, ids)
            buf = experts.get_symm_buffer()
            staged = buf.x[:T].view(torch.uint8).clone(), buf.x_sf[:T].clone()
            got[name] = (y.view(torch.int16), *staged)
    finally:
        reference.dispatch_quantizer = WireQuantizer(enable=False)
    np.testing.assert_array_equal(oracles.torch_bits(x), oracles.torch_bits(original))
    for want, have in zip(got["staging"], got["cast"], strict=True):
        assert torch.equal(want, have)
    assert not torch.equal(got["plain"][1], got["cast"][1])  # the dispatch did quantize
    assert not torch.equal(got["plain"][0], got["cast"][0])


def test_inline_cast_staging_calibrates_on_staged_tokens_only(fp8_model):
    # The ids are staged after the cast: the amax must still leave out the token with no
    # valid slot (collected at the kernel call), as calibrating through the staging hook.
    reference = converted(fp8_model).layers[0].experts
    main = _main_shaped(reference)
    x, w, ids = batch(T, SHAPES["fp8xfp4"][0], seed=41)
    x[3] *= 50  # the largest token, and it reaches no expert
    ids[3] = -1
    amaxes = []
    try:
        for experts in (reference, main):
            experts.dispatch_quantizer = WireQuantizer("fp8")
            with experts.dispatch_quantizer.calibrating():
                experts(x, w, ids)
            amaxes.append(float(experts.dispatch_quantizer.static_amax))
    finally:
        reference.dispatch_quantizer = WireQuantizer(enable=False)
    assert amaxes[0] == amaxes[1] == float(torch.cat([x[:3], x[4:]]).abs().max())


@pytest.mark.parametrize(
    "attrs,calibrate,match",
    [
        ({"extra": "before"}, False, r"after the tokens were staged already"),
        ({"extra": "after"}, False, r"\[20, 512\] tensor .* after the Mega-MoE kernel call"),
        ({"extra": "after"}, True, r"after the Mega-MoE kernel call"),
        ({"bound_kernel": True}, True, r"no hooked Mega-MoE kernel call followed"),
    ],
    ids=["second-cast", "cast-after-kernel", "cast-after-kernel-calibrating", "calib-no-kernel"],
)
def test_inline_cast_staging_refusals(fp8_model, attrs, calibrate, match):
    main = _main_shaped(converted(fp8_model).layers[0].experts, **attrs)
    main.dispatch_quantizer = WireQuantizer("fp8", constant_amax=None if calibrate else 6.0)
    x, w, ids = batch(T, SHAPES["fp8xfp4"][0], seed=42)
    with pytest.raises(RuntimeError, match=rf"layers\.9\.experts: .*{match}"):
        if calibrate:
            with main.dispatch_quantizer.calibrating():
                main(x, w, ids)
        else:
            main(x, w, ids)


def test_inline_cast_staging_with_a_fused_shared_expert_is_refused():
    # The kernel reads the same staged tokens for the fused shared expert, and a forward
    # that stages inline gives moewire no staging function to call again for the shared
    # expert's own launch on the original tokens: refused, reached through the cast.
    h, i = SHAPES["fp8xfp4"]
    experts = _DeepGemmMegaExpertsShape(
        8, K_SLOTS, h, i, 24, mma_type="fp8xfp4", num_fused_shared_experts=1, device="cpu"
    )
    convert(experts, "layers.9.experts")
    experts.dispatch_quantizer = WireQuantizer("mxfp8")
    x, w, ids = batch(T, h, seed=43)
    with pytest.raises(
        RuntimeError, match=r"layers\.9\.experts: the dispatch quantizer is enabled but a shared "
        r"expert is fused.*this forward stages with per_token_cast_to_fp8.*"
        r"VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION=1"
    ):
        experts(x, w, ids)


def test_a_cast_inside_the_staging_call_is_not_a_second_staging(fp8_model, monkeypatch):
    # A staging function that casts through the module (the SM90 staging does) got the
    # quantized tokens already: its cast passes through, quantized once.
    from moewire.reference import experts as experts_module

    def staging_through_the_module(hidden_states, topk_ids, topk_weights, buf, is_padding=None):
        t = hidden_states.shape[0]
        q, sf = deep_gemm.utils.per_token_cast_to_fp8(hidden_states, True, 32, True)
        buf.x[:t].copy_(q)
        buf.x_sf[:t].copy_(sf)
        buf.topk_idx[:t].copy_(topk_ids)
        buf.topk_weights[:t].copy_(topk_weights)

    experts = converted(fp8_model).layers[0].experts
    proxy = experts_module.stage_mega_moe_inputs
    monkeypatch.setattr(proxy, "_moewire_original", staging_through_the_module)
    experts.dispatch_quantizer = WireQuantizer("fp8", constant_amax=6.0)
    try:
        x, w, ids = batch(T, SHAPES["fp8xfp4"][0], seed=44, scale=2.0)
        experts(x, w, ids)
    finally:
        experts.dispatch_quantizer = WireQuantizer(enable=False)
    xq = torch.from_numpy(oracles.fp8_tensor(oracles.to_np(x), 6.0)).bfloat16()
    q, _ = deep_gemm.per_token_cast_to_fp8(xq, True, 32, True)
    assert torch.equal(experts.get_symm_buffer().x[:T].view(torch.uint8), q.view(torch.uint8))


def test_deepgemms_cast_passes_through_outside_a_quantized_forward(fp8_model):
    converted(fp8_model)
    assert isinstance(deep_gemm.utils, hooks._HookedModule)
    assert deep_gemm.utils.per_token_cast_to_fp8 is deep_gemm.per_token_cast_to_fp8
    x = batch(T, SHAPES["fp8xfp4"][0], seed=45)[0]
    q, sf = deep_gemm.utils.per_token_cast_to_fp8(x, True, 32, True)
    want = deep_gemm.utils.__dict__["per_token_cast_to_fp8"](x, True, 32, True)
    assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8))


def test_convert_attaches_the_quantizers_it_is_given():
    """The ModelOpt path gives ``convert`` its own quantizers: nothing is built and thrown
    away, and they arrive through ``attach`` with the layer's label and device."""
    made, attached = [], []

    def make(attr, label, device):
        made.append((attr, label, device))
        return WireQuantizer("mxfp8", enable=False)

    def attach(module, attr, quantizer):
        attached.append(attr)
        setattr(module, attr, quantizer)

    experts = convert(make_experts(), "layers.5.experts", make_quantizer=make, attach=attach)
    assert [m[:2] for m in made] == [
        ("dispatch_quantizer", "layers.5.experts.dispatch_quantizer"),
        ("combine_quantizer", "layers.5.experts.combine_quantizer"),
    ]
    assert all(m[2] == torch.device("cpu") for m in made)
    assert attached == ["dispatch_quantizer", "combine_quantizer"]
    assert experts.combine_quantizer.fmt.name == "mxfp8"
