"""A CUDA-graph-safe stand-in kernel and a captured quantized layer (GPU tests only).

The stand-in kernel of ``moewire.reference`` syncs with the host (``nonzero``, ``tolist``)
and cannot be captured. This one has the same contract for one rank and ``bf16xbf16``:
it writes a row per valid (slot, token) into the combine region (invalid slots keep their
stale rows) and sums them into ``y`` in the kernel's order, without a host sync. A device
flag ``corrupt`` (FP32 ``[]``) is added to every row of slot 0 after ``y`` is written: 0
leaves the rows intact, anything else breaks them the way a changed layout would.
"""

from __future__ import annotations

import torch
from mm_helpers import SHAPES, batch, make_experts, region

from moewire.megamoe.convert import convert
from moewire.quantizer import WireQuantizer
from moewire.reference import deep_gemm, forward_context

T = 16


def make_capturable_kernel(corrupt: torch.Tensor):
    def bf16_mega_moe(y, l1_weights, l2_weights, sym_buffer, **kwargs):
        t, k = y.shape[0], sym_buffer.num_topk
        idx = sym_buffer.topk_idx[:t]
        valid = (idx >= 0).T.unsqueeze(-1)  # [k, t, 1]
        gain = (1.0 + idx.clamp(min=0).float() / 8.0) * sym_buffer.topk_weights[:t]
        x = sym_buffer.x[:t].float()
        rows = region(sym_buffer)
        fresh = (x.unsqueeze(0) * gain.T.unsqueeze(-1)).bfloat16()
        rows[:k, :t] = torch.where(valid, fresh, rows[:k, :t])
        acc = torch.zeros((t, y.shape[1]), dtype=torch.float32, device=y.device)
        for s in range(k):
            acc += torch.where(valid[s], rows[s, :t].float(), torch.zeros((), device=y.device))
        y.copy_(acc.bfloat16())
        rows[0, :t] += corrupt.bfloat16()

    return bf16_mega_moe


class Captured:
    """A converted layer with constant-amax quantizers, static inputs and a CUDA graph
    captured after an all-padding warm-up (so its buffer was unchecked at capture)."""

    def __init__(self, patch=setattr) -> None:
        self.corrupt = torch.zeros((), device="cuda")
        patch(deep_gemm, "bf16_mega_moe", make_capturable_kernel(self.corrupt))
        self.experts = convert(make_experts(device="cuda"), "layers.0.experts")
        self.experts.dispatch_quantizer = WireQuantizer("fp8", constant_amax=8.0).cuda()
        self.experts.combine_quantizer = WireQuantizer("nvfp4", constant_amax=2.0).cuda()
        hidden = SHAPES["bf16xbf16"][0]
        x, w, ids = batch(T, hidden, seed=0)
        self.x, self.w, self.ids = x.cuda(), w.cuda(), ids.cuda()
        self.pad = torch.ones(T, dtype=torch.bool, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), forward_context(is_padding=self.pad):
            for _ in range(2):
                self.experts(self.x, self.w, self.ids)  # all padding: the check waits
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with forward_context(is_padding=self.pad), torch.cuda.graph(self.graph):
            self.y = self.experts(self.x, self.w, self.ids)

    def replay(self, seed: int) -> torch.Tensor:
        x, w, ids = batch(T, self.x.shape[1], seed=seed)
        self.x.copy_(x)
        self.w.copy_(w)
        self.ids.copy_(ids)
        self.pad.fill_(False)
        self.graph.replay()
        torch.cuda.synchronize()
        return self.y.clone()

    def eager(self, seed: int, no_sync: bool = False) -> torch.Tensor:
        """An eager forward on the same tokens as ``replay(seed)``; with ``no_sync`` the
        forward runs under ``torch.cuda.set_sync_debug_mode("error")`` (inputs are put on
        the device first: a pageable host-to-device copy is itself a sync)."""
        x, w, ids = (t.cuda() for t in batch(T, self.x.shape[1], seed=seed))
        pad = torch.zeros(T, dtype=torch.bool, device="cuda")
        torch.cuda.synchronize()
        with forward_context(is_padding=pad):
            if no_sync:
                torch.cuda.set_sync_debug_mode("error")
            try:
                y = self.experts(x, w, ids)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return y.clone()
