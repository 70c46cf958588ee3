"""A dispatch quantizer with a shared expert fused into the kernel (DeepSeek-V4's default
under vLLM main, ``VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION`` unset).

The fused shared expert reads the staged tokens (DeepGEMM's SM100 kernels: ``shared_l1_acts
= x``), but its tokens never cross the wire the dispatch quantizer stands for. moewire runs
the kernel twice: the shared expert's own launch on the original tokens with no routed slot,
then the forward's call on the quantized tokens; the second call's routed rows and the first
call's shared row are re-summed in the build's order. The oracle here is built from two plain
(unconverted) forwards: the shared row of a forward on ``x``, the routed rows of a forward on
``q(x)``, summed in FP32 in the build's order and rounded once.
"""

from __future__ import annotations

import mm_oracles as oracles
import numpy as np
import pytest
import torch
from mm_helpers import SHAPES, Model, batch, make_experts, region

from moewire import formats
from moewire.megamoe import flavours, layout_check
from moewire.megamoe.convert import convert
from moewire.megamoe.registry import ExpertsAdapter, register_experts_class
from moewire.quantizer import WireQuantizer
from moewire.reference import MegaMoEExperts, deep_gemm, stage_mega_moe_inputs

T = 20
AMAX = 3.0
# The builds that fuse a shared expert, and where each adds its row (read in their kernels'
# sources; independent of moewire's build table).
FUSING = {"vllm-0.32": "last", "vllm-0.33": "first", "deepgemm-vllm-situ": "last",
          "deepgemm-vllm-dev": "first"}


@pytest.fixture(autouse=True)
def fresh_checks():
    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


def _layer(flavour: str) -> MegaMoEExperts:
    mma = deep_gemm.MMA_OF_KERNEL[deep_gemm.KERNEL_BUILDS[flavour].kernels[-1]]
    with deep_gemm.use_flavour(flavour):
        return Model(n=1, mma=mma, fused=1).layers[0].experts


def _rows_of_plain_forward(experts: MegaMoEExperts, x, w, ids) -> torch.Tensor:
    """The combine rows a plain (unconverted) forward leaves, copied."""
    experts(x, w, ids)
    return region(experts.get_symm_buffer()).clone()


def _oracle(routed: torch.Tensor, shared: torch.Tensor, ids: torch.Tensor, position: str,
            quant=None) -> np.ndarray:
    """BF16 bits of the build's sum: FP32 from +0.0, the shared row first or last, the
    valid routed rows (each through ``quant``) in ascending slot order, one rounding."""
    k = ids.shape[1]
    rows = torch.cat([routed[:k], shared[k : k + 1]]).float().numpy()
    return oracles.resum(rows, ids.numpy(), T, position, quant=quant)


def _dispatch(experts, amax=AMAX):
    convert(experts, "layers.0.experts")
    experts.dispatch_quantizer = WireQuantizer("fp8", constant_amax=amax)


@pytest.mark.parametrize("flavour", sorted(FUSING), ids=sorted(FUSING))
def test_the_fused_shared_expert_keeps_the_original_tokens(flavour):
    """The quantized forward = routed rows of a forward on q(x) + the shared row of a
    forward on x, in the build's order, bit for bit; the caller's x is untouched, and the
    shared row the kernel computes from q(x) differs (the data shows which one was used).
    Break: ``_moewire_stage`` staging the quantized tokens for the fused shared expert too
    (the refusal removed, no second launch)."""
    experts = _layer(flavour)
    x, w, ids = batch(T, experts.hidden, seed=61, scale=3.0)
    xq = formats.fake_quant(x, "fp8", torch.tensor(AMAX))
    shared_on_x = _rows_of_plain_forward(experts, x, w, ids)
    routed_on_xq = _rows_of_plain_forward(experts, xq, w, ids)
    k = ids.shape[1]
    assert not torch.equal(shared_on_x[k, :T], routed_on_xq[k, :T])
    x_before = x.clone()
    _dispatch(experts)
    # The stand-in module names the build it imitates now: the wrapper reads the rows in
    # this build's order only inside use_flavour.
    with deep_gemm.use_flavour(flavour):
        y = experts(x, w, ids)
    np.testing.assert_array_equal(
        oracles.torch_bits(y), _oracle(routed_on_xq, shared_on_x, ids, FUSING[flavour]))
    assert torch.equal(x, x_before)
    # The check passed and ruled out every other slot; rows this ordinary may leave the
    # other end of the sum unproven (tests/megamoe/test_megamoe_shared_order.py proves it).
    other = "last" if FUSING[flavour] == "first" else "first"
    assert set(layout_check.unproven_readings(experts.get_symm_buffer())) <= {
        f"shared row added {other}"}


