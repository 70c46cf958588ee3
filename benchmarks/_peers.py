"""The peers the fused kernels are measured against: torch reference, compiled, ModelOpt."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from moewire import formats


def torch_resum(rows: torch.Tensor, topk_idx: torch.Tensor, quant: Callable) -> torch.Tensor:
    """``megamoe.resum``'s torch path for ``rows`` BF16 [k, T, H] (no shared slot, T = Tmax).

    The same operations in the same order as ``resum`` (select, never multiply), written
    without its argument checks so that ``torch.compile(dynamic=True)`` traces one graph
    for every T and H; ``gpu_check`` asserts it equals ``resum`` bit for bit.
    """
    routed = quant(rows)
    valid = (topk_idx >= 0).unsqueeze(-1)
    acc = torch.zeros(rows.shape[1:], dtype=torch.float32, device=rows.device)
    for s in range(routed.shape[0]):
        acc = torch.where(valid[:, s], acc + routed[s].float(), acc)
    return acc.to(torch.bfloat16)


def reference_quant(fmt: str, amax: torch.Tensor | None) -> Callable:
    ref = formats.get(fmt)
    return lambda x: ref.reference(x, amax)


def _resum_fmt(rows, topk_idx, amax, fmt):
    return torch_resum(rows, topk_idx, reference_quant(fmt, amax))


@functools.cache
def compiled_resum(fmt: str) -> Callable:
    """``torch_resum`` with ``fmt``'s reference, compiled once per format (symbolic T, H)."""
    return torch.compile(functools.partial(_resum_fmt, fmt=fmt), dynamic=True)


@functools.cache
def compiled_qdq(fmt: str) -> Callable:
    return torch.compile(formats.get(fmt).reference, dynamic=True)


def modelopt_quantizer(fmt: str, amax: torch.Tensor) -> tuple[Callable | None, str]:
    """ModelOpt's ``TensorQuantizer`` for ``nvfp4``/``fp8`` with a static amax, or the
    reason it cannot be built here (``(None, why)``)."""
    try:
        from modelopt.torch.quantization.config import QuantizerAttributeConfig
        from modelopt.torch.quantization.nn import TensorQuantizer

        import modelopt
    except Exception as exc:  # any import failure is a reason to report, not a crash
        return None, f"modelopt not importable: {type(exc).__name__}: {exc}"
    if fmt == "nvfp4":
        cfg = QuantizerAttributeConfig(
            num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}
        )
    elif fmt == "fp8":
        cfg = QuantizerAttributeConfig(num_bits=(4, 3), axis=None)
    else:
        return None, f"no ModelOpt counterpart for {fmt}"
    try:
        tq = TensorQuantizer(cfg).to(amax.device)
        tq.amax = amax.clone()
        tq.eval()
    except Exception as exc:
        return None, f"TensorQuantizer setup failed: {type(exc).__name__}: {exc}"
    return tq, f"modelopt {modelopt.__version__}"
