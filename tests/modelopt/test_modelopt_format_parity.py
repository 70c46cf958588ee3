"""moewire's formats against ModelOpt 0.47's own fake quant, bit for bit, on random data."""

import importlib.util
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.modelopt
# Not "modelopt": pytest puts tests/ on sys.path, where tests/modelopt/ would pass for it.
pytest.importorskip("modelopt.torch.quantization")

from modelopt.torch.quantization.config import QuantizerAttributeConfig  # noqa: E402
from modelopt.torch.quantization.nn import TensorQuantizer  # noqa: E402

import moewire  # noqa: E402

NVFP4_CFG = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}


def _tensor_quantizer(cfg: dict, amax: float | torch.Tensor | None) -> TensorQuantizer:
    tq = TensorQuantizer(QuantizerAttributeConfig(**cfg))
    if amax is not None:
        tq.amax = torch.as_tensor(amax, dtype=torch.float32)
    return tq


def _ulp_split_amaxes(count: int, seed: int) -> list[float]:
    """FP32 amax values where 448/amax (one rounding) != 448*fl(1/amax) (two roundings)."""
    rng = np.random.default_rng(seed)
    found: list[float] = []
    while len(found) < count:
        a = np.float32(rng.uniform(1e-3, 1e3))
        one = np.float32(448.0 / np.float64(a))
        two = np.float32(np.float64(np.float32(1.0 / np.float64(a))) * 448.0)
        if one != two:
            found.append(float(a))
    return found


def _sample(dist: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dist == "normal":
        return torch.randn(shape, generator=gen)
    if dist == "heavy":  # log-normal magnitudes over ~6 decades, random signs
        mag = torch.exp(torch.randn(shape, generator=gen) * 3.0)
        return mag * torch.sign(torch.randn(shape, generator=gen))
    if dist == "uniform":
        return torch.rand(shape, generator=gen) * 20 - 10
    if dist == "tiny":  # lands in E4M3's subnormals once scaled
        return torch.randn(shape, generator=gen) * 1e-4
    raise AssertionError(dist)


def _seed(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that -0.0 != +0.0 and NaN payloads count."""
    return t.view({torch.float32: torch.int32}.get(t.dtype, torch.int16))


DISTS = ["normal", "heavy", "uniform", "tiny"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SPLIT_AMAXES = _ulp_split_amaxes(4, seed=7)


def test_split_amaxes_really_split():
    """The amax list does exercise the one-versus-two-rounding difference."""
    for a in SPLIT_AMAXES:
        at = torch.tensor(a, dtype=torch.float32)
        assert 448.0 / at.double() != (448.0 * torch.reciprocal(at)).double()


def test_split_amaxes_change_fp32_outputs():
    """The parity check can fail: an FP8 with one rounding (true division 448/amax) differs
    from ModelOpt's on FP32 data with these amax values (BF16/FP16 outputs hide the ulp)."""

    def true_division_fp8(x: torch.Tensor, amax: float) -> torch.Tensor:
        s = torch.div(torch.tensor(448.0), torch.tensor(amax, dtype=torch.float32))
        q = (x.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn)
        return (q.float() * torch.div(torch.tensor(1.0), s)).to(x.dtype)

    x = _sample("normal", (64, 96), torch.Generator().manual_seed(_seed("split")))
    for amax in SPLIT_AMAXES:
        theirs = _tensor_quantizer({"num_bits": (4, 3)}, amax)(x)
        assert not torch.equal(_bits(true_division_fp8(x, amax)), _bits(theirs))


def _amax_cases(x: torch.Tensor) -> list[float]:
    data_max = float(x.float().abs().max())
    # below, at and above the data max (clipping), the ulp-split values, and the two
    # degenerate ones ModelOpt replaces with 1 (amax <= 2^-24)
    return [data_max, data_max * 0.37, data_max * 3.1, *SPLIT_AMAXES, 2.0**-25, 0.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("dist", DISTS)
def test_fp8_per_tensor_matches_tensor_quantizer(dist, dtype):
    gen = torch.Generator().manual_seed(_seed("fp8", dist, dtype))
    x = _sample(dist, (64, 96), gen).to(dtype)
    for amax in _amax_cases(x):
        ours = moewire.fake_quant(x, "fp8", amax)
        theirs = _tensor_quantizer({"num_bits": (4, 3)}, amax)(x)
        assert ours.dtype == theirs.dtype == dtype
        assert torch.equal(_bits(ours), _bits(theirs)), (
            f"amax={amax!r}: {(_bits(ours) != _bits(theirs)).sum()} elements differ"
        )


@pytest.mark.parametrize("dist", DISTS)
def test_fp8_dynamic_amax_matches_tensor_quantizer(dist):
    """Without a calibrated amax ModelOpt uses max|x| of the call; so does moewire's math."""
    from moewire.integrations.modelopt import WireTensorQuantizer

    gen = torch.Generator().manual_seed(11)
    x = _sample(dist, (32, 64), gen).to(torch.bfloat16)
    theirs = _tensor_quantizer({"num_bits": (4, 3)}, None)(x)
    ours = WireTensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3)))
    assert ours.math == "moewire"
    assert torch.equal(_bits(ours(x)), _bits(theirs))
    assert torch.equal(_bits(moewire.fake_quant(x, "fp8", x.abs().amax())), _bits(theirs))


