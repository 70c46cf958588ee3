"""Whether ``F.linear`` in BF16 gives the same bits eagerly, eagerly on a side stream, and
replayed from a CUDA graph captured on that stream, at the tiny test model's shapes and at
Qwen3-30B-A3B's LM head (2048 tokens, H 2048, vocabulary 151936); then with
``allow_bf16_reduced_precision_reduction = False``.

    python3 benchmarks/results/eval-fused-h100/linear_capture.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SHAPES = [(32, 128, 256), (32, 128, 4096), (2048, 2048, 151936), (2048, 128, 768),
          (32, 128, 128)]


def differing(tokens: int, hidden: int, vocab: int, side: torch.cuda.Stream) -> tuple[int, int]:
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    w = (torch.randn(vocab, hidden, device="cuda") * hidden**-0.5).bfloat16()
    ref = F.linear(x, w)
    with torch.cuda.stream(side):
        on_side = F.linear(x, w)
    torch.cuda.synchronize()
    static = x.clone()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        F.linear(static, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = F.linear(static, w)
    graph.replay()
    torch.cuda.synchronize()
    return int((on_side != ref).sum()), int((out != ref).sum())


def main() -> None:
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    for shape in SHAPES:
        stream, graph = differing(*shape, side)
        print(f"T{shape[0]} H{shape[1]} V{shape[2]}: side-stream eager differs {stream}, "
              f"graph differs {graph} of {shape[0] * shape[2]}")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    print("allow_bf16_reduced_precision_reduction=False")
    for shape in (SHAPES[0], SHAPES[2]):
        print(f"T{shape[0]} H{shape[1]} V{shape[2]}: graph differs "
              f"{differing(*shape, side)[1]} of {shape[0] * shape[2]}")


if __name__ == "__main__":
    main()
