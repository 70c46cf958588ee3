"""The peers the fused kernels are measured against: torch reference, compiled, ModelOpt.

The compile peer is the strongest plain-torch version of the same math: one function per
call (QDQ + re-sum for the combine, QDQ for the dispatch) compiled by Inductor with static
shapes (``dynamic=False``, one compile per shape), ``fullgraph=True`` and
``mode="max-autotune-no-cudagraphs"`` on CUDA (the default mode on CPU, where only the
smoke run uses it). It must give the bits of the eager definition, which the benchmarks
check before they time it (:func:`compile_peer` with ``numerics="auto"``):

- ``"inductor"``: Inductor's own numerics (FMA contraction, Triton's approximate FP32
  division ``div.full``, low-precision casts elided between fused ops). Fastest, but not
  the reference's rounding in general.
- ``"eager"``: :data:`EAGER_NUMERICS`, the Inductor settings that make the compiled code
  round as eager torch does (those of them that this torch has).
- ``"auto"``: ``"inductor"`` if its result equals the reference on the benchmark's check
  inputs, else ``"eager"``; the benchmark records which one it timed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch._inductor

from moewire import formats

CUDA_COMPILE_MODE = "max-autotune-no-cudagraphs"
NUMERICS = ("auto", "inductor", "eager")

# Inductor settings for eager torch's rounding: keep the explicit BF16 round trips and
# contract no mul+add into an FMA (``emulate_precision_casts`` also turns Triton's
# ``enable_fp_fusion`` off), divide with ``div_rn`` rather than the approximate
# ``div.full``, keep FP32 subnormals. Keys this torch lacks are left out (see
# :func:`eager_numerics_options`).
EAGER_NUMERICS = {
    "emulate_precision_casts": True,
    "eager_numerics.division_rounding": True,
    "eager_numerics.disable_ftz": True,
}


def peer_combine(
    rows: torch.Tensor,
    topk_idx: torch.Tensor,
    amax: torch.Tensor | None,
    *,
    fmt: str,
    shared_position: str | None = None,
) -> torch.Tensor:
    """``megamoe.resum(rows, topk_idx, T, shared_position=..., row_quantizer=fmt's
    reference)`` in plain torch, written for one static-shape compile.

    Args:
        rows: BF16 ``[k, T, H]`` (``[k + 1, T, H]`` with the shared row at index ``k``).
        topk_idx: int ``[T, k]``; ``-1`` marks an invalid slot (its row may hold NaN).
        amax: FP32 ``[]`` for ``fp8``/``nvfp4``, else ``None``.
        fmt: a registered format name; shared_position: ``None``, ``"first"``, ``"last"``.

    Returns:
        BF16 ``[T, H]``. The QDQ runs once over all ``k`` routed rows (row-local, so the
        stale rows it also sees change nothing); the sum is ``resum``'s: FP32 from +0, the
        shared row first or last, the valid slots in ascending order, each *selected* in
        with ``torch.where`` (a multiply by a 0/1 mask would let a stale NaN through).
        ``k`` is static, so the loop unrolls into one graph and Inductor fuses it.
    """
    k = topk_idx.shape[1]
    routed = formats.get(fmt).reference(rows[:k], amax)
    valid = (topk_idx >= 0).unsqueeze(-1)
    acc = torch.zeros(rows.shape[1:], dtype=torch.float32, device=rows.device)
    if shared_position == "first":
        acc = acc + rows[k].float()
    for s in range(k):
        acc = torch.where(valid[:, s], acc + routed[s].float(), acc)
    if shared_position == "last":
        acc = acc + rows[k].float()
    # Inductor folds `zeros + x` to `x`, so a sum of -0.0 rows comes out -0.0 where resum's
    # +0.0 start gives +0.0; resum's sum is never -0.0, so every zero becomes +0.0.
    acc = torch.where(acc == 0, torch.zeros_like(acc), acc)
    return acc.to(torch.bfloat16)


def peer_qdq(x: torch.Tensor, amax: torch.Tensor | None, *, fmt: str) -> torch.Tensor:
    """The dispatch peer: ``fmt``'s torch reference of ``x`` (``[..., H]``)."""
    return formats.get(fmt).reference(x, amax)


def default_mode(device_type: str) -> str:
    """``max-autotune-no-cudagraphs`` on CUDA; Inductor's default elsewhere (fast compile)."""
    return CUDA_COMPILE_MODE if device_type == "cuda" else "default"


def eager_numerics_options() -> dict[str, bool]:
    """:data:`EAGER_NUMERICS` restricted to the settings this torch's Inductor has."""
    cfg = torch._inductor.config
    have = {}
    for key, value in EAGER_NUMERICS.items():
        node = cfg
        try:
            for part in key.split("."):
                node = getattr(node, part)
        except AttributeError:
            continue
        have[key] = value
    return have


