"""The wire-format interface and its registry.

A wire format says what a number becomes on the wire. Each format is one object with one
reference implementation in plain torch (``reference``) that runs on CPU and CUDA and is the
definition of the format; a fast kernel, where one exists, must equal it bit for bit.

Blocks run along the last dimension: a "row" is ``x[..., :]`` (one token's hidden vector on
the wire), and a block of ``block_size`` consecutive elements of a row shares a scale.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from moewire import format_table
from moewire.format_table import FormatFacts

if TYPE_CHECKING:
    import torch

_T = TypeVar("_T")

# Torch is imported inside the methods, so that the registry and the facts on each format
# (``moewire formats``) load without it. FP16's largest finite value,
# ``torch.finfo(torch.float16).max``:
_FP16_MAX = 65504.0


def amax_is_valid(value: float) -> bool:
    """The one rule for a host amax (a format's, a quantizer's, a saved one): a finite
    number >= 0 (0 takes each format's fallback scale)."""
    return math.isfinite(value) and value >= 0


def _kernel_qdq(
    facts: FormatFacts | None, x: torch.Tensor, amax: torch.Tensor | None
) -> torch.Tensor | None:
    """The fast kernel's result, or ``None`` when no usable kernel exists for the format
    whose row is ``facts`` (``None``: a format outside the table, which has no kernel).

    ``moewire.kernels`` may be missing or partial (no Triton, an older build): only an
    ImportError or a missing attribute means "no kernel"; an error raised by a kernel
    itself propagates.
    """
    if facts is None:
        return None
    try:
        from moewire import kernels

        available, supports, qdq = kernels.available, kernels.supports, kernels.qdq
    except (ImportError, AttributeError):
        return None
    if available() and supports(facts):
        out: torch.Tensor = qdq(x, facts, amax)
        return out
    return None


class _Fact(Generic[_T]):
    """A fact of a format, read from its row of ``moewire.format_table.FORMATS``.

    A format outside the table (one registered at runtime, a plugin's) has no row: it sets
    its facts as class attributes, and ``default`` stands for each fact it does not set.
    """

    def __init__(self, default: _T) -> None:
        self.default = default
        self.field = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = name

    @overload
    def __get__(self, fmt: None, owner: type | None = None) -> _Fact[_T]: ...

    @overload
    def __get__(self, fmt: WireFormat, owner: type | None = None) -> _T: ...

    def __get__(self, fmt: WireFormat | None, owner: type | None = None) -> _T | _Fact[_T]:
        if fmt is None:
            return self
        row = format_table.find(fmt.name)
        value: _T = self.default if row is None else getattr(row, self.field)
        return value


@dataclass(frozen=True)
class ModelOptSpelling:
    """How ModelOpt's quantizer attributes name a format (``moewire.quantizer`` reads them back).

    The block size is the format's own ``block_size``; ModelOpt writes it as
    ``block_sizes={-1: block_size, "type": "dynamic", "scale_bits": scale_bits}``.

    Attributes:
        num_bits: (exponent bits, mantissa bits) of an element: ``(4, 3)`` E4M3, ``(2, 1)`` E2M1.
        scale_bits: the block scale's pair (``(4, 3)`` E4M3, ``(8, 0)`` UE8M0), or ``None``
            for an FP32 block scale or no block scale.
        axis: ModelOpt's ``axis``: ``None`` (one global amax) or ``0`` (one scale per row).
    """

    num_bits: tuple[int, int]
    scale_bits: tuple[int, int] | None = None
    axis: int | None = None


class WireFormat:
    """One low-precision wire format.

    The facts below are the format's row of ``moewire.format_table.FORMATS`` (its
    :attr:`facts`): a format class states its name, its ModelOpt spelling and its math, and
    no fact of the table a second time. A format registered at runtime without a row (a
    plugin's) sets its facts as class attributes instead, and has no kernel.

    Attributes:
        name: registry name (``"nvfp4"``).
        element_bits: bits per element on the wire.
        block_size: elements per block scale along the last dim, or ``None`` if the format
            has no block scale (per-tensor or per-row scale only).
        scale_bits: bits of each block scale on the wire (0 without block scales).
        needs_amax: the scale needs a global amax (per-tensor scale, as ModelOpt's static
            FP8 or NVFP4's global scale): ``qdq`` refuses ``amax=None``.
        row_local: every scale of a row depends on that row alone, so two ranks that
            quantize the same row agree whatever else they hold. A format that needs an
            amax is row-local only once that amax is fixed (calibrated or constant).
        row_scale_bits: extra bits per row for a per-row scale (``nvfp4_token``), else 0.
        modelopt_spelling: the ModelOpt attributes that name the format, or ``None`` when
            ModelOpt has none (a cfg then names it with ``format``); see :meth:`modelopt_cfg`.
        combine_accumulate: how the real kernel that ships this format adds the dequantized
            combine rows (:data:`ACCUMULATE_MODES`): ``"bf16"``, each row rounded to BF16
            before the FP32 sum (ModelOpt's fake-quant semantics, QDQ then sum), or
            ``"fp32"``, the FP32 dequantized values summed as they are (the real FP8/FP4
            combine kernels). A quantizer takes it as its default ``accumulate``.
    """

    name: str = ""
    element_bits = _Fact[float](16)
    block_size = _Fact[int | None](None)
    scale_bits = _Fact[int](0)
    needs_amax = _Fact[bool](False)
    row_local = _Fact[bool](True)
    row_scale_bits = _Fact[int](0)
    modelopt_spelling: ModelOptSpelling | None = None
    combine_accumulate = _Fact[str]("bf16")

    @property
    def facts(self) -> FormatFacts | None:
        """The format's row of ``moewire.format_table.FORMATS`` (the kernels take it), or
        ``None`` for a format registered at runtime without a row (it has no kernel)."""
        return format_table.find(self.name)

    def reference(self, x: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor:
        """The definition: plain torch, CPU and CUDA.

        Args:
            x: BF16/FP16/FP32 ``[..., H]``, already validated by :meth:`check_input`.
            amax: FP32 ``[]`` on ``x.device`` for formats with ``needs_amax``, else ``None``.

        Returns:
            A new tensor, ``x.dtype`` and ``x.shape``.
        """
        raise NotImplementedError

    def required_amax(self, amax: torch.Tensor | None) -> torch.Tensor:
        """``amax`` for a :meth:`reference` whose format needs one (:meth:`qdq` checked it);
        refuses ``None``, as from a direct call without it."""
        if amax is None:
            raise ValueError(
                f"format {self.name!r}: reference() needs the amax (its scale is global); "
                "pass the FP32 amax tensor, or call qdq(x, amax), which checks it"
            )
        return amax

    def qdq(
        self,
        x: torch.Tensor,
        amax: torch.Tensor | float | None = None,
        *,
        use_kernel: bool = True,
    ) -> torch.Tensor:
        """Fake-quantize ``x`` (quantize, then dequantize) and return it in ``x.dtype``.

        Args:
            x: BF16/FP16/FP32 tensor, any shape with at least one dim; blocks run along the
                last dim, which must be a multiple of ``block_size``.
            amax: the global amax for formats with ``needs_amax`` (a scalar: Python number
                or one-element tensor). Formats without ``needs_amax`` ignore it.
            use_kernel: on CUDA, use ``moewire.kernels`` when it supports the format
                (it equals :meth:`reference` bit for bit); ``False`` forces the reference.

        Returns:
            A new tensor, same shape and dtype as ``x``; ``x`` is never modified.

        FP16 input saturates: a finite FP16 value never comes back as inf. The grids are
        computed in BF16/FP32, whose values near FP16's max (65504) can round above it
        (65504 is 65536 in BF16), so every finite input's result is clamped to
        [-65504, 65504]; NaN and ±inf inputs pass as the format maps them.
        """
        import torch

        x = self.check_input(x)
        amax_t = self.check_amax(amax, x)
        if x.numel() == 0:
            return x.clone()
        out = None
        if use_kernel and x.is_cuda:
            out = _kernel_qdq(self.facts, x, amax_t)
        if out is None:
            out = self.reference(x, amax_t)
        if x.dtype == torch.float16:
            out = torch.where(torch.isfinite(x), out.clamp(-_FP16_MAX, _FP16_MAX), out)
        return out

    def dequantize(self, x: torch.Tensor, amax: torch.Tensor | float | None = None) -> torch.Tensor:
        """The dequantized values before the final cast: FP32 ``[..., H]``.

        Every format computes in FP32 and casts to ``x.dtype`` last, so this is
        :meth:`qdq` of the widened input (the widening is exact). A combine that
        accumulates in FP32 (``combine_accumulate = "fp32"``) adds these values.

        Args:
            x: BF16/FP16/FP32 ``[..., H]``.
            amax: as for :meth:`qdq`.

        Returns:
            A new FP32 tensor of ``x.shape``.
        """
        import torch

        return self.qdq(x.to(torch.float32), amax)

    def wire_bits(self, hidden: int) -> float:
        """Bits one row of ``hidden`` elements occupies on the wire, scales included."""
        blocks = 0 if self.block_size is None else math.ceil(hidden / self.block_size)
        return self.element_bits * hidden + self.scale_bits * blocks + self.row_scale_bits

    def modelopt_cfg(self) -> dict[str, Any] | None:
        """ModelOpt's attributes for this format, a fresh dict, or ``None`` without a spelling.

        ``{"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)},
        "axis": None}`` for ``nvfp4``; ``block_sizes`` is left out for a format without blocks.
        """
        spelling = self.modelopt_spelling
        if spelling is None:
            return None
        cfg: dict[str, Any] = {"num_bits": spelling.num_bits}
        if self.block_size is not None:
            blocks: dict[Any, Any] = {-1: self.block_size, "type": "dynamic"}
            if spelling.scale_bits is not None:
                blocks["scale_bits"] = spelling.scale_bits
            cfg["block_sizes"] = blocks
        cfg["axis"] = spelling.axis
        return cfg

    # -- validation shared by every format ---------------------------------------------

    def check_input(self, x: torch.Tensor) -> torch.Tensor:
        """Refuse what the format cannot take: non-tensors, non-float dtypes, bad shapes."""
        import torch

        if not isinstance(x, torch.Tensor):
            raise TypeError(f"format {self.name!r}: x must be a torch.Tensor, got {type(x)}")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(
                f"format {self.name!r}: x has dtype {x.dtype}; fake quantization takes "
                "bfloat16, float16 or float32 tensors (cast the data first, e.g. x.float())"
            )
        if x.dim() == 0:
            raise ValueError(
                f"format {self.name!r}: x is a 0-d tensor; pass at least one dim "
                "(blocks run along the last dim), e.g. x.reshape(1)"
            )
        if self.block_size is not None and x.shape[-1] % self.block_size != 0:
            raise ValueError(
                f"format {self.name!r}: the last dim of x is {x.shape[-1]}, not a multiple of "
                f"the block size {self.block_size}; pad the rows or pick another format"
            )
        return x

    def check_amax(self, amax: torch.Tensor | float | None, x: torch.Tensor) -> torch.Tensor | None:
        """Validate ``amax`` and return it as FP32 ``[]`` on ``x.device`` (or ``None``).

        Formats without ``needs_amax`` ignore ``amax`` and get ``None``. For the others,
        ``amax=None`` and non-scalars are refused. A value known on the host (Python
        number or CPU tensor) must be finite and >= 0: NaN, inf and negatives are refused;
        0 goes to the format's documented ModelOpt fallback. A CUDA amax is not inspected,
        since reading it would be a host sync (forbidden under CUDA-graph capture); the
        quantizer validates its amax when it is calibrated or loaded.
        """
        import torch

        if not self.needs_amax:
            return None
        if amax is None:
            raise ValueError(
                f"format {self.name!r} needs an amax (its scale is global); pass amax= "
                "from calibration or a constant, e.g. amax=x.abs().amax()"
            )
        if isinstance(amax, bool) or not isinstance(amax, (torch.Tensor, numbers.Real)):
            raise TypeError(
                f"format {self.name!r}: amax must be a number or a one-element tensor, "
                f"got {type(amax).__name__}"
            )
        amax_t = torch.as_tensor(amax).detach()
        if amax_t.numel() != 1:
            raise ValueError(
                f"format {self.name!r}: amax must be a scalar (one element), got shape "
                f"{tuple(amax_t.shape)}; reduce it first, e.g. amax.max()"
            )
        if not (amax_t.is_floating_point()
                or amax_t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64,
                                    torch.uint8)):
            raise TypeError(
                f"format {self.name!r}: amax has dtype {amax_t.dtype}; pass a real number"
            )
        amax_t = amax_t.to(torch.float32).reshape(())
        if amax_t.device.type == "cpu":
            value = float(amax_t)
            if not amax_is_valid(value):
                raise ValueError(
                    f"format {self.name!r}: amax is {value}; it must be finite and >= 0 "
                    "(check the calibration data for NaN/inf, or pass a constant amax)"
                )
        return amax_t.to(x.device)

    def __repr__(self) -> str:
        return f"<WireFormat {self.name}>"


_REGISTRY: dict[str, WireFormat] = {}


def register(fmt: WireFormat | type[WireFormat]) -> WireFormat | type[WireFormat]:
    """Register a format instance (or class, instantiated once) under ``fmt.name``."""
    inst = fmt() if isinstance(fmt, type) else fmt
    if not inst.name:
        raise ValueError("a wire format needs a non-empty name")
    if inst.name in _REGISTRY:
        raise ValueError(f"wire format {inst.name!r} is already registered")
    spelled = inst.modelopt_cfg()
    for other in _REGISTRY.values():
        if spelled is not None and other.modelopt_cfg() == spelled:
            raise ValueError(
                f"wire format {inst.name!r} has the ModelOpt spelling {spelled}, which "
                f"{other.name!r} already has, so a ModelOpt cfg could not tell them apart; "
                "set modelopt_spelling = None on one (a cfg then names it with format:)"
            )
    _REGISTRY[inst.name] = inst
    return fmt


def get(name: str | WireFormat) -> WireFormat:
    """The registered format called ``name`` (a format object is returned as is)."""
    if isinstance(name, WireFormat):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown wire format {name!r}; known formats: {known}") from None


def names() -> list[str]:
    """Names of every registered format, sorted."""
    return sorted(_REGISTRY)


def check_table(
    registered: Mapping[str, WireFormat] | None = None,
    rows: Mapping[str, FormatFacts] | None = None,
) -> None:
    """Refuse a registered format without a row of the format table, or a row without a
    registered format (its torch reference). ``moewire.formats`` calls it once, after
    registering its formats; the arguments default to the registry and the table.

    Raises:
        RuntimeError: naming the format and what to add.
    """
    registered = _REGISTRY if registered is None else registered
    rows = format_table.FORMATS if rows is None else rows
    rowless = sorted(set(registered) - set(rows))
    if rowless:
        raise RuntimeError(
            f"moewire.formats: the wire format(s) {rowless} are registered but have no row in "
            "moewire.format_table; add a FormatFacts row for each to _ROWS there (its element, "
            "block size, scale, amax and accumulation facts; kernel_code=None without a "
            "Triton kernel)"
        )
    unreferenced = sorted(set(rows) - set(registered))
    if unreferenced:
        raise RuntimeError(
            f"moewire.formats: moewire.format_table has row(s) {unreferenced} but no "
            "registered format of that name, so no torch reference defines them; add a "
            "WireFormat subclass with that name and its reference() in a module of "
            "moewire/formats/, register it, and import that module in formats/__init__.py"
        )
