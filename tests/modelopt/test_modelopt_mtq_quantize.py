"""``mtq.quantize`` on the stand-in Mega-MoE experts: summary, calibration, outputs, state."""

import subprocess
import sys

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.modelopt
# Not "modelopt": pytest puts tests/ on sys.path, where tests/modelopt/ would pass for it.
pytest.importorskip("modelopt.torch.quantization")

import modelopt.torch.opt as mto  # noqa: E402
import modelopt.torch.quantization as mtq  # noqa: E402

import moewire  # noqa: E402
from moewire.integrations import modelopt as mw_mo  # noqa: E402
from moewire.megamoe.layout_check import reset_layout_checks  # noqa: E402
from moewire.reference import MegaMoEExperts, forward_context, make_weights  # noqa: E402

E, K, H, INTER, TMAX = 8, 2, 512, 512, 32
FP8 = {"num_bits": (4, 3)}
NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}


def _cfg(dispatch: dict | None, combine: dict | None, algorithm: str | None = "max") -> dict:
    entries: list[dict] = [{"quantizer_name": "*", "enable": False}]
    if dispatch is not None:
        entries.append({"quantizer_name": "*dispatch_quantizer", "cfg": dispatch})
    if combine is not None:
        entries.append({"quantizer_name": "*combine_quantizer", "cfg": combine})
    return {"quant_cfg": entries, "algorithm": algorithm}


_WEIGHTS: dict[int, object] = {}


def _weights(num_shared: int):
    # Built once per shape: the weights (and the stand-in kernel's cache of them) are shared
    # by every Layer, which keeps each test to a few forwards.
    if num_shared not in _WEIGHTS:
        _WEIGHTS[num_shared] = make_weights(
            E, H, INTER, experts=range(E), num_shared_experts=num_shared, seed=0, device="cpu"
        )
    return _WEIGHTS[num_shared]


class Layer(nn.Module):
    def __init__(self, num_fused_shared_experts: int = 0, weights=None, device: str = "cpu"):
        super().__init__()
        self.experts = MegaMoEExperts(
            num_experts=E, top_k=K, hidden=H, intermediate=INTER, max_num_tokens=TMAX,
            num_fused_shared_experts=num_fused_shared_experts, device=device,
            weights=weights if weights is not None else _weights(num_fused_shared_experts),
        )

    def forward(self, x, weights, ids):
        return self.experts(x, weights, ids)


def _batch(seed: int, tokens: int = 24):
    """Tokens, router weights, ids with masked slots, and a padding mask."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, H, generator=g) * (1 + seed)).to(torch.bfloat16)
    logits = torch.randn(tokens, E, generator=g)
    w, ids = logits.softmax(-1).topk(K)
    ids = torch.where(torch.rand(tokens, K, generator=g) < 0.15, -1, ids)
    padding = torch.zeros(tokens, dtype=torch.bool)
    padding[-3:] = True
    return x, w.float(), ids, padding


CALIB = [_batch(s) for s in (1, 2, 3)]
EVAL = _batch(9)


def _run(model, batch):
    x, w, ids, padding = batch
    with forward_context(is_padding=padding):
        return model(x, w, ids)


def _loop(model):
    for batch in CALIB:
        _run(model, batch)


@pytest.fixture(autouse=True)
def _fresh_checks(modelopt_registered):
    reset_layout_checks()
    yield
    reset_layout_checks()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


# -- oracles from the raw buffer (DeepGEMM layout/mega_moe.cuh), independent of moewire.megamoe -


def _valid_rows(experts: MegaMoEExperts, tokens: int) -> torch.Tensor:
    """FP32 [n, H]: the combine rows of valid slots, read at DeepGEMM's upstream offset."""
    buf = experts.get_symm_buffer()
    tmax, k, h = buf.num_max_tokens_per_rank, buf.num_topk, buf.hidden
    flat = buf.buffer
    base = flat.numel() - k * tmax * h * 2
    rows = flat[base:].view(torch.bfloat16).view(k, tmax, h)
    valid = buf.topk_idx[:tokens] >= 0
    return torch.cat([rows[s, :tokens][valid[:, s]].float() for s in range(k)])


