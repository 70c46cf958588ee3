"""Reproducible seeds and bit-exact assertions shared by the whole suite.

A failure must be replayable and say where it is: seeds come from ``zlib.crc32`` of a
string (Python's ``hash()`` of a string changes per process), and a bit-exact assertion
names the seed, how many elements differ, the first differing index and both values with
their bits.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

__all__ = ["assert_same_bits", "gen_of", "same_bits", "seed_of"]

_INT_OF = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float8_e4m3fn: torch.int8,
}


def seed_of(*parts: object) -> int:
    """A stable 32-bit seed from ``parts`` (their ``repr``): the same in every process."""
    return zlib.crc32(repr(parts).encode())


def gen_of(*parts: object) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`seed_of` ``(*parts)``."""
    return torch.Generator().manual_seed(seed_of(*parts))


def _as_tensor(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        if x.dtype == np.uint16:  # BF16 bits, as the NumPy oracles return them
            return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(x))
    return x.detach().cpu().contiguous()


def _bits(t: torch.Tensor) -> torch.Tensor:
    int_t = _INT_OF.get(t.dtype)
    return t.view(int_t) if int_t is not None else t


def same_bits(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal bit patterns, or both NaN (NaN payloads are not specified)."""
    got, want = _as_tensor(got), _as_tensor(want)
    nan = torch.isnan(got) & torch.isnan(want) if got.is_floating_point() else False
    return (_bits(got) == _bits(want)) | nan


def _show(t: torch.Tensor, i: tuple[int, ...]) -> str:
    v = t[i]
    bits = int(_bits(v.reshape(1))[0])
    width = 2 * v.element_size()
    return f"{v.item()!r} (0x{bits & ((1 << (8 * v.element_size())) - 1):0{width}x})"


def assert_same_bits(
    got: torch.Tensor | np.ndarray,
    want: torch.Tensor | np.ndarray,
    *,
    seed: int | None,
    what: str,
) -> None:
    """Assert ``got`` and ``want`` hold the same bits (any NaN matches any NaN).

    Args:
        got: the tensor under test (any device; a NumPy uint16 array is read as BF16 bits).
        want: the oracle's result, same dtype and shape.
        seed: the seed the data came from (``None`` for hand-made data), for the replay.
        what: what is compared (test case, format, path).

    Raises:
        AssertionError: naming ``what``, the seed, the count of differing elements, the
            first differing index, and both values with their bits.
    """
    got, want = _as_tensor(got), _as_tensor(want)
    head = f"{what} (seed {seed})"
    assert got.dtype == want.dtype, f"{head}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{head}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = ~same_bits(got, want)
    if bool(bad.any()):
        where = bad.nonzero()
        i = tuple(where[0].tolist())
        raise AssertionError(
            f"{head}: {len(where)} of {got.numel()} elements differ; first at {i}: "
            f"got {_show(got, i)}, want {_show(want, i)}"
        )