def test_fp8_amax_stored_in_bf16_is_read_as_fp32():
    """Calibrating on BF16 data leaves a BF16 amax buffer; both sides read it as FP32."""
    gen = torch.Generator().manual_seed(5)
    x = _sample("heavy", (16, 64), gen).to(torch.bfloat16)
    tq = _tensor_quantizer({"num_bits": (4, 3)}, None)
    tq.amax = x.abs().amax()  # BF16 [] buffer, as MaxCalibrator leaves it
    assert tq.amax.dtype == torch.bfloat16
    assert torch.equal(_bits(moewire.fake_quant(x, "fp8", tq.amax)), _bits(tq(x)))


def _parity_tools():
    """The emulations of benchmarks/modelopt_nvfp4_parity.py (the measurement's own code)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "modelopt_nvfp4_parity.py"
    spec = importlib.util.spec_from_file_location("modelopt_nvfp4_parity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("dist", DISTS)
def test_nvfp4_matches_tensor_quantizer_on_cuda(dist, dtype):
    """ModelOpt's NVFP4 fake quant runs only on CUDA (Triton kernel on SM >= 8.9).

    Two differences, both pinned here (measured on an H200, docs/modelopt.md):
    - signed zeros: a negative input that rounds to zero is -0.0 in moewire's
      ``sign(x) * q * bs`` (moewire) and +0.0 from ModelOpt 0.47's Triton kernel;
    - rare values at a rounding boundary: ModelOpt's kernel divides with Triton's
      default FP32 division, which is not correctly rounded. moewire's math with that one
      division swapped in reproduces every ModelOpt value; with torch's correctly
      rounded division it reproduces every moewire value.
    """
    tools = _parity_tools()
    gen = torch.Generator().manual_seed(_seed("nvfp4", dist, dtype))
    x = _sample(dist, (128, 256), gen).to(dtype).cuda()
    data_max = float(x.float().abs().max())
    for amax in [data_max, data_max * 0.25, data_max * 4.0, 2688.0, *SPLIT_AMAXES]:
        theirs = _tensor_quantizer(NVFP4_CFG, amax).cuda()(x)
        ours_cuda = moewire.fake_quant(x, "nvfp4", amax)
        ours_cpu = moewire.fake_quant(x.cpu(), "nvfp4", amax)
        assert torch.equal(_bits(ours_cpu), _bits(ours_cuda.cpu())), f"amax={amax!r}"
        assert torch.equal(ours_cuda, tools.nvfp4_with(torch.div, x, amax)), f"amax={amax!r}"
        assert torch.equal(theirs, tools.nvfp4_with(tools.triton_div, x, amax)), (
            f"amax={amax!r}: a ModelOpt value the division does not explain"
        )
        assert (ours_cuda != theirs).float().mean() < 1e-3, f"amax={amax!r}"
        zeros = (_bits(ours_cuda) != _bits(theirs)) & (ours_cuda == theirs)
        assert (ours_cuda[zeros] == 0).all() and (x[zeros] < 0).all(), f"amax={amax!r}"
        assert torch.signbit(ours_cuda[zeros]).all(), f"amax={amax!r}: moewire keeps -0.0"
        assert not torch.signbit(theirs[zeros]).any(), f"amax={amax!r}: ModelOpt gives +0.0"
