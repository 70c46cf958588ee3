"""The layout check: proof, per buffer, that moewire reads the kernel's combine rows right.

Before the first use of a buffer's rows (buffers are shared by layers, so once per buffer),
the unquantized re-sum must equal ``y`` bit for bit over the tokens with a routed row. An
all-padding batch defers it. Eager: one host sync per call until checked, none after.
Under CUDA-graph capture of an unchecked buffer the comparison is recorded in the graph as
a device-side assert, evaluated on every replay.

The state of a buffer's check lives as long as the buffer object (``SymmBuffer``) and no
longer: it is held in a :class:`weakref.WeakKeyDictionary` keyed by that object, never by
an address, so a new buffer allocated where a freed one was is checked again. (The SM90
build's views are DLPack tensors that share no storage with ``.buffer``: the buffer object
is what owns them all.)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moewire import kernels
from moewire.megamoe import flavours as _flavours
from moewire.megamoe.resum import accumulate_mode, resum

__all__ = ["layout_checked", "reset_layout_checks", "unproven_readings"]


@dataclass
class _BufferCheck:
    generation: int  # reset_layout_checks() forgets every check of an older generation
    graph_warned: bool = False
    checked: bool = False
    # Readings of a fused shared row other than the build's (read from another stored slot,
    # or added at the other end of the sum) that no batch has yet ruled out (None: not
    # started). The buffer is checked once this is empty.
    unrefuted: set[str] | None = None


@dataclass(frozen=True)
class Combine:
    """One kernel call's combine, as the checks and the re-sum read it."""

    # BF16 [k (+1), Tmax, H], the combine region; FP32 [k (+1), T, H] for DeepGEMM's FP8
    # combine rows, dequantized as its reduce reads them (layout.dequantize_fp8_rows)
    rows: torch.Tensor
    topk_idx: torch.Tensor  # int64 [T, k], staged before the kernel ran
    num_tokens: int
    shared: str | None  # where a fused shared row is added (None: none fused)
    weights: torch.Tensor | None  # FP32 [T, k] for a kernel that leaves unweighted rows
    y: torch.Tensor  # the kernel's output
    flavour: _flavours.Flavour
    kernel: str
    # The factor of a kernel that rounds and scales its routed sum before the shared row
    # (resum's routed_scale), or None where that step is the identity or absent
    routed_scale: float | None = None

    def resum(self, rows: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """``resum`` of these rows (or a reordering of them) in this call's order."""
        return resum(
            self.rows if rows is None else rows, self.topk_idx, self.num_tokens,
            shared_position=self.shared, weights=self.weights, routed_scale=self.routed_scale,
            **kwargs,
        )


# One check per live buffer object, gone with its buffer. A buffer object that takes no weak
# reference (a SimpleNamespace) carries its check as an attribute instead.
_CHECKS: weakref.WeakKeyDictionary[Any, _BufferCheck] = weakref.WeakKeyDictionary()
_ATTRIBUTE = "_moewire_layout_check"
_generation = [0]


def buffer_state(symm_buffer: Any) -> _BufferCheck:
    """The check state of ``symm_buffer`` (a new, unchecked one the first time).

    Raises:
        TypeError: the buffer object takes neither a weak reference nor an attribute (a
            class with ``__slots__``): moewire cannot tie a check to its life.
    """
    try:
        state = _CHECKS.get(symm_buffer)
        if state is None:
            state = _CHECKS[symm_buffer] = _BufferCheck(_generation[0])
        return state
    except TypeError:
        pass
    state = getattr(symm_buffer, _ATTRIBUTE, None)
    if state is None or state.generation != _generation[0]:
        state = _BufferCheck(_generation[0])
        try:
            setattr(symm_buffer, _ATTRIBUTE, state)
        except AttributeError as exc:
            raise TypeError(
                f"the Mega-MoE buffer {type(symm_buffer).__qualname__} takes neither a weak "
                "reference nor an attribute, so moewire cannot tie its layout check to the "
                "buffer's life; give the class a __weakref__ slot"
            ) from exc
    return state


def layout_checked(symm_buffer: Any) -> bool:
    """Whether the eager layout check has passed for ``symm_buffer``: the re-sum equals
    ``y`` and, with a fused shared expert, every other reading of the shared row has failed
    on some batch (:func:`unproven_readings` names those still open)."""
    return buffer_state(symm_buffer).checked


def unproven_readings(symm_buffer: Any) -> tuple[str, ...]:
    """The readings of ``symm_buffer``'s fused shared row, other than its build's, that no
    batch has yet told apart from it, e.g. ``("shared row added last", "shared row read
    from slot 2")``; every eager batch is checked again while one is left. Empty before the
    first batch with a routed row, once checked, and without a fused shared expert."""
    return tuple(sorted(buffer_state(symm_buffer).unrefuted or ()))


def reset_layout_checks() -> None:
    """Forget every passed check (tests; a process that swaps its DeepGEMM build)."""
    _CHECKS.clear()
    _generation[0] += 1


def _debug_env_hint() -> str:
    value = os.environ.get("DG_COMM_KERNEL_DEBUG", "")
    if value.strip() not in ("", "0"):
        return (
            f" DG_COMM_KERNEL_DEBUG={value} is set in this process: it zeroes the buffer "
            "after every call, so the rows are gone; unset it."
        )
    return ""

def check_in_one_pass(name: str, quantizer: Any, state: _BufferCheck, call: Combine) -> None:
    """Check and quantize in one pass over the rows (CUDA, the fused kernel).

    The fused kernel re-sums the quantized rows into a scratch output and, in the same
    pass, compares the unquantized re-sum with ``y`` over the compared tokens (as
    :func:`check`), counting mismatching elements on the device. Eager: one host read of
    that count; ``y`` is replaced only when it is 0, and a mismatch is reported by the torch
    check (``y`` is intact), which names the tokens. Inside a CUDA graph capture the count
    feeds a device-side assert, and ``y`` is replaced. The proof of which stored row is the
    shared one still needs its alternative readings (eager, until refuted), as in
    :func:`check`.

    Args:
        name: the layer's name, for errors.
        quantizer: the combine quantizer, in quantize mode with a static scale.
        state: the buffer's check state.
        call: the kernel call's combine, without a ``routed_scale`` step.
    """
    fmt, y = quantizer.fmt, call.y
    out = torch.empty_like(y)
    flag = torch.zeros(1, dtype=torch.int32, device=y.device)
    amax = quantizer.static_amax if fmt.needs_amax else None
    kernels.fused_combine(
        call.rows, call.topk_idx, call.num_tokens, out, fmt.name, amax, call.shared, y,
        flag, weights=call.weights, accumulate=accumulate_mode(quantizer, None),
    )
    if _capturing(y):
        _assert_in_graph(name, state, flag[0] == 0, call.flavour)
        y.copy_(out)
        return
    has_routed, bad = torch.stack(
        [(call.topk_idx[: call.num_tokens] >= 0).any().to(torch.int32), flag[0]]
    ).tolist()
    if has_routed and bad:
        # The torch comparison names the mismatching tokens (and raises).
        _compare(name, state, call)
        raise RuntimeError(
            f"{name}: the fused kernel's layout check counted {bad} "
            "mismatching elements, but the torch check found none: a moewire bug; set "
            "MOEWIRE_DISABLE_KERNELS=1 and report it"
        )
    if has_routed:
        _refute_shared_readings(state, call)
    y.copy_(out)


def check(name: str, state: _BufferCheck, call: Combine) -> None:
    """Unquantized re-sum == ``y`` bit for bit, and proof of which row is which.

    Compared tokens: those with a routed row, and with a fused shared expert every
    token (the kernel gives every token its shared row: ``impls/sm100_*_mega_moe.cuh``,
    lane ``kNumTopk`` is always valid). With a fused shared expert, sums that match
    do not yet say which stored row is the shared one: with every slot valid, reading
    the shared row from another slot adds the same rows, and on ordinary rows adding it
    first or last gives the same FP32 sum. So the buffer is marked checked only once, over
    one or more batches, every other reading has failed to reproduce ``y`` on some token:
    the shared row at slot ``j < k`` with the routed slots shifted past it (refuted by a
    token with an invalid slot, or a padding token with the shared row only), and the
    shared row at the other end of the sum (refuted by rows whose sum shows the order).
    Until then every eager batch is checked again (:func:`unproven_readings` names the
    readings still open).

    Args:
        name: the layer's name, for errors.
        state: the buffer's check state.
        call: the kernel call's combine.
    """
    if _compare(name, state, call):
        _refute_shared_readings(state, call)


def check_shared_pass(
    name: str,
    state: _BufferCheck,
    stored: torch.Tensor,
    y: torch.Tensor,
    flavour: _flavours.Flavour,
    kernel: str,
) -> None:
    """The fused shared expert's own launch (no routed slot) returned the row the build
    stores at slot ``k``, bit for bit: ``y = bf16(+0.0 + float(row))``, the kernel's sum
    of that one row (``-0.0`` becomes ``+0.0``).

    Eager: a mismatch raises (the shared row moewire would put back into the sum is not the
    kernel's). Under CUDA-graph capture: a device-side assert, as :func:`check`. Does not
    mark the buffer: the order of the rows is the next call's check.

    Args:
        name: the layer's name, for errors.
        state: the buffer's check state.
        stored: BF16 ``[T, H]``, the combine region's slot ``k`` after the launch.
        y: BF16 ``[T, H]``, the launch's output.
        flavour: the build the rows were read with.
        kernel: the kernel function.
    """
    expected = (stored.float() + 0.0).to(torch.bfloat16)
    differs = (expected.view(torch.int16) != y.view(torch.int16)).any(dim=1)
    if _capturing(y):
        _assert_in_graph(name, state, ~differs.any(), flavour)
        return
    bad = int(differs.sum())
    if bad:
        raise RuntimeError(
            f"{name}: the Mega-MoE layout check failed: {kernel} launched with no routed slot "
            "(the fused shared expert's own pass, on the original tokens) did not return the "
            f"row kernel flavour {flavour.name!r} reads at slot k ({bad} of {y.shape[0]} "
            f"tokens differ).{_debug_env_hint()} {_layout_causes()}"
        )


def _compare(name: str, state: _BufferCheck, call: Combine) -> bool:
    """The unquantized re-sum against ``y``: raise on a mismatch (eager), or record
    the comparison as a device-side assert (capture). True when an eager batch with a
    routed row matched, i.e. when the buffer may be marked."""
    y = call.y
    expected = call.resum()
    routed = (call.topk_idx[: call.num_tokens] >= 0).any(dim=1)
    compared = routed | (call.shared is not None)
    differs = (expected.view(torch.int16) != y.view(torch.int16)).any(dim=1) & compared
    if _capturing(y):
        _assert_in_graph(name, state, ~differs.any(), call.flavour)
        return False
    has_routed, bad, total = torch.stack(
        [routed.any().long(), differs.sum(), compared.sum()]
    ).tolist()
    if not has_routed:
        return False
    if bad:
        # An earlier batch matched on rows that could not tell these readings apart.
        open_readings = (f" Earlier batches matched this reading but left unproven: "
                         f"{', '.join(sorted(state.unrefuted))}." if state.unrefuted else "")
        raise RuntimeError(
            f"{_layout_failure(name, call)} ({bad} of {total} compared "
            f"tokens differ).{open_readings}{_debug_env_hint()} {_layout_causes()}"
        )
    return True


def _layout_failure(name: str, call: Combine) -> str:
    flavour, kernel, shared = call.flavour, call.kernel, call.shared
    return (
        f"{name}: the Mega-MoE layout check failed: the unquantized re-sum "
        f"of the combine rows of {kernel} read with kernel flavour {flavour.name!r} (combine "
        f"base {flavour.layout(kernel).base_rule}, fused shared row added "
        f"{shared if shared else '- (none fused)'}) does not reproduce the kernel output"
    )


def _assert_in_graph(
    name: str, state: _BufferCheck, ok: torch.Tensor, flavour: _flavours.Flavour
) -> None:
    """Record the layout check in the CUDA graph being captured: a device-side assert."""
    if not state.graph_warned:
        state.graph_warned = True
        warnings.warn(
            f"{name}: the layout check of this Mega-MoE buffer runs inside "
            "the CUDA graph being captured (no eager batch with a routed row came "
            "first); a replay that stops with 'device-side assert triggered' is this "
            f"check failing. {_layout_causes()}",
            stacklevel=3,
        )
    # torch caps a device-assert message at 254 characters; the warning above
    # carries the full explanation.
    short = (
        f"{name}: the Mega-MoE layout check failed (flavour "
        f"{flavour.name!r}); see moewire's capture-time warning"
    )
    torch._assert_async(ok, short[:254])


def _resum_rows(call: Combine, order: list[int]) -> torch.Tensor:
    """The call's re-sum with its stored rows taken in ``order``."""
    return call.resum(call.rows[order])


def _alternative_readings(call: Combine) -> dict[str, Callable[[], torch.Tensor]]:
    """The other readings of a fused shared row, each as its re-sum of this call's rows:
    read from stored slot ``j < k`` (routed slots ``j..`` shifted up by one), and added at
    the other end of the sum. A kernel with a ``routed_scale`` step adds its shared row
    after the rounded routed sum, so the other end is no reading of its rows (resum
    refuses it)."""
    k = call.topk_idx.shape[1]
    readings: dict[str, Callable[[], torch.Tensor]] = {}
    for j in range(k):
        order = [*range(j), *range(j + 1, k + 1), j]
        readings[f"shared row read from slot {j}"] = functools.partial(_resum_rows, call, order)
    if call.routed_scale is None:
        other = "last" if call.shared == "first" else "first"
        readings[f"shared row added {other}"] = (
            lambda: dataclasses.replace(call, shared=other).resum())
    return readings


def _refute_shared_readings(state: _BufferCheck, call: Combine) -> None:
    """After a passing check: mark the buffer checked, or, with a fused shared expert,
    once every other reading of the shared row (:func:`_alternative_readings`) has failed
    to reproduce ``y`` (every token has its shared row, so every token is compared)."""
    if call.shared is not None:
        readings = _alternative_readings(call)
        if state.unrefuted is None:
            state.unrefuted = set(readings)
        for reading in sorted(state.unrefuted):
            alternative = readings[reading]()
            if bool((alternative.view(torch.int16) != call.y.view(torch.int16)).any()):
                state.unrefuted.discard(reading)
        if state.unrefuted:
            return
    state.checked = True


def _layout_causes() -> str:
    return (
        "Likely causes: DG_COMM_KERNEL_DEBUG=1 (it zeroes the buffer after every call); "
        "a DeepGEMM build that changed the combine layout or order; or the wrong flavour "
        f"for this build (registered: {', '.join(_flavours.names())}; set it in the "
        "experts adapter)."
    )


def one_pass(quantizer: Any, y: torch.Tensor) -> bool:
    """Whether the fused kernel can check and quantize this combine in one pass: a CUDA
    output, the kernels available, and a quantizer in quantize mode whose format has a
    kernel (the same conditions under which ``resum`` takes the kernel). A call with a
    ``routed_scale`` step is checked apart (the fused kernel ends at one rounding)."""
    fmt = getattr(quantizer, "fmt", None)
    return (
        y.is_cuda
        and quantizer.mode == "quantize"
        and fmt is not None
        and kernels.available()
        and kernels.supports(fmt.name)
    )


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s work is being recorded into a CUDA graph right now."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