def test_with_a_combine_quantizer_too():
    """Dispatch and combine: the routed rows quantized (MXFP8), the shared row from the
    original tokens unquantized, in vLLM 0.33's order (shared first)."""
    experts = _layer("vllm-0.33")
    x, w, ids = batch(T, experts.hidden, seed=62, scale=3.0)
    xq = formats.fake_quant(x, "fp8", torch.tensor(AMAX))
    shared_on_x = _rows_of_plain_forward(experts, x, w, ids)
    routed_on_xq = _rows_of_plain_forward(experts, xq, w, ids)
    _dispatch(experts)
    experts.combine_quantizer = WireQuantizer("mxfp8")
    y = experts(x, w, ids)
    want = _oracle(routed_on_xq, shared_on_x, ids, "first",
                   quant=lambda r: oracles.mxfp8(r[None])[0])
    np.testing.assert_array_equal(oracles.torch_bits(y), want)


def test_calibrating_with_a_fused_shared_expert_needs_no_second_launch():
    """Calibrating, values pass unquantized: one launch, the amax over routed tokens only
    (padding tokens carry 1000x values)."""
    experts = _layer("vllm-0.33")
    x, w, ids = batch(T, experts.hidden, seed=63, scale=3.0)
    ids[-2:] = -1
    x[-2:] = 1000.0
    convert(experts, "layers.0.experts")
    experts.dispatch_quantizer = WireQuantizer("fp8")
    calls = []
    real = deep_gemm.bf16_mega_moe

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp, experts.dispatch_quantizer.calibrating():
        mp.setattr(deep_gemm, "bf16_mega_moe", counting)
        experts(x, w, ids)
    assert len(calls) == 1
    valid = (ids >= 0).any(dim=1)
    assert float(experts.dispatch_quantizer.static_amax) == float(x[valid].float().abs().max())


def test_the_shared_pass_records_no_routing():
    """The shared expert's own launch sees no routed slot (its staging clears topk_ids), so
    no local expert receives a token in it: the kernel's receive counter counts the second
    call only."""
    experts = _layer("vllm-0.33")
    x, w, ids = batch(T, experts.hidden, seed=64)
    stats_plain = torch.zeros(experts.num_experts, dtype=torch.int32)
    stats_quant = torch.zeros(experts.num_experts, dtype=torch.int32)
    real = deep_gemm.bf16_mega_moe

    def with_stats(stats):
        def kernel(*args, **kwargs):
            return real(*args, cumulative_local_expert_recv_stats=stats, **kwargs)
        return kernel

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deep_gemm, "bf16_mega_moe", with_stats(stats_plain))
        experts(x, w, ids)
        _dispatch(experts)
        mp.setattr(deep_gemm, "bf16_mega_moe", with_stats(stats_quant))
        experts(x, w, ids)
    assert torch.equal(stats_plain, stats_quant) and int(stats_plain.sum()) > 0


def _one_row_early(buf, nbytes, where):
    return buf.buffer.numel() - nbytes - 2 * buf.hidden


def test_a_wrong_layout_is_refused_at_the_shared_pass(monkeypatch):
    """Rows read one token row early: the shared launch's output is not the row read at
    slot k, and the forward stops before any row is put back."""
    experts = _layer("vllm-0.32")
    monkeypatch.setitem(flavours.BASE_RULES, "test_one_row_early", _one_row_early)
    monkeypatch.setitem(flavours._REGISTRY, "test-one-row-early", flavours.Flavour(
        "test-one-row-early",
        {"bf16_mega_moe": flavours.KernelLayout("test_one_row_early", "last")}))
    monkeypatch.setenv(flavours.ENV_FLAVOUR, "test-one-row-early")
    _dispatch(experts)
    with pytest.raises(RuntimeError, match=r"layers\.0\.experts: the Mega-MoE layout check "
                       r"failed: bf16_mega_moe launched with no routed slot"):
        experts(*batch(T, experts.hidden, seed=65))


