"""The wire formats' facts, one row per format: what ``formats/`` and ``kernels/`` both read.

A format's facts (its element, block size and scale, whether it needs an amax, how the
real kernel adds its combine rows, which Triton code path runs it) are written once, here.
``moewire.formats`` holds each format's torch reference (the definition of its math) and
reads its facts from its row (``WireFormat.facts``); ``moewire.kernels`` takes the row itself
(a ``FormatFacts``) and branches on ``kernel_code``. Adding a format is one row here, one
file in ``formats/`` and its tests (``docs/architecture.md``, "Adding a wire format").

This module imports nothing (no torch, nothing of moewire): it is the lowest layer, and
``moewire formats`` lists the formats without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "ACCUMULATE_MODES",
    "ELEMENTS",
    "FORMATS",
    "SCALE_KINDS",
    "SHARED_POSITIONS",
    "UNROLL_RULES",
    "FormatFacts",
    "facts",
    "find",
]

#: How a combine adds its dequantized rows: each rounded to BF16 first (ModelOpt's QDQ, then
#: the FP32 sum), or the FP32 dequantized values as they are (the real FP8/FP4 combines).
ACCUMULATE_MODES = ("bf16", "fp32")
#: Where a fused shared row (stored at row ``k`` in every build) is added to the combine sum:
#: not at all, before the routed slots, or after them. The kernels' ``SHARED`` code is the
#: position's index here.
SHARED_POSITIONS = (None, "first", "last")
#: Element types: BF16; OCP FP8 E4M3 (max 448); E4M3 FNUZ (MI300's FP8, max 240, no -0);
#: FP4 E2M1 (max 6); DeepEP's LogFMT-10 (a sign and a 9-bit code on a log grid).
ELEMENTS = ("bf16", "e4m3", "e4m3fnuz", "e2m1", "logfmt10")
#: Scale kinds: ``none``; ``tensor``, one FP32 scale from the global amax; per block of
#: ``block_size`` elements along the last dim: ``block_fp32``, an FP32 scale;
#: ``block_ue8m0``, a power of two (UE8M0); ``block_e4m3``, an E4M3 scale times an FP32
#: global scale from the tensor amax; ``block_e4m3_row``, the same with the global scale
#: of each row from the row's own amax (sent with the row); ``block_bf16``, the block's BF16
#: amax, from which both ends derive the scale; ``block_bf16_range``, the block's BF16 amax
#: and amin (LogFMT's grid).
SCALE_KINDS = ("none", "tensor", "block_fp32", "block_ue8m0", "block_e4m3", "block_e4m3_row",
               "block_bf16", "block_bf16_range")
#: The combine kernel's default slot loop (``moewire.kernels.tuning.unroll`` has the
#: measurements): ``always`` unrolled; ``up_to_k8`` unrolled for k <= 8, rolled above;
#: ``unchecked_up_to_k8`` that, and rolled whenever the layout check runs; ``never``.
UNROLL_RULES = ("always", "up_to_k8", "unchecked_up_to_k8", "never")


@dataclass(frozen=True)
class FormatFacts:
    """One wire format's facts (a row of :data:`FORMATS`).

    Attributes:
        name: the registry name (``moewire.formats.get(name)``).
        kernel_code: the Triton kernels' ``FMT`` code (the branch of
            ``moewire.kernels._triton._qdq`` that computes the format), or ``None`` when no
            kernel exists (the torch reference runs everywhere).
        element: the element type (:data:`ELEMENTS`).
        element_bits: bits per element on the wire.
        block_size: elements per block scale along the last dim, or ``None`` without
            block scales (per-tensor scale, or none).
        scale: the scale kind (:data:`SCALE_KINDS`).
        scale_bits: bits of each block scale on the wire (0 without block scales).
        row_scale_bits: bits per row of a per-row scale (``block_e4m3_row``), else 0.
        needs_amax: the scale needs a global amax (a calibrated or constant one).
        row_local: every scale of a row depends on that row alone (once a needed amax is
            fixed), so two ranks that quantize the same row agree.
        combine_accumulate: how the real kernel that ships the format adds its dequantized
            combine rows (:data:`ACCUMULATE_MODES`).
        split_tile: the kernels hold whole 16-element blocks per thread (the two halves of
            each block loaded apart and joined: ``_triton._tile_cols``); one thread per 16
            columns.
        unroll: the combine kernel's default slot loop (:data:`UNROLL_RULES`).
    """

    name: str
    kernel_code: int | None
    element: str
    element_bits: int
    block_size: int | None
    scale: str
    scale_bits: int
    row_scale_bits: int = 0
    needs_amax: bool = False
    row_local: bool = True
    combine_accumulate: str = "bf16"
    split_tile: bool = False
    unroll: str = "never"

    def __post_init__(self) -> None:
        where = f"moewire.format_table: the row {self.name!r}"
        for field, value, allowed in (
            ("element", self.element, ELEMENTS),
            ("scale", self.scale, SCALE_KINDS),
            ("combine_accumulate", self.combine_accumulate, ACCUMULATE_MODES),
            ("unroll", self.unroll, UNROLL_RULES),
        ):
            if value not in allowed:
                raise ValueError(f"{where} has {field}={value!r}; use one of {allowed}")
        blocked = self.scale.startswith("block_")
        if blocked != (self.block_size is not None) or blocked != (self.scale_bits > 0):
            raise ValueError(
                f"{where} has scale={self.scale!r}, block_size={self.block_size} and "
                f"scale_bits={self.scale_bits}: a block scale kind needs both, the others "
                "neither"
            )
        if (self.scale == "block_e4m3_row") != (self.row_scale_bits > 0):
            raise ValueError(
                f"{where}: row_scale_bits={self.row_scale_bits} goes with the scale kind "
                "'block_e4m3_row' (a scale per row) and only with it"
            )

    @property
    def block(self) -> int:
        """Elements per block scale, 1 without block scales (a block of one element)."""
        return 1 if self.block_size is None else self.block_size

    @property
    def whole_row(self) -> bool:
        """A kernel program holds the whole row: the row's own scale needs all of it."""
        return self.row_scale_bits > 0


