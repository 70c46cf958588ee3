"""Child of test_sglang_sm90.test_wrong_layout_asserts_on_the_device (a device-side assert
kills the CUDA context, so it runs in its own process).

    python sglang_assert_child.py clean|corrupt

SGLang's released ``run_sm90_mega_routed`` on the real kernel, quantized through moewire's
SGLang integration; in ``corrupt`` mode the real module's ``fp8_mega_moe`` adds 1 to one
valid combine row after the kernel returns, so the rows no longer re-sum to ``y``. The
layout check is captured into a CUDA graph after a padding-only warm-up; the replay on a
routed batch must stop with a device-side assert. Prints ``REPLAYED OK`` when the replay
and the synchronisation after it succeed.
"""

import importlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import sglang_cases as sc  # noqa: E402

from moewire.integrations import sglang as sg  # noqa: E402

MODE = sys.argv[1]
CORRUPT_TOKEN = 4  # rk.batch gives token 4 every slot valid

group = sc.rk.one_rank_group()
try:
    sm90, _ = sc.load_sglang()
except RuntimeError as exc:
    print("SKIP", exc, flush=True)
    os._exit(0)
real = importlib.import_module("deep_gemm")
if MODE == "corrupt":
    kernel = real.fp8_mega_moe

    def fp8_mega_moe(y, l1, l2, sym_buffer, *args, **kwargs):
        kernel(y, l1, l2, sym_buffer, *args, **kwargs)
        sc.rk.rows_of(sym_buffer, y.shape[0])[0, CORRUPT_TOKEN].add_(1.0)

    real.fp8_mega_moe = fp8_mega_moe

model = sc.Model(group)
sg.quantize_sglang_model(model, {"quant_cfg": [
    {"quantizer_name": "*combine_quantizer", "cfg": {"format": "fp8", "constant_amax": 64.0}}]})
x0, w0, ids0, _ = sc.rk.batch(sc.SHAPE, "warmup", padding_only=True)
sc.run(sm90, model.experts, x0, w0, ids0)
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    sc.run(sm90, model.experts, x0, w0, ids0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = sc.run(sm90, model.experts, x0, w0, ids0)
torch.cuda.current_stream().wait_stream(stream)
x, w, ids, _ = sc.rk.batch(sc.SHAPE, "graph")
x0.copy_(x), w0.copy_(w), ids0.copy_(ids)
graph.replay()
torch.cuda.synchronize()
print("REPLAYED OK", int(y.view(torch.int16).ne(0).sum()), flush=True)
os._exit(0)