def compile_peer(fn: Callable, mode: str, numerics: str) -> Callable:
    """``torch.compile(fn)`` with static shapes, one graph, ``mode``'s Inductor options and,
    for ``numerics="eager"``, :func:`eager_numerics_options` (``numerics="inductor"``:
    none). ``torch.compile`` takes either a mode or options, so the mode goes in as its
    options (``torch._inductor.list_mode_options``)."""
    if numerics not in ("inductor", "eager"):
        raise ValueError(
            f"compile_peer: numerics must be 'inductor' or 'eager' ('auto' is resolved by "
            f"check_compiled), got {numerics!r}"
        )
    options = dict(torch._inductor.list_mode_options(mode))
    if numerics == "eager":
        options.update(eager_numerics_options())
    return torch.compile(fn, dynamic=False, fullgraph=True, options=options)


def differing(got: torch.Tensor, want: torch.Tensor) -> int:
    """How many values of two tensors of one shape differ in their bits."""
    bits = torch.int16 if got.element_size() == 2 else torch.int32
    return int((got.view(bits) != want.view(bits)).sum())


def check_compiled(
    fn: Callable,
    mode: str,
    numerics: str,
    cases: list[tuple[tuple, torch.Tensor]],
    label: str,
) -> tuple[Callable, dict]:
    """Compile ``fn`` and compare it bit for bit with the reference on every check case.

    Args:
        fn: the peer (``functools.partial`` of :func:`peer_combine` or :func:`peer_qdq`).
        mode: the ``torch.compile`` mode; numerics: one of :data:`NUMERICS`.
        cases: ``(args, want)``: ``fn(*args)`` must equal ``want`` bitwise. Every case must
            have the shapes of the timed call (one static compile serves all).
        label: names the peer in the warning printed on a mismatch.

    Returns:
        The compiled function that was checked last, and its record:
        ``compile_numerics`` (what it was compiled with), ``compile_exact`` (every case
        equal), ``compile_mismatch`` (differing values, per case, of the last one tried)
        and, when ``auto`` fell back, ``compile_inductor_mismatch`` (the same for Inductor's
        own numerics).
    """
    if numerics not in NUMERICS:
        raise ValueError(f"check_compiled: numerics must be one of {NUMERICS}, got {numerics!r}")
    record: dict = {"compile_mode": mode}
    for tried in ("inductor", "eager") if numerics == "auto" else (numerics,):
        if tried == "eager" and numerics == "auto":
            record["compile_inductor_mismatch"] = record["compile_mismatch"]
            print(f"NOTE {label}: torch.compile with Inductor's own numerics differs from the "
                  f"reference in {record['compile_mismatch']} values (per check case); "
                  f"recompiling with eager numerics {eager_numerics_options()}", flush=True)
        torch._dynamo.reset()
        comp = compile_peer(fn, mode, tried)
        mismatch = [differing(comp(*args), want) for args, want in cases]
        record.update(compile_numerics=tried, compile_mismatch=mismatch,
                      compile_exact=not any(mismatch))
        if record["compile_exact"]:
            break
    if not record["compile_exact"]:
        print(f"WARNING {label}: the compiled peer is NOT bit-exact to the reference "
              f"({record['compile_mismatch']} differing values per check case, numerics "
              f"{record['compile_numerics']}); its time is of different arithmetic",
              flush=True)
    return comp, record


def time_compiled(
    r: dict,
    fn: Callable,
    mode: str,
    numerics: str,
    cases: list[tuple[tuple, torch.Tensor]],
    label: str,
    time_it: Callable[[Callable], float],
) -> None:
    """:func:`check_compiled`, then ``r["compile_us"] = time_it(compiled)``; the check's
    record goes into ``r``. A peer that fails to compile or run is recorded in
    ``r["compile_error"]`` and warned about, and the sweep goes on."""
    try:
        comp, record = check_compiled(fn, mode, numerics, cases, label)
        r.update(record)
        r["compile_us"] = time_it(comp)
    except Exception as exc:
        r["compile_error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"WARNING {label}: {r['compile_error']}", flush=True)


def stale_nan_case(
    rows: torch.Tensor, topk_idx: torch.Tensor, every: int = 5
) -> tuple[torch.Tensor, torch.Tensor]:
    """A check input of the same shapes: every ``every``-th (token, slot) made invalid
    (``-1``) and its row filled with NaN, as a stale row of the combine buffer may be.

    Args:
        rows: BF16 ``[k, T, H]``; topk_idx: int ``[T, k]``.

    Returns:
        New ``(rows, topk_idx)``; the inputs are not changed.
    """
    k, t = topk_idx.shape[1], topk_idx.shape[0]
    stale = (torch.arange(t * k, device=rows.device).reshape(t, k) % every) == 0
    idx = torch.where(stale, torch.full_like(topk_idx, -1), topk_idx)
    nan_rows = rows.clone()
    nan_rows[:k][stale.t()] = float("nan")
    return nan_rows, idx


def reference_quant(fmt: str, amax: torch.Tensor | None) -> Callable:
    ref = formats.get(fmt)
    return lambda x: ref.reference(x, amax)


def combine_peer(fmt: str, shared_position: str | None = None) -> Callable:
    """:func:`peer_combine` for one format, ready for :func:`check_compiled`."""
    return functools.partial(peer_combine, fmt=fmt, shared_position=shared_position)


def qdq_peer(fmt: str) -> Callable:
    """:func:`peer_qdq` for one format, ready for :func:`check_compiled`."""
    return functools.partial(peer_qdq, fmt=fmt)


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