def _oracle_amaxes(batches) -> tuple[float, float]:
    """max|x| over non-padding tokens with a valid slot, and max|row| over valid rows."""
    model = Layer()
    dispatch = combine = 0.0
    for batch in batches:
        x, _, ids, padding = batch
        _run(model, batch)
        routed = ((ids >= 0).any(dim=1) & ~padding)
        dispatch = max(dispatch, float(x[routed].float().abs().max()))
        combine = max(combine, float(_valid_rows(model.experts, x.shape[0]).abs().max()))
    return dispatch, combine


# -- tests ----------------------------------------------------------------------------------


def test_import_moewire_does_not_import_modelopt():
    code = "import sys, moewire, moewire.megamoe; assert 'modelopt' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_register_is_idempotent_and_lists_the_stand_in():
    first = mw_mo.register(vllm=False)
    assert MegaMoEExperts in first
    assert mw_mo.register(vllm=False) == first


@pytest.mark.parametrize(
    ("dispatch", "combine", "bits"),
    [(FP8, NVFP4, ("(4, 3) bit", "(2, 1) bit")), (FP8, FP8, ("(4, 3) bit", "(4, 3) bit"))],
    ids=["fp8-dispatch-nvfp4-combine", "fp8-both"],
)
def test_summary_lists_both_quantizers(capsys, dispatch, combine, bits):
    model = Layer()
    mtq.quantize(model, _cfg(dispatch, combine), _loop)
    capsys.readouterr()
    mtq.print_quant_summary(model)
    lines = capsys.readouterr().out.splitlines()
    by_name = {line.split()[0]: line for line in lines if line.startswith("experts.")}
    assert set(by_name) == {"experts.dispatch_quantizer", "experts.combine_quantizer"}
    assert "WireTensorQuantizer" in by_name["experts.dispatch_quantizer"]
    assert bits[0] in by_name["experts.dispatch_quantizer"]
    assert bits[1] in by_name["experts.combine_quantizer"]
    assert "calibrator=MaxCalibrator" in by_name["experts.combine_quantizer"]
    assert lines[-1] == "2 TensorQuantizers found in model"


@pytest.mark.parametrize("combine", [FP8, NVFP4], ids=["fp8", "nvfp4"])
def test_amax_is_the_max_over_valid_rows(combine):
    model = Layer()
    mtq.quantize(model, _cfg(FP8, combine), _loop)
    dispatch_amax, combine_amax = _oracle_amaxes(CALIB)
    assert float(model.experts.dispatch_quantizer.amax) == dispatch_amax
    assert float(model.experts.combine_quantizer.amax) == combine_amax


@pytest.mark.parametrize(
    ("dispatch", "combine"),
    [
        (FP8, NVFP4),
        (FP8, FP8),
        (None, NVFP4),
        (FP8, None),
        (None, {**NVFP4, "constant_amax": 2688.0}),
    ],
    ids=["fp8-nvfp4", "fp8-fp8", "combine-only", "dispatch-only", "nvfp4-constant-amax"],
)
def test_output_equals_moewire_path_bit_for_bit(dispatch, combine):
    cfg = _cfg(dispatch, combine)
    theirs = Layer()
    mtq.quantize(theirs, cfg, _loop)
    ours = Layer()
    moewire.quantize(ours, {"quant_cfg": cfg["quant_cfg"]}, forward_loop=_loop)
    plain = Layer()
    y_theirs, y_ours, y_plain = (_run(m, EVAL) for m in (theirs, ours, plain))
    assert torch.equal(_bits(y_theirs), _bits(y_ours))
    assert not torch.equal(y_theirs, y_plain), "the quantizers changed nothing"
    for attr in ("dispatch_quantizer", "combine_quantizer"):
        a = getattr(theirs.experts, attr).static_amax
        b = getattr(ours.experts, attr).static_amax
        assert (a is None) == (b is None)
        if a is not None:
            assert float(a) == float(b)


