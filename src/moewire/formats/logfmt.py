"""``logfmt10``: DeepEP's LogFMT-10, the low-latency combine's 10-bit log format.

Read from DeepEP (``deepseek-ai/DeepEP``, ``csrc/kernels/legacy/internode_ll.cu``:
``logfmt_encode``, ``logfmt_check_amaxmin``, ``decode_and_accumulate``; the combine's
``use_logfmt=True``). Each element is a sign bit and a 9-bit code on a log2 grid spanning
its 128-channel block's [log2 amin, log2 amax]; the block's BF16 amax and amin travel as
metadata. A group of blocks that cannot be cast (amax >= 1, a constant magnitude, zeros)
is sent as BF16. (DeepEP's Python docstring says "per-64-channel cast"; the kernel read
here, at commit dd758ca, keeps one (amax, amin) pair per 128 channels and decides the cast
per 512 or 1024 channels.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from moewire.format_table import FORMATS
from moewire.formats._numerics import mul_recip
from moewire.formats.base import WireFormat, register

_DIVISION = FORMATS["logfmt10"].block  # channels sharing one (amax, amin) pair
_NUM_VALUES = 1 << 9  # 9-bit codes; code 0 is zero, codes 1..511 the log grid
_MIN_CLIP = 32.0  # log2 amin >= log2 amax - 32
_LOG_THRESHOLD = 0.0  # cast only blocks with log2 amax < 0, i.e. amax < 1


def cast_group(hidden: int) -> int:
    """Channels per cast decision: one warp's TMA chunk in DeepEP's combine send.

    A warp moves ``32 lanes * kNumSendUnrolls * 8`` BF16 per step, ``kNumSendUnrolls = 4``
    when ``hidden % 1024 == 0`` else 2, and the encoder ANDs the cast condition over the
    whole step (``warp_reduce_and<..., true>``), so 1024 or 512 channels decide together.
    """
    return 1024 if hidden % 1024 == 0 else 512


class LogFMT10(WireFormat):
    """``logfmt10``: DeepEP's LogFMT-10 (the low-latency combine's ``use_logfmt``).

    Math. The input is first rounded to BF16 (the combine reads BF16 rows):
    ``v = x.to(bfloat16)``. Per block ``b`` of 128 channels, with ``a = |v|``::

        amax = max(a), amin = min(a)                # NaN elements ignored (__hmax2/__hmin2)
        la   = log2(amax)
        li   = max(log2(amin), la - 32)
        ok_b = la < 0 and li < la                   # amax < 1 and not a constant magnitude

    A cast group is ``cast_group(H)`` consecutive channels (1024 if ``H % 1024 == 0`` else
    512; a shorter last group when H is not a multiple); the group is cast only if every
    block in it has ``ok_b``, else it is sent, and returned, as BF16 ``v``. In a cast block::

        step = (la - li) * fl64(1/510)              # torch's `/ 510` on CUDA, see below
        r    = 2 - log2((1 + 2^step) / 2) / step    # puts the threshold between two levels
                                                    # at their arithmetic mean
        code = floor(max(log2(a) / step + r - li / step, 0))      # 0 .. 511
        dec  = 0 if code == 0 else 2^((code - 1) * step + li)
        out  = -dec if signbit(x) else dec          # the sign bit, -0.0 included

    and ``out`` is rounded to FP32, then to ``x.dtype``. The formula follows DeepEP's
    expression order (``step_inv = 1/step``, ``fused = r - li * step_inv``,
    ``log2(a) * step_inv + fused``) evaluated in float64 with exact ``log2``/``exp2``.
    DeepEP evaluates it in FP32 with PTX ``lg2.approx``/``ex2.approx``, so on the GPU a
    decoded value can differ in its last FP32 bits and an element within ~1e-6 (relative,
    in the log domain) of a code boundary can land one code away; this reference is the
    exact-math definition, not a bit-copy of those approximations. The one division by a
    constant, ``(la - li) / 510``, is written as torch evaluates it on CUDA, a
    multiplication by the float64 reciprocal ``fl64(1/510)`` (a true division on CPU), so
    the reference computes that step alike on CPU and CUDA; ``1 / step`` is torch's
    ``reciprocal`` (correctly rounded on both). Its float64 ``log2``/``exp2`` come from
    different math libraries on CPU and CUDA (within an ulp or two): that reaches the FP32
    result only for an element within ~1e-14 (relative) of a code boundary or an FP32
    rounding midpoint. DeepEP accumulates the
    decoded FP32 values over the top-k before one BF16 rounding; here each row is rounded
    to ``x.dtype`` on its own (the combine re-sum adds the rows).

    Special values: a block holding ±inf has ``amax = inf`` and its group stays BF16; a
    block of zeros (``amin = amax = 0``) also keeps its group BF16. NaN is ignored by
    amax/amin; in a group that stays BF16 it passes unchanged, in a cast group it encodes
    to code 0 and comes back as a zero with the NaN's sign bit (``fmaxf(NaN, 0) = 0`` in
    DeepEP's encoder).
    Row-local, no amax. Wire: 10 bits per element plus 32 bits (BF16 amax and amin) per
    128 channels when cast; a group that stays BF16 costs 16 bits per element.
    """

    name = "logfmt10"

    def reference(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        import torch

        hidden = x.shape[-1]
        lead = x.shape[:-1]
        num_div = hidden // _DIVISION
        v = x.to(torch.bfloat16).to(torch.float64).reshape(*lead, num_div, _DIVISION)
        a = v.abs()
        nan = torch.isnan(a)
        amax_b = torch.where(nan, torch.zeros_like(a), a).amax(dim=-1, keepdim=True)
        amin_b = torch.where(nan, torch.full_like(a, float("inf")), a).amin(dim=-1, keepdim=True)
        la = torch.log2(amax_b)
        li = torch.maximum(torch.log2(amin_b), la - _MIN_CLIP)
        ok = ((la < _LOG_THRESHOLD) & (li < la)).reshape(*lead, num_div)

        per_group = cast_group(hidden) // _DIVISION
        num_groups = -(-num_div // per_group)
        pad = num_groups * per_group - num_div
        ok = torch.cat([ok, ok.new_ones(*lead, pad)], dim=-1)
        ok = ok.reshape(*lead, num_groups, per_group).all(dim=-1, keepdim=True)
        ok = ok.expand(*lead, num_groups, per_group).reshape(*lead, -1)[..., :num_div]
        ok = ok.unsqueeze(-1)

        # Blocks that are not cast get harmless stand-ins so the log math stays finite.
        la = torch.where(ok, la, torch.full_like(la, -1.0))
        li = torch.where(ok, li, torch.full_like(li, -2.0))
        step = mul_recip(la - li, _NUM_VALUES - 2)
        step_inv = 1.0 / step
        rounding = 2.0 - torch.log2((1.0 + torch.exp2(step)) * 0.5) * step_inv
        fused = rounding - li * step_inv
        t = torch.log2(a) * step_inv + fused
        code = torch.fmax(t, torch.zeros_like(t)).floor()
        decoded = torch.where(code == 0, torch.zeros_like(t), torch.exp2((code - 1) * step + li))
        # The sign comes from x itself: the sign bit of a NaN after a cast to BF16 is not
        # specified (torch's CPU cast of a +NaN gives 0xFFFF).
        negative = torch.signbit(x).reshape(v.shape)
        out = torch.where(ok, torch.where(negative, -decoded, decoded), v)
        return out.to(torch.float32).reshape(x.shape).to(x.dtype)


register(LogFMT10)