def test_the_shared_expert_reads_its_own_input_pass_on_fp8(fp8_layer):
    """fp8xfp4 (the dispatch cast is MXFP8 in the staging): the same property."""
    experts = fp8_layer
    x, w, ids = batch(T, SHAPES["fp8xfp4"][0], seed=66, scale=3.0)
    xq = formats.fake_quant(x, "fp8", torch.tensor(AMAX))
    shared_on_x = _rows_of_plain_forward(experts, x, w, ids)
    routed_on_xq = _rows_of_plain_forward(experts, xq, w, ids)
    _dispatch(experts)
    y = experts(x, w, ids)
    np.testing.assert_array_equal(oracles.torch_bits(y),
                                  _oracle(routed_on_xq, shared_on_x, ids, "first"))


@pytest.fixture()
def fp8_layer():
    with deep_gemm.use_flavour("vllm-0.33"):
        return Model(n=1, mma="fp8xfp4", fused=1).layers[0].experts


# -- refusals --------------------------------------------------------------------------------


def stage_routing(hidden_states, routing, weights, buf, is_padding=None):
    """A staging function whose ids parameter is not called topk_ids."""
    stage_mega_moe_inputs(hidden_states, routing, weights, buf, is_padding)


class _IdsUnnamed(MegaMoEExperts):
    """Stages through :func:`stage_routing`, then calls the kernel."""

    def forward(self, hidden_states, topk_weights, topk_ids):
        buf = self.get_symm_buffer()
        stage_routing(hidden_states, topk_ids, topk_weights, buf)
        y = torch.empty((hidden_states.shape[0], self.hidden), dtype=torch.bfloat16)
        deep_gemm.bf16_mega_moe(y, self.l1_weights, self.l2_weights, buf,
                                **self._fused_shared_kwargs())
        return y


class _NoKernelCall(MegaMoEExperts):
    """Stages, then returns without calling the kernel."""

    def forward(self, hidden_states, topk_weights, topk_ids):
        stage_mega_moe_inputs(hidden_states, topk_ids, topk_weights, self.get_symm_buffer())
        return torch.zeros((hidden_states.shape[0], self.hidden), dtype=torch.bfloat16)


def _adapter(name: str, stage_fn: str) -> ExpertsAdapter:
    return ExpertsAdapter(
        name=name, forward_module=__name__, stage_fn=stage_fn, stage_hidden_arg=0,
        kernel_ns="deep_gemm", get_symm_buffer=lambda m: m.get_symm_buffer(),
        flavour=lambda m: "vllm-0.33", fused_shared=lambda m: m.fused_shared,
        ep_group=lambda m: None,
    )


register_experts_class(_IdsUnnamed, _adapter("test-ids-unnamed", "stage_routing"))
register_experts_class(_NoKernelCall, _adapter("test-no-kernel-call", "stage_mega_moe_inputs"))


def _run_refused(cls):
    h, i = SHAPES["bf16xbf16"]
    experts = cls(8, 4, h, i, 24, mma_type="bf16xbf16", device="cpu",
                  num_fused_shared_experts=1)
    _dispatch(experts)
    experts(*batch(T, h, seed=67))


@pytest.mark.parametrize(
    ("cls", "match"),
    [(_IdsUnnamed, r"layers\.0\.experts: the dispatch quantizer is enabled and a shared "
                   r"expert is fused.*has no topk_ids argument to clear.*"
                   r"VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION=1"),
     (_NoKernelCall, r"layers\.0\.experts: the forward of _NoKernelCall staged its tokens for "
                     r"a fused shared expert's own kernel launch, but no hooked Mega-MoE "
                     r"kernel call followed")],
    ids=["staging-without-topk-ids", "no-kernel-after-the-staging"],
)
def test_the_second_launch_is_refused_where_it_cannot_be_made(cls, match):
    with pytest.raises(RuntimeError, match=match):
        _run_refused(cls)


# -- CUDA graphs (H200) ----------------------------------------------------------------------