def test_a_fused_shared_expert_with_a_dispatch_quantizer_matches_the_moewire_path():
    """The fused shared expert keeps the original tokens (its own kernel launch) under
    ModelOpt's quantizers as under moewire's: the same bits, calibrated the same."""
    cfg = _cfg(FP8, FP8)
    theirs = Layer(num_fused_shared_experts=1)
    mtq.quantize(theirs, cfg, _loop)
    ours = Layer(num_fused_shared_experts=1)
    moewire.quantize(ours, {"quant_cfg": cfg["quant_cfg"]}, forward_loop=_loop)
    y_theirs, y_ours = (_run(m, EVAL) for m in (theirs, ours))
    assert torch.equal(_bits(y_theirs), _bits(y_ours))
    assert not torch.equal(y_theirs, _run(Layer(num_fused_shared_experts=1), EVAL))


def test_modelopt_math_on_request_gives_the_same_fp8_bits():
    """FP8 per tensor is bit-exact between the two maths on CPU, so asking for ModelOpt's
    TensorQuantizer math (row by row, no fused kernel) must not change a bit."""
    asks = {**FP8, "backend_extra_args": {"math": "modelopt"}}
    theirs, ours = Layer(), Layer()
    mtq.quantize(theirs, _cfg(asks, asks), _loop)
    mtq.quantize(ours, _cfg(FP8, FP8), _loop)
    assert theirs.experts.combine_quantizer.math == "modelopt"
    assert theirs.experts.combine_quantizer.fmt is None
    assert torch.equal(_bits(_run(theirs, EVAL)), _bits(_run(ours, EVAL)))


def test_int8_combine_runs_tensor_quantizer_math_on_each_valid_row():
    """A format moewire lacks (INT8 per tensor) goes through ModelOpt's own math: y equals
    the kernel-order sum of TensorQuantizer(row) over the valid rows (DeepGEMM's combine order)."""
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    model = Layer()
    mtq.quantize(model, _cfg(None, {"num_bits": 8}), _loop)
    amax = model.experts.combine_quantizer.amax
    y = _run(model, EVAL)
    plain = Layer()
    _run(plain, EVAL)
    tq = TensorQuantizer(QuantizerAttributeConfig(num_bits=8))
    tq.amax = amax
    buf = plain.experts.get_symm_buffer()
    t = EVAL[0].shape[0]
    rows = buf.buffer[buf.buffer.numel() - K * buf.num_max_tokens_per_rank * H * 2:]
    rows = rows.view(torch.bfloat16).view(K, -1, H)[:, :t]
    valid = buf.topk_idx[:t] >= 0
    acc = torch.zeros(t, H, dtype=torch.float32)
    for s in range(K):
        acc = torch.where(valid[:, s, None], acc + tq(rows[s]).float(), acc)
    assert torch.equal(_bits(y), _bits(acc.to(torch.bfloat16)))


def test_modelopt_state_round_trip_restores_amax_and_output(tmp_path):
    model = Layer()
    mtq.quantize(model, _cfg(FP8, NVFP4), _loop)
    y = _run(model, EVAL)
    mto.save(model, tmp_path / "quant.pth")
    fresh = Layer()
    mto.restore(fresh, tmp_path / "quant.pth")
    for attr in ("dispatch_quantizer", "combine_quantizer"):
        assert isinstance(getattr(fresh.experts, attr), mw_mo.WireTensorQuantizer)
        assert torch.equal(getattr(fresh.experts, attr).amax, getattr(model.experts, attr).amax)
    assert torch.equal(_bits(_run(fresh, EVAL)), _bits(y))


