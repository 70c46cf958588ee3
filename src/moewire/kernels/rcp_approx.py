"""The GPU's ``rcp.approx.ftz.f32`` on NVFP4 decode scales of BF16 amaxes, as measured.

FlashInfer's NVFP4 combine encodes with ``rcp.approx.ftz.f32(ds)`` of the decode scale
``ds = fl(a * fl(1/6))`` of a BF16 block amax ``a``. ``ds`` takes one significand per BF16
significand of ``a`` (128), and the instruction's result depends on the significand of its
input alone, so it is the correctly rounded ``fl(1 / ds)`` moved by an offset that depends
on ``a``'s 7 significand bits: one ulp up at :data:`UP_AT`, one ulp down at
:data:`DOWN_AT`, none at the other 112.

Measured on an H100 (sm_90) for every positive normal BF16 ``a`` by
``benchmarks/rcp_approx_table.py`` (``benchmarks/results/rcp-approx/``: 4024 of the 32512
amaxes are moved; the offset is the same at seven exponents from 2^-125 to 2^125 for all
2^23 significands). The torch format (``moewire.formats._numerics``) and the Triton kernels
(``_triton``) both read these tuples. Plain constants: no import.
"""

from __future__ import annotations

UP_AT = (11, 12, 17, 29, 35, 41, 42, 55, 73, 117, 121)
DOWN_AT = (65, 70, 94, 97, 98)
