"""Kimi-K3's SiTU in the stand-in's L1 epilogue: the formula against float64, and its two
DeepGEMM spellings (``_kernel.Activation``).

The scales: ``b_g`` (gate) and ``b_u`` (up, 0 or unset leaves ``up`` as is). DeepGEMM 2.8.x
(vLLM's bundled copies, vllm-project/DeepGEMM dev) names them ``activation_alpha`` and
``activation_beta``; vllm-project/DeepGEMM's 2.6.1 SiTU line (51655f2, which vLLM main's stored
``KimiK3MegaMoEExperts`` calls) names them ``activation_beta`` and ``activation_linear_beta``.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference_oracle as O
import torch
from reference_cases import build

from moewire.reference import deep_gemm, make_weights, stage_mega_moe_inputs
from moewire.reference._kernel import Activation

# Kimi-K3's config (activation_situ_beta, activation_situ_linear_beta), an unset up scale,
# and a pair that keeps both tanh away from their linear part on this data.
SCALES = [(4.0, 25.0), (4.0, 0.0), (1.5, 0.75)]
SCALE_IDS = ["kimi-k3-4-25", "up-unset", "1.5-0.75"]


def _situ64(gate: np.ndarray, up: np.ndarray, b_g: float, b_u: float) -> np.ndarray:
    """The SiTU formula in float64 with np.tanh (independent of the stand-in's 2*sigmoid-1)."""
    return O._situ(gate, up, b_g, b_u)


def _gate_up(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 gate/up values as the epilogue sees them (BF16-rounded L1 outputs), spread over
    [-60, 60] so that tanh both saturates and stays linear."""
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(4096, generator=g) * 12).bfloat16().float()
    up = (torch.randn(4096, generator=g) * 20).bfloat16().float()
    return gate, up


def _tolerance(gate: np.ndarray, up: np.ndarray, b_g: float, b_u: float,
               want: np.ndarray) -> np.ndarray:
    """FP32 error bound of the stand-in's evaluation. Each tanh, as ``2 sigmoid(2v) - 1``, is
    off by at most about ``2^-23`` absolutely (bound: ``2^-22``), which ``h = b_g tanh_g
    sigmoid(g) up'`` scales by ``b_g sigmoid(g) |up'|`` (gate) and ``b_g sigmoid(g)
    |tanh_g| b_u`` (up); the remaining FP32 products add a few ulps of ``h`` (bound: 8).
    Measured: at most 0.43 of this bound on the data below."""
    up_scaled = np.abs(b_u * np.tanh(up / b_u) if b_u > 0 else up)
    sigmoid = 1.0 / (1.0 + np.exp(-gate))
    tanh_gate = np.abs(np.tanh(gate / b_g))
    return (2.0**-22 * b_g * sigmoid * (up_scaled + tanh_gate * b_u)
            + 8 * 2.0**-24 * np.abs(want))


@pytest.mark.parametrize(("b_g", "b_u"), SCALES, ids=SCALE_IDS)
def test_situ_formula_matches_float64(b_g, b_u):
    """``Activation("situ", b_g, b_u).apply`` = ``b_g tanh(g/b_g) sigmoid(g) up'`` in float64
    within FP32 rounding; the scales swapped, or the up tanh dropped, are far outside it.
    Break: drop ``* torch.sigmoid(gate)`` in ``Activation.apply``."""
    gate, up = _gate_up(seed=int(b_g * 100 + b_u))
    got = Activation("situ", None, b_g, b_u).apply(gate, up).double().numpy()
    g64, u64 = gate.double().numpy(), up.double().numpy()
    want = _situ64(g64, u64, b_g, b_u)
    bound = _tolerance(g64, u64, b_g, b_u, want)
    assert (np.abs(got - want) <= bound).all(), float(np.max(np.abs(got - want) - bound))
    # The bound separates the formula from its neighbours on this data.
    swapped = _situ64(g64, u64, b_u if b_u > 0 else 1.0, b_g)
    assert (np.abs(got - swapped) > bound).any()
    if b_u > 0:
        assert (np.abs(got - _situ64(g64, u64, b_g, 0.0)) > bound).any()


@pytest.mark.parametrize(
    ("flavour", "gate_kw", "up_kw"),
    [("vllm-0.32", "activation_alpha", "activation_beta"),
     ("deepgemm-vllm-situ", "activation_beta", "activation_linear_beta")],
    ids=["deepgemm-2.8-spelling", "vllm-situ-line-spelling"],
)
def test_from_kernel_kwargs_reads_the_builds_spelling(flavour, gate_kw, up_kw):
    spelling = deep_gemm.KERNEL_BUILDS[flavour].situ_kwargs
    scales = {"activation_alpha": None, "activation_beta": None, "activation_linear_beta": None}
    act = Activation.from_kernel_kwargs(
        "fp8_fp4_mega_moe", spelling, "situ", None, {**scales, gate_kw: 4.0, up_kw: 25.0})
    assert (act.alpha, act.beta) == (4.0, 25.0)
    unset = Activation.from_kernel_kwargs("fp8_fp4_mega_moe", spelling, "situ", None, scales)
    assert (unset.alpha, unset.beta) == (1.0, 0.0)


def _situ_run(flavour: str, seed: int, **scales: float) -> tuple[torch.Tensor, object, object]:
    """One fp8xfp4 SiTU call on ``flavour``'s buffer (one fused shared expert)."""
    t = 37
    case = build(mma="fp8xfp4", shared=1, seed=seed, run=False)
    with deep_gemm.use_flavour(flavour):
        buf = deep_gemm.get_symm_buffer_for_mega_moe(
            None, case.buf.num_experts, t, case.buf.num_topk, case.buf.hidden,
            case.buf.intermediate_hidden, num_shared_experts=1, mma_type="fp8xfp4",
            activation="situ", device="cpu",
        )
    stage_mega_moe_inputs(case.x, case.topk_idx, case.topk_weights, buf)
    y = torch.empty((t, buf.hidden), dtype=torch.bfloat16)
    w = case.weights
    deep_gemm.fp8_fp4_mega_moe(
        y, w.l1, w.l2, buf, shared_l1_weights=w.shared_l1, shared_l2_weights=w.shared_l2,
        activation="situ", **scales,
    )
    return y, case, buf


def test_the_situ_lines_spelling_runs_kimi_k3s_scales():
    """vLLM main's call (``activation_beta=4, activation_linear_beta=25`` on the 2.6.1 SiTU
    line) equals vLLM 0.32's (``activation_alpha=4, activation_beta=25`` on 2.8.0) bit for
    bit (both add the shared row last), matches the float64 MoE with those scales, and is
    not the call with the scales read the other way round."""
    y_fork, case, buf = _situ_run("deepgemm-vllm-situ", 41, activation_beta=4.0,
                                  activation_linear_beta=25.0)
    y_bundled, _, _ = _situ_run("vllm-0.32", 41, activation_alpha=4.0, activation_beta=25.0)
    assert torch.equal(y_fork.view(torch.int16), y_bundled.view(torch.int16))
    inputs = (O.staged_tokens(buf, y_fork.shape[0]), case.topk_idx.numpy(),
              case.topk_weights.numpy().astype(np.float64), O.dequantize(case.weights.l1_raw),
              O.dequantize(case.weights.l2_raw),
              (O.dequantize(case.weights.shared_l1_raw), O.dequantize(case.weights.shared_l2_raw)))
    ref = O.dense_moe(*inputs, rounding="fp8", situ=(4.0, 25.0))
    assert _token_rel_err(y_fork, ref).max() < 2.0**-8
    misread = O.dense_moe(*inputs, rounding="fp8", situ=(25.0, 0.0))
    assert _token_rel_err(y_fork, misread).max() > 2.0**-5


def _token_rel_err(y: torch.Tensor, ref: np.ndarray) -> np.ndarray:
    got = O.bf16_values(y)
    return np.linalg.norm(got - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)


def _foreign_on_bundled():
    _situ_run("vllm-0.32", 42, activation_alpha=4.0, activation_linear_beta=25.0)


def _foreign_on_situ_line():
    _situ_run("deepgemm-vllm-situ", 42, activation_alpha=4.0, activation_beta=25.0)


@pytest.mark.parametrize(
    ("call", "match"),
    [(_foreign_on_bundled, r"spells SiTU's gate and up tanh scales activation_alpha and "
                           r"activation_beta; it takes no activation_linear_beta"),
     (_foreign_on_situ_line, r"spells SiTU's gate and up tanh scales activation_beta and "
                             r"activation_linear_beta; it takes no activation_alpha")],
    ids=["linear-beta-on-deepgemm-2.8", "alpha-on-the-situ-line"],
)
def test_the_other_builds_spelling_is_refused(call, match):
    """``activation_beta`` names the gate scale in one build and the up scale in the other:
    a call in the wrong spelling is refused, never read as the other scale."""
    with pytest.raises(TypeError, match=match):
        call()


def test_a_bf16_situ_call_takes_the_same_spelling_check():
    with deep_gemm.use_flavour("vllm-0.32"):
        buf = deep_gemm.get_symm_buffer_for_mega_moe(
            None, 8, 4, 2, 512, 512, mma_type="bf16xbf16", activation="situ", device="cpu"
        )
    w = make_weights(8, 512, 512, mma_type="bf16xbf16", seed=1)
    y = torch.empty((4, 512), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="it takes no activation_linear_beta"):
        deep_gemm.bf16_mega_moe(y, w.l1, w.l2, buf, activation="situ",
                                activation_linear_beta=25.0)