def test_scales_move_from_moewire_to_modelopt_and_back(tmp_path):
    cfg = _cfg(FP8, NVFP4)
    ours = Layer()
    moewire.quantize(ours, {"quant_cfg": cfg["quant_cfg"]}, forward_loop=_loop)
    state = mw_mo.to_modelopt_state(ours)
    assert set(state) == {"experts.dispatch_quantizer._amax", "experts.combine_quantizer._amax"}

    theirs = Layer()
    mtq.quantize(theirs, {**cfg, "algorithm": None})  # uncalibrated
    assert mw_mo.from_modelopt_state(theirs, state) == [
        "experts.combine_quantizer", "experts.dispatch_quantizer"
    ]
    assert torch.equal(_bits(_run(theirs, EVAL)), _bits(_run(ours, EVAL)))

    # back: ModelOpt's own state_dict into a fresh moewire model, and moewire's file format
    back = Layer()
    moewire.quantize(back, {"quant_cfg": cfg["quant_cfg"]})
    mw_mo.from_modelopt_state(back, theirs.state_dict())
    assert torch.equal(_bits(_run(back, EVAL)), _bits(_run(ours, EVAL)))
    path = moewire.save_scales(theirs, tmp_path / "scales.json")
    again = Layer()
    moewire.quantize(again, {"quant_cfg": cfg["quant_cfg"]})
    moewire.load_scales(again, path)
    assert torch.equal(_bits(_run(again, EVAL)), _bits(_run(ours, EVAL)))


def test_scales_interchange_refuses_a_foreign_quantizer():
    model = Layer()
    moewire.quantize(model, {"quant_cfg": _cfg(FP8, None)["quant_cfg"]})
    model.experts.combine_quantizer = nn.Identity()
    with pytest.raises(TypeError, match="is a Identity, neither moewire's WireQuantizer nor"):
        mw_mo.to_modelopt_state(model)


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"experts.combine_quantizer._amax": torch.tensor(1.0)}, "without a saved amax"),
        ({"experts.dispatch_quantizer._amax": torch.tensor(1.0),
          "experts.combine_quantizer._amax": torch.tensor(1.0),
          "other.combine_quantizer._amax": torch.tensor(1.0)}, "saved without a quantizer"),
    ],
    ids=["missing", "unknown"],
)
def test_from_modelopt_state_refuses_mismatched_names(state, match):
    model = Layer()
    mtq.quantize(model, _cfg(FP8, NVFP4, algorithm=None))
    with pytest.raises(KeyError, match=match):
        mw_mo.from_modelopt_state(model, state)


@pytest.mark.parametrize(
    "bad", [torch.tensor([1.0, 2.0]), torch.tensor(float("nan")), torch.tensor(-1.0)],
    ids=["two-values", "nan", "negative"],
)
def test_from_modelopt_state_refuses_bad_values(bad):
    model = Layer()
    mtq.quantize(model, _cfg(FP8, None, algorithm=None))
    with pytest.raises(ValueError, match="one finite value >= 0"):
        mw_mo.from_modelopt_state(model, {"experts.dispatch_quantizer._amax": bad})


# -- the refusals of the wrapper hold for ModelOpt-configured quantizers ------------------


def _dynamic_combine():
    model = Layer()
    mtq.quantize(model, _cfg(None, FP8, algorithm=None))
    _run(model, EVAL)


def _changed_layout(monkeypatch):
    monkeypatch.setenv("DG_COMM_KERNEL_DEBUG", "1")
    model = Layer()
    mtq.quantize(model, _cfg(None, NVFP4), _loop)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (_dynamic_combine, "needs a calibrated or constant amax"),
        (_changed_layout, "layout check failed"),
    ],
    ids=["dynamic-combine-scale", "changed-layout"],
)
def test_wrapper_refusals_hold(build, match, monkeypatch):
    with pytest.raises(RuntimeError, match=match) as info:
        build(monkeypatch) if build is _changed_layout else build()
    assert str(info.value).startswith("experts: ")  # names the layer by its path


