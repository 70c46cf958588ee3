"""Child of test_cuda_graph_replay_with_a_corrupted_row_asserts (a device-side assert kills
the CUDA context, so it runs in its own process).

    python graph_assert_child.py KERNEL clean|corrupt

A user's experts class, registered with ``register_sm90_experts``, calls the real kernel
through its own module-level namespace. In ``corrupt`` mode that namespace's kernel adds 1
to one valid combine row after the real kernel returns, so the rows no longer re-sum to
``y``. The layout check is captured into a CUDA graph after a padding-only warm-up; the
replay on a routed batch must stop with a device-side assert. Prints ``REPLAYED OK`` when
the replay and the synchronisation after it succeed.
"""

import os
import sys
import types
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

import rk_cases as rk  # noqa: E402

import moewire  # noqa: E402
from moewire.integrations import deepgemm_sm90 as sm90  # noqa: E402

KERNEL, MODE = sys.argv[1], sys.argv[2]
CORRUPT_TOKEN = 4  # rk.batch gives token 4 every slot valid

stage_inputs = sm90.stage_sm90_inputs


def _corrupting(fn):
    def kernel(y, l1, l2, symm_buffer, **kwargs):
        fn(y, l1, l2, symm_buffer, **kwargs)
        rk.rows_of(symm_buffer, y.shape[0])[0, CORRUPT_TOKEN].add_(1.0)

    return kernel


real = sm90.deep_gemm
kernels_ns = types.SimpleNamespace(**{
    name: (_corrupting(getattr(real, name)) if MODE == "corrupt" else getattr(real, name))
    for name in sm90.KERNELS
})


class UserExperts(nn.Module):
    def __init__(self, w1, w2, buf):
        super().__init__()
        self.w1, self.w2, self.buf = w1, w2, buf
        self.register_buffer("anchor", torch.zeros((), device="cuda"))

    def forward(self, hidden_states, topk_weights, topk_ids):
        stage_inputs(hidden_states, topk_ids, topk_weights, self.buf)
        y = torch.empty_like(hidden_states)
        getattr(kernels_ns, KERNEL)(y, self.w1, self.w2, self.buf,
                                    recipe=sm90.KERNELS[KERNEL][0], activation="swiglu",
                                    activation_clamp=10.0, fast_math=True)
        return y


sm90.register_sm90_experts(UserExperts, forward_module="__main__", stage_fn="stage_inputs",
                           kernel_ns="kernels_ns", get_symm_buffer=lambda m: m.buf)

group = rk.one_rank_group()
shape = rk.TINY
w1, w2, buf = rk.prepared(KERNEL, shape, group)
module = moewire.quantize(UserExperts(w1, w2, buf),
                          {"quant_cfg": [{"quantizer_name": "*combine_quantizer",
                                          "cfg": {"format": "fp8", "constant_amax": 64.0}}]})
x0, w0, ids0, _ = rk.batch(shape, "warmup", padding_only=True)
module(x0, w0, ids0)
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    module(x0, w0, ids0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = module(x0, w0, ids0)
torch.cuda.current_stream().wait_stream(stream)
x, w, ids, _ = rk.batch(shape, "graph")
x0.copy_(x), w0.copy_(w), ids0.copy_(ids)
graph.replay()
torch.cuda.synchronize()
print("REPLAYED OK", int(y.view(torch.int16).ne(0).sum()), flush=True)
os._exit(0)