_ROWS = (
    FormatFacts("bf16", 0, "bf16", 16, None, "none", 0, unroll="always"),
    FormatFacts("fp8", 1, "e4m3", 8, None, "tensor", 0, needs_amax=True, unroll="up_to_k8"),
    FormatFacts("fp8_b128", 2, "e4m3", 8, 128, "block_fp32", 32, unroll="up_to_k8"),
    FormatFacts("fp8_b128_ue8m0", 3, "e4m3", 8, 128, "block_ue8m0", 8, unroll="up_to_k8"),
    FormatFacts("fp8_b32_ue8m0", 4, "e4m3", 8, 32, "block_ue8m0", 8, unroll="up_to_k8"),
    FormatFacts("mxfp8", 5, "e4m3", 8, 32, "block_ue8m0", 8, unroll="always"),
    FormatFacts("mxfp4", 6, "e2m1", 4, 32, "block_ue8m0", 8, unroll="always"),
    FormatFacts("nvfp4", 7, "e2m1", 4, 16, "block_e4m3", 8, needs_amax=True, split_tile=True,
                unroll="unchecked_up_to_k8"),
    FormatFacts("nvfp4_token", 8, "e2m1", 4, 16, "block_e4m3_row", 8, row_scale_bits=32,
                split_tile=True),
    FormatFacts("deepgemm_fp8_combine", 9, "e4m3", 8, 128, "block_ue8m0", 8,
                combine_accumulate="fp32", unroll="up_to_k8"),
    FormatFacts("trtllm_32e4m3xe8m0", 10, "e4m3", 8, 32, "block_ue8m0", 8,
                combine_accumulate="fp32", unroll="up_to_k8"),
    FormatFacts("te_mxfp8", 11, "e4m3", 8, 32, "block_ue8m0", 8, combine_accumulate="fp32",
                unroll="up_to_k8"),
    FormatFacts("trtllm_16e2m1xbf16", 12, "e2m1", 4, 16, "block_bf16", 16,
                combine_accumulate="fp32", split_tile=True, unroll="unchecked_up_to_k8"),
    FormatFacts("fp8_e4m3fnuz", 13, "e4m3fnuz", 8, None, "tensor", 0, needs_amax=True,
                unroll="up_to_k8"),
    FormatFacts("flashinfer_mxfp8", 14, "e4m3", 8, 32, "block_ue8m0", 8,
                combine_accumulate="fp32", unroll="up_to_k8"),
    FormatFacts("flashinfer_nvfp4", 15, "e2m1", 4, 16, "block_bf16", 16,
                combine_accumulate="fp32", split_tile=True, unroll="unchecked_up_to_k8"),
    # MoRI's blockwise combine scales ceil(H / MORI_FP8_COMBINE_SCALE_DIM) columns a block,
    # the scale dim 56 by default: 128 columns at H = 7168 (DeepSeek-V3/R1, Kimi-K2).
    FormatFacts("mori_fp8_blockwise_fnuz", 16, "e4m3fnuz", 8, 128, "block_fp32", 32,
                combine_accumulate="fp32", unroll="up_to_k8"),
    FormatFacts("mori_fp8_blockwise_ocp", 17, "e4m3", 8, 128, "block_fp32", 32,
                combine_accumulate="fp32", unroll="up_to_k8"),
    FormatFacts("mori_fp8_direct_cast_fnuz", 18, "e4m3fnuz", 8, None, "none", 0,
                combine_accumulate="fp32", unroll="up_to_k8"),
    FormatFacts("mori_fp8_direct_cast_ocp", 19, "e4m3", 8, None, "none", 0,
                combine_accumulate="fp32", unroll="up_to_k8"),
    FormatFacts("logfmt10", None, "logfmt10", 10, 128, "block_bf16_range", 32),
    # AMD's Mega-MoE (FlyDSL, aiter) on MI355 (gfx950): the only FP8 type it compiles for.
    FormatFacts("flydsl_fp8_blockwise_1x32", 20, "e4m3", 8, 32, "block_ue8m0", 8,
                combine_accumulate="fp32", unroll="up_to_k8"),
)


def _table(rows: tuple[FormatFacts, ...]) -> MappingProxyType[str, FormatFacts]:
    """The rows by name; refuses a repeated name or kernel code."""
    names = [r.name for r in rows]
    codes = [str(r.kernel_code) for r in rows if r.kernel_code is not None]
    for what, values in (("name", names), ("kernel_code", codes)):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"moewire.format_table: repeated {what} {repeated}; each row "
                             f"needs its own")
    return MappingProxyType({r.name: r for r in rows})


#: Every wire format's row, by name (read-only).
FORMATS = _table(_ROWS)


def find(name: str) -> FormatFacts | None:
    """The row called ``name``, or ``None`` (a format registered at runtime without one)."""
    return FORMATS.get(name)


def facts(fmt: FormatFacts | str) -> FormatFacts:
    """The row of ``fmt``: a row is returned as is, a name is looked up.

    Raises:
        ValueError: ``fmt`` names no row.
    """
    if isinstance(fmt, FormatFacts):
        return fmt
    row = find(fmt) if isinstance(fmt, str) else None
    if row is None:
        raise ValueError(
            f"moewire.format_table: no row for wire format {fmt!r} (known: "
            f"{', '.join(FORMATS)}); a new format adds its FormatFacts row to _ROWS there"
        )
    return row
