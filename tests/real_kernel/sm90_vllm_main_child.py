"""Child of test_wrong_layout_in_a_cuda_graph_is_a_device_assert (a device-side assert kills
the CUDA context, so it runs in its own process).

    python sm90_vllm_main_child.py right|wrong

``sm90_vllm_main.VllmMainSM90Experts`` on PR #323's kernel under the fork's names, combine
quantized (FP8, constant amax). ``wrong`` reads the rows with a layout one token row early
(``MOEWIRE_FLAVOUR`` names it). After a padding-only warm-up the layout check is captured
into a CUDA graph; the replay on a routed batch must stop with a device-side assert in
``wrong`` mode. Prints ``REPLAYED OK`` when the replay and the synchronisation after it
succeed.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import rk_cases as rk  # noqa: E402
import sm90_vllm_main as vm  # noqa: E402
import test_vllm_main_sm90 as t  # noqa: E402

import moewire  # noqa: E402
from moewire.integrations import deepgemm_sm90 as sm90  # noqa: E402
from moewire.megamoe import flavours  # noqa: E402

MODE = sys.argv[1]
if MODE == "wrong":
    t._register_wrong_layout()
    os.environ[flavours.ENV_FLAVOUR] = t.WRONG

group = rk.one_rank_group()
module = t.make_experts(group)
moewire.quantize(module, t._combine("fp8", 64.0))
x0, w0, ids0, pad0 = t._batch("warm", all_padding=True)
vm.forward_context.is_padding = pad0
module(x0, w0, ids0, activation_clamp=10.0)
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    module(x0, w0, ids0, activation_clamp=10.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = module(x0, w0, ids0, activation_clamp=10.0)
torch.cuda.current_stream().wait_stream(stream)
x, w, ids, pad = t._batch("graph")
x0.copy_(x), w0.copy_(w), ids0.copy_(ids), pad0.copy_(pad)
graph.replay()
torch.cuda.synchronize()
print("REPLAYED OK", int(y.view(torch.int16).ne(0).sum()), rk.SHAPES[0].name, sm90.FLAVOUR,
      flush=True)
os._exit(0)
