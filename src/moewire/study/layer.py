"""The layer the study quantizes: the stand-in Mega-MoE experts, a shared expert, a router.

One MoE layer is ``y = experts(x, router(x)) + shared(x)``: the router and the (unfused)
shared expert see the unquantized tokens, the routed experts run on the stand-in DeepGEMM
kernel (:class:`moewire.reference.MegaMoEExperts`), and ``moewire.quantize`` attaches the
dispatch and combine quantizers to the experts module. The unquantized reference is the
same module unconverted. Routing is computed once per batch, so every recipe sees the
same ``(topk_weights, topk_ids)``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import Any

import torch
from torch import nn

import moewire
from moewire.recipes import Recipe
from moewire.reference import (
    MegaMoEExperts,
    MegaMoEWeights,
    NVFP4MegaMoEExperts,
    NVFP4MegaMoEWeights,
    SharedExpert,
    make_nvfp4_weights,
)
from moewire.reference import make_weights as reference_make_weights
from moewire.reference.dense import from_dense
from moewire.study.data import LayerWeights, Router, balanced_bias, load_weights, norm_gamma
from moewire.study.settings import NONE, StudyConfig, check_layer_shapes, router_imbalance

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class MoELayer(nn.Module):
    """``experts(x, w, ids, shared_experts=shared)``: vLLM's Mega-MoE call, one layer.

    Attributes:
        experts: a :class:`~moewire.reference.MegaMoEExperts` (converted by
            ``moewire.quantize`` for the quantized runs).
        shared_experts: the unfused shared expert or ``None``; the kernel's caller adds it
            after the combine, on the unquantized tokens.
    """

    def __init__(self, experts: nn.Module, shared_experts: nn.Module | None) -> None:
        super().__init__()
        self.experts = experts
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        """BF16 ``[T, H]``, FP32 ``[T, k]``, int64 ``[T, k]`` -> BF16 ``[T, H]``."""
        return self.experts(x, topk_weights, topk_ids, shared_experts=self.shared_experts)


@dataclass
class StudyLayer:
    """Everything one study needs to build fresh copies of its layer.

    Attributes:
        num_experts, top_k, hidden, intermediate, shared_intermediate: the shapes.
        weights: the kernel-format expert weights (shared by every copy: no duplication).
        shared: the unfused shared expert (shared by every copy) or ``None``.
        router: the :class:`~moewire.study.data.Router`.
        source: where the weights came from.
        max_num_tokens: tokens per call.
        mma, device: kernel MMA type and device.
        router_imbalance: the synthetic router's expected max/mean load, or ``None`` for
            a checkpoint's router.
        norm_gamma: FP32 ``[H]``, the norm weights of the layer's synthetic tokens.
    """

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    shared_intermediate: int
    weights: MegaMoEWeights | NVFP4MegaMoEWeights
    shared: nn.Module | None
    router: Router
    source: str
    max_num_tokens: int
    mma: str
    device: torch.device
    router_imbalance: float | None = None
    norm_gamma: torch.Tensor | None = None

    def fresh(self) -> MoELayer:
        """A new, unconverted layer over the same weights."""
        if self.mma == "fp4xfp4":
            from moewire.reference.fp4_fp4.experts import FP4MegaMoEExperts

            experts: nn.Module = FP4MegaMoEExperts(
                self.num_experts, self.top_k, self.hidden, self.intermediate,
                self.max_num_tokens, weights=self.weights, device=self.device,
            )
        elif self.mma == "nvfp4":
            experts = NVFP4MegaMoEExperts(
                self.num_experts, self.top_k, self.hidden, self.intermediate,
                self.max_num_tokens, weights=self.weights, device=self.device,
            )
        else:
            experts = MegaMoEExperts(
                self.num_experts, self.top_k, self.hidden, self.intermediate,
                self.max_num_tokens, mma_type=self.mma, weights=self.weights,
                device=self.device,
            )
        return MoELayer(experts, self.shared)

    def shapes(self) -> dict[str, Any]:
        return {
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "shared_intermediate": self.shared_intermediate,
            "gating": self.router.gating,
            "mma": self.mma,
            "weights": self.source,
        }


def _shared_from_dense(w1: torch.Tensor, w2: torch.Tensor, device: torch.device) -> nn.Module:
    hidden, inter = w2.shape
    shared = SharedExpert(hidden, inter, device=device)
    with torch.no_grad():
        shared.gate_up_proj.weight.copy_(w1)
        shared.down_proj.weight.copy_(w2)
    return shared


def synthetic_router(num_experts: int, hidden: int, top_k: int, gating: str,
                     imbalance: float, generator: torch.Generator,
                     gamma: torch.Tensor | None = None,
                     device: torch.device | str = "cpu") -> Router:
    """A seeded router: ``weight ~ N(0, 1/H)`` and a selection bias fitted so that the
    hottest expert's expected load is ``imbalance`` x the mean on tokens drawn with the
    norm weights ``gamma`` (:func:`moewire.study.data.balanced_bias`)."""
    weight = (torch.randn(num_experts, hidden, generator=generator) * hidden**-0.5).to(device)
    router = Router(weight, None, top_k, gating)
    router.bias = balanced_bias(router, imbalance, generator, gamma)
    return router


#: Peak bytes per expert weight while the synthetic layer is built, per MMA type: measured
#: with ``make_weights`` at V4-Flash shapes on CPU (fp8xfp4: 8 and 32 experts peaked at 0.47
#: and 1.33 GB, i.e. 1.42 bytes per weight plus 0.18 GB). bf16xbf16 keeps the BF16 weights
#: and their transformed copy (4 bytes per weight) plus one expert's FP32 draw.
# nvfp4: an estimate from what the stand-in keeps (packed E2M1 + E4M3 scales, 0.56 B, and
# its dense FP32 weight cache on CPU, 4 B), not measured.
_BUILD_BYTES_PER_WEIGHT = {"fp8xfp4": 1.42, "bf16xbf16": 4.5, "nvfp4": 4.6, "fp4xfp4": 4.6}
_BUILD_FIXED_BYTES = 0.25e9
#: Tokens per batch above which the CPU run is warned about (each forward pass costs
#: ``2 * T * k * 3 * H * I`` FLOPs; the demo sweep does about 60 of them at T = 128).
_SLOW_TOKENS_CPU = 2048


def _available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None  # not Linux: nothing to check against


def plan_memory(cfg: StudyConfig) -> tuple[float, float | None, int]:
    """Estimate the synthetic layer's peak memory before building it.

    Returns:
        ``(needed bytes, available bytes or None, experts that fit)``; with ``--weights``
        the file decides the size and nothing is estimated (``(0, None, 0)``).
    """
    if cfg.weights is not None:
        return 0.0, None, 0
    preset = cfg.preset
    num_experts = cfg.experts or preset.num_experts
    per_expert = 3 * preset.hidden * preset.intermediate * _BUILD_BYTES_PER_WEIGHT[cfg.mma]
    needed = num_experts * per_expert + _BUILD_FIXED_BYTES
    available = _available_bytes(torch.device(cfg.device))
    fits = 0
    if available is not None:
        fits = max(0, int((0.9 * available - _BUILD_FIXED_BYTES) // per_expert))
        fits -= fits % cfg.ranks
    return needed, available, fits


def check_resources(cfg: StudyConfig) -> str:
    """Refuse a layer that will not fit in memory, before any weight is drawn; warn on a
    token count that will take long on the CPU. Returns a one-line plan for the progress.

    Raises:
        StudyArgumentError: (``--experts``) the estimated peak exceeds 90% of the memory
            available on ``--device``; the message gives both sizes and the ``--experts``
            that fits.
    """
    import warnings

    from moewire.study.errors import StudyArgumentError

    needed, available, fits = plan_memory(cfg)
    experts = cfg.experts or cfg.preset.num_experts
    if available is not None and needed > 0.9 * available:
        hint = (f"pass --experts {fits} (or fewer)" if fits >= cfg.preset.top_k
                else "use a smaller --model")
        raise StudyArgumentError(
            "--experts", f"the {cfg.model} layer with {experts} experts needs about "
            f"{needed / 1e9:.1f} GB while built, and {available / 1e9:.1f} GB are available "
            f"on {cfg.device}; {hint}, or run on a machine with more memory"
        )
    if cfg.device == "cpu" and cfg.tokens > _SLOW_TOKENS_CPU:
        warnings.warn(
            f"--tokens {cfg.tokens} on the CPU: every forward pass routes "
            f"{cfg.tokens * cfg.preset.top_k} token copies through the experts, and the sweep "
            "runs dozens of them; expect a long run (use --device cuda, fewer --tokens, or "
            "fewer formats)",
            RuntimeWarning,
            stacklevel=2,
        )
    plan = f"{experts} experts" if cfg.weights is None else str(cfg.weights)
    if needed:
        plan += f", about {needed / 1e9:.1f} GB"
        if available is not None:
            plan += f" of {available / 1e9:.0f} GB free"
    return plan


#: The synthetic layer is built in this many chunks of experts, each reported to the
#: progress (a full-size layer takes minutes on a CPU: about 2.6 s per V4-Flash expert).
BUILD_CHUNKS = 8


def _concat(parts: list[Any]) -> Any:
    """Expert-major concatenation of chunk tensors, or of ``(values, scales)`` pairs."""
    if isinstance(parts[0], tuple):
        return tuple(torch.cat([p[j] for p in parts]) for j in range(len(parts[0])))
    return torch.cat(parts)


def synthetic_kernel_weights(
    cfg: StudyConfig, num_experts: int, hidden: int, intermediate: int,
    device: torch.device, report: Callable[[int, int], None] = lambda done, total: None,
) -> MegaMoEWeights | NVFP4MegaMoEWeights:
    """The stand-in kernel's seeded weights, built in :data:`BUILD_CHUNKS` chunks of experts.

    :func:`moewire.reference.make_weights` draws expert ``e`` from its own seed and the
    layout transform works expert by expert, so chunks concatenated along the expert dim
    are bit-identical to one call for all experts; chunking only lets the build report
    ``report(experts built, experts total)`` as it goes.
    """
    step = -(-num_experts // BUILD_CHUNKS)
    chunks = []
    report(0, num_experts)
    for first in range(0, num_experts, step):
        ids = range(first, min(first + step, num_experts))
        if cfg.mma == "fp4xfp4":
            from moewire.reference.fp4_fp4.weights import make_fp4_fp4_weights

            chunks.append(make_fp4_fp4_weights(num_experts, hidden, intermediate, experts=ids,
                                               seed=cfg.seed, device=device))
        elif cfg.mma == "nvfp4":
            chunks.append(make_nvfp4_weights(num_experts, hidden, intermediate, experts=ids,
                                             seed=cfg.seed, device=device))
        else:
            chunks.append(reference_make_weights(num_experts, hidden, intermediate,
                                                 experts=ids, mma_type=cfg.mma,
                                                 seed=cfg.seed, device=device))
        report(ids.stop, num_experts)
    if len(chunks) == 1:
        return chunks[0]
    fields = {}
    for name in [f.name for f in dataclass_fields(chunks[0]) if f.name != "experts"]:
        value = getattr(chunks[0], name)
        if isinstance(value, (torch.Tensor, tuple)):
            fields[name] = _concat([getattr(c, name) for c in chunks])
            for c in chunks:  # free each chunk's copy as soon as it is joined
                setattr(c, name, None)
        else:
            fields[name] = value
    return type(chunks[0])(experts=tuple(range(num_experts)), **fields)


#: ``experts(cfg, dense or None, E, H, I)`` -> the layer class's kernel fields.
KernelExperts = Callable[[StudyConfig, "LayerWeights | None", int, int, int], dict[str, Any]]


def build_layer(
    cfg: StudyConfig, generator: torch.Generator,
    report: Callable[[int, int], None] = lambda done, total: None,
    experts: KernelExperts | None = None, layer_cls: type[StudyLayer] | None = None,
) -> StudyLayer:
    """The layer of ``cfg``, on the stand-in kernel or the real one (``--kernel``).

    The one builder of the study: the weights come from ``--weights``/``--layer`` (its
    experts, shared expert and router; a synthetic router when the file has none; the
    preset gives top-k and gating only) or are synthetic and seeded; only the routed
    experts' kernel format depends on ``--kernel``:

    - ``reference``: :func:`synthetic_kernel_weights` (``moewire.reference.make_weights``,
      four input channels of each matrix 16x larger, which the FP4 block scales must
      absorb) or :func:`moewire.reference.dense.from_dense`;
    - ``deepgemm-sm90``: ``experts`` and ``layer_cls``, which
      :func:`moewire.study.real_kernel.build_layer` passes (the real kernel's own weight
      recipe and its symmetric buffer; this module does not import the real kernel's).

    The shared expert (unfused, :class:`~moewire.reference.SharedExpert`, ``num_shared * I``)
    and the router (``weight ~ N(0, 1/H)``, selection bias fitted to
    ``cfg.router_imbalance``, :func:`synthetic_router`) are the same for both kernels.

    Args:
        cfg: the settings.
        generator: seeds the norm weights and the synthetic router (after the weights).
        report: ``report(experts built, experts total)`` while synthetic experts are built.
        experts, layer_cls: another kernel's routed experts and layer class (both or none).

    Raises:
        ValueError: ``cfg.kernel`` is not ``stand-in`` and no ``experts`` are given (the
            stand-in must never stand in for the real kernel silently).
    """
    preset = cfg.preset
    real = experts is not None
    if real != (cfg.kernel != "stand-in") or real != (layer_cls is not None):
        raise ValueError(
            f"build_layer: --kernel {cfg.kernel} needs its own experts and layer class "
            "(moewire.study.real_kernel.build_layer for deepgemm-sm90); the stand-in "
            "kernel takes neither"
        )
    device = torch.device(cfg.device)
    dense: LayerWeights | None = None
    if cfg.weights is not None:
        dense = load_weights(cfg.weights, cfg.layer, preset.top_k)
        num_experts, hidden, inter = dense.num_experts, dense.hidden, dense.intermediate
        shared_inter, source = dense.num_shared_intermediate, dense.source
    else:
        num_experts = cfg.experts or preset.num_experts
        hidden, inter = preset.hidden, preset.intermediate
        shared_inter = preset.num_shared * inter
        source = f"synthetic{'-bf16' if real else ''}(seed={cfg.seed})"
    check_layer_shapes(cfg, num_experts, preset.top_k, hidden, inter)

    extra: dict[str, Any] = {}
    if real:
        extra = experts(cfg, dense, num_experts, hidden, inter)
        weights = None
    elif dense is not None:
        weights = from_dense(dense.w1.to(device), dense.w2.to(device), cfg.mma)
    else:
        weights = synthetic_kernel_weights(cfg, num_experts, hidden, inter, device, report)

    shared = router = None
    if dense is not None:
        if dense.shared_w1 is not None:
            shared = _shared_from_dense(dense.shared_w1, dense.shared_w2, device)
        if dense.router.numel():
            router = Router(dense.router.to(device), None if dense.router_bias is None
                            else dense.router_bias.to(device), preset.top_k, preset.gating)
    elif shared_inter:
        shared = SharedExpert(hidden, shared_inter, seed=cfg.seed, device=device)
    gamma = norm_gamma(hidden, generator)
    imbalance = None
    if router is None:
        imbalance = router_imbalance(cfg, num_experts, preset.top_k)
        router = synthetic_router(num_experts, hidden, preset.top_k, preset.gating,
                                  imbalance, generator, gamma, device)
    cls = layer_cls or StudyLayer
    return cls(
        num_experts, preset.top_k, hidden, inter, shared_inter, weights, shared, router,
        source, cfg.tokens, cfg.mma, device, imbalance, gamma, **extra,
    )


def recipe_for(dispatch: str, combine: str) -> Recipe:
    """The moewire recipe of one dispatch x combine pair (two ModelOpt-style entries).

    ``bf16`` on an axis disables that quantizer (``{"enable": False}``); any other name is
    moewire's ``{"format": name}`` cfg.
    """

    def cfg(fmt: str) -> dict:
        return {"enable": False} if fmt == NONE else {"format": fmt}

    return Recipe.from_entries(
        [
            {"quantizer_name": "*dispatch_quantizer", "cfg": cfg(dispatch)},
            {"quantizer_name": "*combine_quantizer", "cfg": cfg(combine)},
        ],
        name=f"study_{dispatch}_dispatch_{combine}_combine",
    )


def needs_calibration(dispatch: str, combine: str) -> bool:
    """True when a format of the pair has a global scale that calibration fixes.

    Block-scaled formats (MX, ``fp8_b*``, ``nvfp4_token``, ``logfmt10``) compute every scale
    from the row itself, so their calibrated amax is never read; calibrating them would
    cost forward passes and change nothing.
    """
    return any(
        name != NONE and moewire.formats.get(name).needs_amax for name in (dispatch, combine)
    )


@dataclass
class PairRun:
    """The outputs of one quantized run, the scales it used and (on CUDA) its forward time.

    Attributes:
        outputs: BF16 ``[T, H]`` per evaluation batch.
        amax: the calibrated amax of each axis (``None``: not calibrated).
        summary: ``moewire.summary`` of the quantized model.
        added_us: what the quantized forward adds over the unquantized one, microseconds
            per batch (:func:`added_forward_us`), when timed.
    """

    outputs: list[torch.Tensor]
    amax: dict[str, float | None]
    summary: str
    added_us: float | None = None


#: Paired trials of the quantized and the unquantized forward (:func:`added_forward_us`).
_TIMED_TRIALS = 9


def _pass_us(model: nn.Module, evals: list[Batch]) -> float:
    """Microseconds of one pass of ``model`` over ``evals`` per batch (CUDA events)."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for batch in evals:
        model(*batch)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / len(evals)


def added_forward_us(model: nn.Module, reference: nn.Module, evals: list[Batch]) -> float:
    """What the quantized ``model`` adds to one forward over the unquantized ``reference``,
    in microseconds per batch on CUDA: the median over :data:`_TIMED_TRIALS` trials of the
    difference of the two passes timed back to back in the same trial (their order
    alternating), so a drift of the GPU's clock or of the host between trials cancels
    instead of being read as the fake quantization's cost (benchmarks/real_kernel_overhead.py
    measures the same way). One warm-up pass each first."""
    with torch.no_grad():
        for m in (model, reference):
            for batch in evals:
                m(*batch)
        diffs = []
        for trial in range(_TIMED_TRIALS):
            if trial % 2:
                ref = _pass_us(reference, evals)
                quant = _pass_us(model, evals)
            else:
                quant = _pass_us(model, evals)
                ref = _pass_us(reference, evals)
            diffs.append(quant - ref)
    return statistics.median(diffs)


def run_pair(
    layer: StudyLayer,
    dispatch: str,
    combine: str,
    calib: list[Batch],
    evals: list[Batch],
    timed: bool = False,
) -> PairRun:
    """Quantize a fresh copy of ``layer`` with the pair's recipe, calibrate, evaluate.

    Calibration runs ``moewire.quantize(model, recipe, forward_loop)`` over ``calib``
    (only when :func:`needs_calibration`); evaluation runs every batch of ``evals``.
    ``timed`` (CUDA only) also times what the quantized forward adds over a fresh
    unquantized copy (:func:`added_forward_us`).
    """
    model = layer.fresh()

    def forward_loop(m: nn.Module) -> None:
        for batch in calib:
            m(*batch)

    loop = forward_loop if needs_calibration(dispatch, combine) else None
    moewire.quantize(model, recipe_for(dispatch, combine), forward_loop=loop)
    outputs = []
    with torch.no_grad():
        for batch in evals:
            outputs.append(model(*batch))
    amax = {}
    for axis, quantizer in (("dispatch", model.experts.dispatch_quantizer),
                            ("combine", model.experts.combine_quantizer)):
        value = quantizer.static_amax
        amax[axis] = None if value is None else float(value)
    return PairRun(outputs, amax, moewire.summary(model),
                   added_forward_us(model, layer.fresh(), evals) if timed else None)


def reference_outputs(layer: StudyLayer, evals: list[Batch]) -> list[torch.Tensor]:
    """The unquantized layer's outputs (an unconverted copy) on ``evals``."""
    model = layer.fresh()
    with torch.no_grad():
        return [model(*batch) for batch in evals]