def test_parent_class_entries_match_the_experts_class():
    """``parent_class`` takes the registry key register() used for the class."""
    key = "moewire:moewire.reference.experts.MegaMoEExperts"
    cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*combine_quantizer", "parent_class": key, "cfg": FP8},
            {"quantizer_name": "*dispatch_quantizer", "parent_class": "nn.Linear", "cfg": FP8},
        ],
        "algorithm": "max",
    }
    model = Layer()
    mtq.quantize(model, cfg, _loop)
    assert model.experts.combine_quantizer.mode == "quantize"
    assert model.experts.dispatch_quantizer.mode == "disabled"
    assert "experts.combine_quantizer: format=fp8 mode=quantize" in moewire.summary(model)


class _LateExperts(MegaMoEExperts):
    """An experts class with its own forward, known to moewire only after register()."""

    def forward(self, hidden_states, topk_weights, topk_ids, shared_experts=None):
        return super().forward(hidden_states, topk_weights, topk_ids, shared_experts)


def test_classes_known_to_moewire_later_are_converted_by_mtq_quantize():
    mw_mo.register(vllm=False)
    assert _LateExperts not in mw_mo.registered_classes()
    model = Layer()
    model.experts.__class__ = _LateExperts  # same state, a class ModelOpt has not seen
    mtq.quantize(model, _cfg(FP8, FP8), _loop)
    assert _LateExperts in mw_mo.registered_classes()
    assert isinstance(model.experts.combine_quantizer, mw_mo.WireTensorQuantizer)
    assert model.experts.combine_quantizer.has_amax


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dispatch", "combine"), [(FP8, NVFP4), (None, {**NVFP4, "constant_amax": 2688.0})],
    ids=["fp8-nvfp4", "nvfp4-constant-amax"],
)
def test_cuda_output_equals_moewire_path(dispatch, combine):
    """On CUDA the combine runs moewire's fused kernel with the TensorQuantizer's amax."""
    weights = make_weights(E, H, INTER, experts=range(E), seed=0, device="cuda")

    def run(model, batch):
        x, w, ids, padding = batch
        with forward_context(is_padding=padding.cuda()):
            return model(x.cuda(), w.cuda(), ids.cuda())

    def loop(model):
        for batch in CALIB:
            run(model, batch)

    cfg = _cfg(dispatch, combine)
    theirs, ours = (Layer(weights=weights, device="cuda") for _ in range(2))
    mtq.quantize(theirs, cfg, loop)
    moewire.quantize(ours, {"quant_cfg": cfg["quant_cfg"]}, forward_loop=loop)
    assert torch.equal(_bits(run(theirs, EVAL)), _bits(run(ours, EVAL)))
    assert not torch.equal(run(theirs, EVAL), run(Layer(weights=weights, device="cuda"), EVAL))
    for attr in ("dispatch_quantizer", "combine_quantizer"):
        a = getattr(theirs.experts, attr).static_amax
        b = getattr(ours.experts, attr).static_amax
        assert (a is None) == (b is None) and (a is None or float(a) == float(b))


def test_unquantize_refuses_a_modelopt_quantized_model_and_leaves_it_as_it_was():
    """Break: undo moewire's class swap of a ModelOpt module: it keeps ModelOpt's class
    without the quantizers ModelOpt's own code expects."""
    model = Layer()
    mtq.quantize(model, _cfg(FP8, NVFP4), _loop)
    y = _run(model, EVAL)
    with pytest.raises(TypeError, match=r"^experts: ModelOpt converted this module before"):
        moewire.unquantize(model)
    assert isinstance(model.experts.combine_quantizer, mw_mo.WireTensorQuantizer)
    assert torch.equal(_bits(_run(model, EVAL)), _bits(y))