# Token 0's column 0 in the capturable kernel: routed 2^16, 1, 1, 0 and the shared row 2^24.
# Shared first, 2^24 + 2^16 absorbs each +1 and rounds to 2^24; shared last gives 2^24 + 2^17
# (tests/megamoe/test_megamoe_shared_order.py): the first eager check proves the order.
ORDER_ROWS = torch.tensor([2.0**16, 1.0, 1.0, 0.0, 2.0**24]).bfloat16()
_ORDER_ROWS: dict[torch.device, torch.Tensor] = {}  # made by the eager call, before capture


def _capturable_fused_kernel(y, l1, l2, buf, shared_l1_weights=None, shared_l2_weights=None,
                             **kwargs):
    """A ``bf16_mega_moe`` with no host sync (the stand-in's syncs): routed rows
    ``bf16(x * gain)`` at the valid slots, the shared row ``bf16(x / 2 + 1)`` at slot k for
    every token, summed shared first in FP32, one rounding (vLLM 0.33's order). Token 0's
    column 0 holds rows whose sum shows that order (:data:`ORDER_ROWS`)."""
    t, k = y.shape[0], buf.num_topk
    idx = buf.topk_idx[:t]
    valid = (idx >= 0).T.unsqueeze(-1)
    gain = (1.0 + idx.clamp(min=0).float() / 8.0) * buf.topk_weights[:t]
    x = buf.x[:t].float()
    rows = region(buf)
    rows[:k, :t] = torch.where(valid, (x.unsqueeze(0) * gain.T.unsqueeze(-1)).bfloat16(),
                               rows[:k, :t])
    rows[k, :t] = (x * 0.5 + 1.0).bfloat16()
    # Copied to the device once, by the eager forward before capture: a host-to-device copy
    # is not allowed while a CUDA graph is being captured.
    order = _ORDER_ROWS.get(y.device)
    if order is None:
        order = _ORDER_ROWS[y.device] = ORDER_ROWS.to(y.device)
    rows[:, 0, 0] = order
    acc = torch.zeros((t, y.shape[1]), dtype=torch.float32, device=y.device)
    acc = acc + rows[k, :t].float()
    for s in range(k):
        acc = torch.where(valid[s], acc + rows[s, :t].float(), acc)
    y.copy_(acc.bfloat16())


@pytest.mark.gpu
def test_the_shared_pass_replays_in_a_cuda_graph_like_eager(monkeypatch):
    """Both launches, the owed staging and the re-sum are captured: replays equal eager
    forwards bit for bit, and an eager forward after the check makes no host sync; the
    shared part of the output is that of the original tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run `pytest -m gpu` on a machine with a CUDA GPU)")
    monkeypatch.setattr(deep_gemm, "bf16_mega_moe", _capturable_fused_kernel)
    with deep_gemm.use_flavour("vllm-0.33"):
        experts = convert(make_experts(fused=1, device="cuda"), "layers.0.experts")
    experts.dispatch_quantizer = WireQuantizer("fp8", constant_amax=AMAX).cuda()
    experts.combine_quantizer = WireQuantizer("bf16").cuda()
    static = [t.cuda() for t in batch(T, experts.hidden, seed=70, scale=3.0)]
    static[2][0] = torch.arange(static[2].shape[1])  # token 0 shows the order (ORDER_ROWS)
    eager_first = experts(*static).clone()  # the eager checks run here
    assert layout_check.layout_checked(experts.get_symm_buffer())
    x, w, ids = (t.cpu() for t in static)
    xq = formats.fake_quant(x, "fp8", torch.tensor(AMAX))
    shared = (x.float() * 0.5 + 1.0).bfloat16().float()
    gain = (1.0 + ids.clamp(min=0).float() / 8.0) * w
    acc = shared
    for s in range(ids.shape[1]):
        routed = (xq.float() * gain[:, s : s + 1]).bfloat16().float()
        acc = torch.where((ids[:, s] >= 0)[:, None], acc + routed, acc)
    acc[0, 0] = 2.0**24  # ORDER_ROWS summed shared first
    np.testing.assert_array_equal(oracles.torch_bits(eager_first.cpu()),
                                  oracles.torch_bits(acc.bfloat16()))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        experts(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = experts(*static)
    for seed in (71, 72):
        fresh = [t.cuda() for t in batch(T, experts.hidden, seed=seed, scale=3.0)]
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = experts(*fresh)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        np.testing.assert_array_equal(oracles.torch_bits(y_static.cpu()),
                                      oracles.torch_bits(eager.cpu()))
