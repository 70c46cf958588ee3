"""The same attention inputs for eval's eager and captured forwards (:func:`unpacked_windows`).

What transformers 5.23.0 does (``masking_utils.py``): ``_preprocess_mask_arguments`` asks
``find_packed_sequence_indices(position_ids)`` whether a batch row packs several sequences
whenever ``attention_mask`` is ``None`` and there is no cache -- always so in eval's
forwards, whose models make ``position_ids = arange(T)[None]`` themselves. The probe answers
``None`` (not packed) only after reading the positions on the host, which it skips when
``utils/import_utils.is_tracing()`` is true, and ``is_tracing`` counts CUDA stream capture.
So under capture it returns the packed-sequence ids unread, ``create_causal_mask`` turns
``allow_is_causal_skip`` off and builds a boolean ``[1, 1, T, T]`` mask, and SDPA runs another
kernel (``attn_mask=mask, is_causal=False``) than the eager forward's
(``attn_mask=None, is_causal=True``): logits one BF16 ulp apart in some windows.

Eval's windows are one sequence each, positions ``0..T-1`` (:mod:`moewire.eval.plan`), never
packed: inside :func:`unpacked_windows` the probe says so without reading anything, eagerly
and under capture alike, and both forwards call SDPA with ``is_causal=True``. A sliding-window
layer whose window is shorter than ``T`` still gets its materialised mask, in both modes
(``_ignore_causal_mask_sdpa`` refuses the skip on the window's size, not on tracing).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from moewire import patches

__all__ = ["unpacked_windows"]


def _not_packed(position_ids: torch.Tensor) -> None:
    """``find_packed_sequence_indices`` for eval's windows: one sequence per row."""
    return None


@contextmanager
def unpacked_windows() -> Iterator[None]:
    """Inside the block, transformers' packed-sequence probe answers "not packed" without
    reading the positions (the module docstring says why); the probe is restored on exit,
    error or not. Without transformers, or a transformers without the probe, it changes
    nothing (the GPU tier's graphed/eager comparison and the first window's check in
    :class:`moewire.eval.graphs.WindowGraphs` still guard the numbers)."""
    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    if getattr(masking_utils, "find_packed_sequence_indices", None) is None:
        yield
        return
    with patches.patched_attr(masking_utils, "find_packed_sequence_indices", _not_packed):
        yield
