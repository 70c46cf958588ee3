"""The settings of one study (the CLI flags), and their validation.

Not to be confused with :mod:`moewire.quantizer.config`, which parses ModelOpt-style quantizer cfgs.

Every check raises :class:`~moewire.study.errors.StudyArgumentError` naming the flag, the
cause and the fix; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# torch and moewire.formats are imported inside the checks that need them, so that the
# CLI parses its flags (and answers --help) without importing torch.
from moewire.reference.catalogue import SM90, STAND_IN, builds, mma_types
from moewire.study.errors import StudyArgumentError
from moewire.study.paths import writable_dir
from moewire.study.presets import DEFAULT_MODEL, PRESETS, ModelPreset

#: The ``schema`` of the results.json a study writes (and ``--from`` reads).
SCHEMA = "moewire.study/2"
#: The name of "no quantizer" on either axis (the baseline row and column).
NONE = "bf16"
_NONE_ALIASES = {"bf16", "none"}
DEFAULT_DISPATCH = ("fp8", "mxfp8", "nvfp4", "mxfp4")
#: The combine column: moewire's formats, then the real kernels' combines (DeepGEMM's FP8
#: combine, TensorRT-LLM's 32e4m3xe8m0 and 16e2m1xbf16, TransformerEngine's MXFP8,
#: FlashInfer's NVFP4 and MoRI's blockwise FP8 on MI300), each with its kernel's FP32
#: accumulation (docs/formats.md). The other shipped combines (FlashInfer's MXFP8, MoRI's
#: direct cast and MI355 modes) are one --combine away; by default they would add pairs
#: that equal a listed one on most layers (flashinfer_mxfp8 is te_mxfp8 but for tiny blocks).
DEFAULT_COMBINE = ("fp8", "mxfp8", "nvfp4", "logfmt10", "deepgemm_fp8_combine",
                   "trtllm_32e4m3xe8m0", "trtllm_16e2m1xbf16", "te_mxfp8", "flashinfer_nvfp4",
                   "mori_fp8_blockwise_fnuz")
#: ``--mma``: the stand-in's builds the study offers (``moewire.reference.catalogue``).
MMA_TYPES = mma_types(STAND_IN, "study")
#: The synthetic router's default hottest-expert load over the mean (DeepSeek's
#: bias-balanced routing keeps it at a few x).
DEFAULT_ROUTER_IMBALANCE = 2.5
#: ``--kernel``: the stand-in (any device) or a real build (moewire.study.real_kernel); the
#: same names as ``moewire eval --kernel``.
KERNELS = ("stand-in", "deepgemm-sm90")
#: Former ``--kernel`` names (old -> current), accepted by the CLI with a deprecation notice.
KERNEL_ALIASES = {"reference": "stand-in"}
# What H and I must be multiples of for each stand-in build (the catalogue is torch-free, so
# the CLI checks flags before torch loads).
_HIDDEN_MULTIPLE = {b.mma_type: b.hidden_multiple for b in builds(STAND_IN, "study")}


@dataclass(frozen=True)
class StudyConfig:
    """What ``moewire study`` runs (the CLI flags, one field each).

    Attributes:
        model: preset name (:data:`~moewire.study.presets.PRESETS`).
        experts: routed experts, overriding the preset's (``None``: the preset's).
        tokens: tokens per batch, over all simulated EP ranks.
        ranks: simulated EP ranks ``R`` (experts and tokens split evenly).
        dispatch, combine: the formats of each axis, ``bf16`` (no quantizer) first.
        calib_batches, eval_batches: calibration and held-out evaluation batches.
        weights, layer: a safetensors checkpoint and the layer index to read from it.
        activations: captured hidden states ``[N, H]`` (``.pt`` / ``.safetensors``).
        mma: the stand-in kernel's MMA type, ``fp8xfp4`` (FP8 staging, FP4 weights, as
            DeepSeek-V4 serves), ``bf16xbf16``, ``nvfp4`` (the NVFP4 Mega-MoE of vLLM
            0.33/0.34: per-token NVFP4 staging, NVFP4 weights, unweighted combine rows), or
            ``fp4xfp4`` (DeepGEMM 2.8.0's NVFP4 x NVFP4 ``fp4_fp4_mega_moe``, as vLLM main
            serves DeepSeek V3.2 / GLM-5.2 NVFP4: NVFP4 staging per 16 without a global
            scale, NVFP4 weights with per-expert global scales, router-weighted combine rows).
        device: ``cpu`` or ``cuda``.
        seed: seeds weights, router and synthetic tokens.
        out: output directory.
        router_imbalance: the synthetic router's hottest-expert expected load over the
            mean (its selection bias is fitted to it); ``None``:
            :data:`DEFAULT_ROUTER_IMBALANCE`, or ``E / k`` when fewer experts cannot carry
            it. A checkpoint's router is used as is.
        kernel: ``stand-in`` (the stand-in kernel) or ``deepgemm-sm90`` (DeepGEMM's real
            SM90 Mega-MoE kernel on a Hopper GPU, :mod:`moewire.study.real_kernel`).
        interconnect: the time estimate's profile (:data:`moewire.study.comm.INTERCONNECTS`).
        ep_size: the EP size of the time estimate; ``None``: :func:`default_ep_size` (8,
            one NVLink node; 16 on ``rdma-cx7``), or the largest divisor of the expert and
            token counts below it.
        ep_tokens: tokens per rank of the time estimate; ``None``: ``tokens / ranks``.
        link_gbps, link_latency_us: override the profile's bandwidth (GB/s per GPU, every
            EP size, both directions) and latency (us).
    """

    model: str = DEFAULT_MODEL
    experts: int | None = None
    tokens: int = 128
    ranks: int = 1
    dispatch: tuple[str, ...] = (NONE, *DEFAULT_DISPATCH)
    combine: tuple[str, ...] = (NONE, *DEFAULT_COMBINE)
    calib_batches: int = 2
    eval_batches: int = 2
    weights: str | None = None
    layer: int | None = None
    activations: str | None = None
    mma: str = "fp8xfp4"
    device: str = "cpu"
    seed: int = 0
    out: str = "moewire-study"
    router_imbalance: float | None = None
    kernel: str = "stand-in"
    interconnect: str = "nvlink-h200"
    ep_size: int | None = None
    ep_tokens: int | None = None
    link_gbps: float | None = None
    link_latency_us: float | None = None

    @property
    def preset(self) -> ModelPreset:
        return PRESETS[self.model]

    @property
    def tokens_per_rank(self) -> int:
        return self.tokens // self.ranks

    def as_dict(self) -> dict:
        d = asdict(self)
        d["dispatch"] = list(self.dispatch)
        d["combine"] = list(self.combine)
        return d


def parse_formats(text: str | list[str] | tuple[str, ...], argument: str) -> tuple[str, ...]:
    """``"fp8,nvfp4"`` -> ``("bf16", "fp8", "nvfp4")``: registered names, ``bf16`` first.

    ``none`` is an alias of ``bf16``; duplicates are dropped, the order is kept.
    """
    from moewire import formats

    parts = text.split(",") if isinstance(text, str) else list(text)
    names = [p.strip().lower() for p in parts if p.strip()]
    if not names:
        raise StudyArgumentError(
            argument, f"the list is empty ({text!r}); name at least one format, e.g. "
            f"{argument} fp8,nvfp4 (bf16 alone: {argument} bf16)"
        )
    known = formats.names()
    out = [NONE]
    for name in names:
        name = NONE if name in _NONE_ALIASES else name
        if name not in known:
            raise StudyArgumentError(
                argument, f"unknown wire format {name!r}; pick from {', '.join(known)} "
                "(comma-separated, e.g. fp8,nvfp4; `moewire formats` lists them)"
            )
        if name not in out:
            out.append(name)
    return tuple(out)


def _positive(value: object, argument: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise StudyArgumentError(
            argument, f"must be an integer >= {minimum}, got {value!r}"
        )
    return value


def _one_of(value: str, known: Collection[str], argument: str, what: str) -> None:
    if value in KERNEL_ALIASES and what == "kernel":
        raise StudyArgumentError(
            argument, f"{value!r} is now called {KERNEL_ALIASES[value]!r}; pass "
            f"kernel={KERNEL_ALIASES[value]!r}"
        )
    if value not in known:
        raise StudyArgumentError(
            argument, f"unknown {what} {value!r}; pick one of {', '.join(known)}"
        )


def validate(cfg: StudyConfig) -> StudyConfig:
    """Check every setting that can be checked before data is read; returns ``cfg``.

    Shapes that come from files (``--weights``, ``--activations``) are checked when the
    files are read (:mod:`moewire.study.data`).
    """
    _one_of(cfg.model, PRESETS, "--model", "model")
    _positive(cfg.tokens, "--tokens")
    _positive(cfg.ranks, "--ranks")
    _positive(cfg.calib_batches, "--calib-batches")
    _positive(cfg.eval_batches, "--eval-batches")
    _positive(cfg.seed, "--seed", minimum=0)
    if cfg.experts is not None:
        _positive(cfg.experts, "--experts")
    if cfg.tokens % cfg.ranks:
        raise StudyArgumentError(
            "--tokens", f"{cfg.tokens} tokens do not split evenly over --ranks {cfg.ranks}; "
            f"use a multiple of {cfg.ranks}"
        )
    _one_of(cfg.mma, MMA_TYPES, "--mma", "MMA type")
    imbalance = cfg.router_imbalance
    if imbalance is not None and (isinstance(imbalance, bool)
                                  or not isinstance(imbalance, (int, float))
                                  or not 1.0 <= imbalance <= 1e6):
        raise StudyArgumentError(
            "--router-imbalance", f"must be a number >= 1 (1 = every expert equally loaded; "
            f"DeepSeek-like routing is 2-3), got {imbalance!r}"
        )
    _one_of(cfg.kernel, KERNELS, "--kernel", "kernel")
    if cfg.device not in ("cpu", "cuda"):
        raise StudyArgumentError("--device", f"must be cpu or cuda, got {cfg.device!r}")
    check_kernel_flags(cfg)
    check_comm_flags(cfg)
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise StudyArgumentError(
            "--device", "cuda was asked for but torch sees no CUDA device; use --device cpu"
        )
    if (cfg.weights is None) != (cfg.layer is None):
        missing = "--layer" if cfg.layer is None else "--weights"
        raise StudyArgumentError(
            missing, "--weights and --layer go together: pass the checkpoint and the index "
            "L of the layer to read (model.layers.L.mlp.experts...)"
        )
    if cfg.layer is not None:
        _positive(cfg.layer, "--layer", minimum=0)
    if cfg.weights is None:  # the shapes are known now: refuse before the layer is built
        _check_top_k(cfg.experts or cfg.preset.num_experts, cfg.preset.top_k)
        _check_imbalance(cfg, cfg.experts or cfg.preset.num_experts, cfg.preset.top_k)
    if cfg.weights is not None and cfg.experts is not None:
        raise StudyArgumentError(
            "--experts", "a --weights checkpoint fixes the expert count (every expert of the "
            "layer is read); drop --experts"
        )
    for argument, path in (("--weights", cfg.weights), ("--activations", cfg.activations)):
        if path is not None and not Path(path).is_file():
            raise StudyArgumentError(
                argument, f"{path} does not exist or is not a file; check the path"
            )
    for argument, names in (("--dispatch", cfg.dispatch), ("--combine", cfg.combine)):
        parse_formats(list(names), argument)
        if not names or names[0] != NONE:
            raise StudyArgumentError(
                argument, "the list must start with bf16 (the baseline); use parse_formats"
            )
    return cfg


def check_kernel_flags(cfg: StudyConfig) -> None:
    """Flags that contradict ``--kernel deepgemm-sm90``, refused before anything loads."""
    if cfg.kernel != "deepgemm-sm90":
        return
    if cfg.mma not in mma_types(SM90, "study"):
        raise StudyArgumentError(
            "--mma", f"--kernel deepgemm-sm90 runs FP8 x FP4 (fp8_fp4_mega_moe); {cfg.mma} "
            "has no SM90 Mega-MoE kernel: use --mma fp8xfp4"
        )
    if cfg.device != "cuda":
        raise StudyArgumentError("--device", "--kernel deepgemm-sm90 runs on the GPU: pass "
                                 "--device cuda")


def check_comm_flags(cfg: StudyConfig) -> None:
    """The time-estimate flags (interconnect, link overrides, EP size and tokens)."""
    from moewire.study.comm import INTERCONNECTS

    if cfg.interconnect not in INTERCONNECTS:
        raise StudyArgumentError(
            "--interconnect", f"unknown interconnect {cfg.interconnect!r}; pick one of "
            f"{', '.join(INTERCONNECTS)}"
        )
    for argument, value, positive in (("--link-gbps", cfg.link_gbps, True),
                                      ("--link-latency-us", cfg.link_latency_us, False)):
        if value is None:
            continue
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not number or not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise StudyArgumentError(
                argument, f"must be a finite number {'> 0' if positive else '>= 0'}, got "
                f"{value!r}"
            )
    if cfg.ep_tokens is not None:
        _positive(cfg.ep_tokens, "--ep-tokens")
    if cfg.ep_size is None:
        return
    _positive(cfg.ep_size, "--ep-size")
    if cfg.ranks > 1 and cfg.ep_size != cfg.ranks:
        raise StudyArgumentError(
            "--ep-size", f"--ranks {cfg.ranks} and --ep-size {cfg.ep_size} disagree: --ranks "
            "splits the error sweep's routing over simulated ranks (it changes no error, only "
            "the reported share of copies that leave their rank), --ep-size is the EP group "
            "of the time estimate; pass the same number to both, or drop --ranks"
        )
    top = INTERCONNECTS[cfg.interconnect].max_ep_size
    if top is not None and cfg.ep_size > top:
        raise StudyArgumentError(
            "--ep-size", f"{cfg.interconnect} spans one {top}-GPU node, not {cfg.ep_size} "
            f"ranks; use --ep-size <= {top}, or --interconnect rdma-cx7 for a scale-out group"
        )
    if cfg.tokens % cfg.ep_size:
        raise StudyArgumentError(
            "--ep-size", f"the routing is measured on batches of --tokens {cfg.tokens}, "
            f"which do not split over {cfg.ep_size} ranks; use --tokens a multiple of "
            f"{cfg.ep_size}"
        )
    if cfg.weights is None:
        check_ep_experts(cfg.ep_size, cfg.experts or cfg.preset.num_experts)


def check_ep_experts(ep_size: int, num_experts: int) -> None:
    if num_experts % ep_size:
        raise StudyArgumentError(
            "--ep-size", f"{num_experts} experts do not split over {ep_size} ranks; use an "
            f"--ep-size that divides {num_experts} (or more --experts)"
        )


def default_ep_size(interconnect: str) -> int:
    """The EP size the estimate starts from: one NVLink node
    (:data:`moewire.study.comm.DEFAULT_EP_SIZE`), or the smallest EP size an interconnect
    has figures for when that is larger (``rdma-cx7``: DeepEP's low-latency RDMA rows
    start at EP 16)."""
    from moewire.study.comm import DEFAULT_EP_SIZE, INTERCONNECTS

    return max(DEFAULT_EP_SIZE, min(INTERCONNECTS[interconnect].dispatch_gbps))


def ep_size(cfg: StudyConfig, num_experts: int) -> int:
    """The time estimate's EP size: ``--ep-size``, else :func:`default_ep_size` (one NVLink
    node, or where an interconnect's figures start).

    Experts sit on ranks in equal contiguous blocks, so an EP size must divide the expert
    count: DeepGEMM sizes its buffer with ``num_experts / num_ranks`` experts a rank after
    ``DG_HOST_ASSERT(num_experts % num_ranks == 0)`` (``csrc/apis/mega.hpp``,
    ``get_symm_buffer_size_for_mega_moe``, deepseek-ai/DeepGEMM 093597f), and DeepEP's
    dispatch layout does the same (``csrc/kernels/intranode.cu``, ``notify_dispatch``:
    ``EP_HOST_ASSERT(num_experts % num_ranks == 0)``, deepseek-ai/DeepEP 031a5c4). It must
    divide ``--tokens`` too (the batch is split into equal blocks of tokens). A default that
    does not fit is refused, never replaced by a smaller size: the estimate would silently
    describe another group (at EP 1, no traffic at all).

    Raises:
        StudyArgumentError: the default EP size does not divide the expert count or
            ``--tokens``; the message names the EP sizes and expert counts that would.
    """
    from moewire.study.comm import INTERCONNECTS

    if cfg.ep_size is not None:
        check_ep_experts(cfg.ep_size, num_experts)
        return cfg.ep_size
    n = default_ep_size(cfg.interconnect)
    if num_experts % n == 0 and cfg.tokens % n == 0:
        return n
    top = INTERCONNECTS[cfg.interconnect].max_ep_size if cfg.interconnect in INTERCONNECTS \
        else None
    fits = [d for d in range(2, math.gcd(num_experts, cfg.tokens) + 1)
            if num_experts % d == 0 and cfg.tokens % d == 0 and (top is None or d <= top)]
    nearest = sorted(fits, key=lambda d: (abs(d - n), d))[:2]
    sizes = (f"pass --ep-size {' or '.join(map(str, sorted(nearest)))} (the nearest sizes that "
             "split both), or use" if nearest else "no EP size above 1 splits both; use")
    causes, fixes = [], []
    if num_experts % n:
        causes.append(f"{num_experts} experts")
        if cfg.weights is None:
            lower, upper = num_experts // n * n, (num_experts // n + 1) * n
            fixes.append(f"--experts {' or '.join(str(e) for e in (lower, upper) if e)}")
    if cfg.tokens % n:
        causes.append(f"--tokens {cfg.tokens}")
        fixes.append(f"--tokens {(cfg.tokens // n + 1) * n}")
    raise StudyArgumentError(
        "--ep-size", f"the time estimate's default EP size {n} does not split "
        f"{' and '.join(causes)} (experts and tokens sit on ranks in equal blocks); {sizes} "
        f"{' with '.join(fixes)}"
    )


def _check_imbalance(cfg: StudyConfig, num_experts: int, top_k: int) -> None:
    if cfg.router_imbalance is not None and cfg.router_imbalance > num_experts / top_k:
        raise StudyArgumentError(
            "--router-imbalance", f"{cfg.router_imbalance} x the mean load is more than every "
            f"token: with {num_experts} experts and top-k {top_k} an expert gets at most "
            f"{num_experts / top_k:.3g} x the mean; use at most that"
        )


def router_imbalance(cfg: StudyConfig, num_experts: int, top_k: int) -> float:
    """The synthetic router's target max/mean load: ``--router-imbalance``, else the
    default capped at ``E / k`` (an expert cannot get more than every token)."""
    if cfg.router_imbalance is not None:
        return float(cfg.router_imbalance)
    return min(DEFAULT_ROUTER_IMBALANCE, num_experts / top_k)


def check_out_dir(out: str | Path) -> Path:
    """Create ``--out`` (with parents) and write a probe file there, before any work.

    A sweep takes minutes; an output directory that cannot be written must fail first.

    Returns:
        The directory, as a ``Path``.

    Raises:
        StudyArgumentError: ``--out`` is an existing file, or cannot be created or written.
    """
    return writable_dir(out, StudyArgumentError, "moewire-study")


def _check_top_k(num_experts: int, top_k: int) -> None:
    if top_k > num_experts:
        raise StudyArgumentError(
            "--experts", f"{num_experts} experts are fewer than top-k {top_k}; use at least "
            f"{top_k}"
        )


def check_layer_shapes(
    cfg: StudyConfig, num_experts: int, top_k: int, hidden: int, intermediate: int
) -> None:
    """Checks that need the layer's shapes (from the preset or the weights file)."""
    from moewire import formats

    _check_top_k(num_experts, top_k)
    _check_imbalance(cfg, num_experts, top_k)
    if num_experts % cfg.ranks:
        raise StudyArgumentError(
            "--ranks", f"{num_experts} experts do not split evenly over {cfg.ranks} ranks; "
            "use a --ranks that divides the expert count"
        )
    ep_size(cfg, num_experts)
    multiple = _HIDDEN_MULTIPLE[cfg.mma]
    for name, value in (("hidden size", hidden), ("intermediate size", intermediate)):
        if value % multiple:
            raise StudyArgumentError(
                "--weights" if cfg.weights else "--model",
                f"{name} {value} is not a multiple of {multiple}, which the {cfg.mma} kernel "
                f"needs; pad the weights or use --mma bf16xbf16 (multiples of 128)",
            )
    for argument, names in (("--dispatch", cfg.dispatch), ("--combine", cfg.combine)):
        for name in names:
            block = formats.get(name).block_size
            if block is not None and hidden % block:
                raise StudyArgumentError(
                    argument, f"format {name!r} has blocks of {block}, which do not divide "
                    f"the hidden size {hidden}; drop it from the list"
                )


def with_formats(cfg: StudyConfig, dispatch: str | None, combine: str | None) -> StudyConfig:
    """``cfg`` with ``--dispatch`` / ``--combine`` strings parsed (``None``: keep)."""
    changes = {}
    if dispatch is not None:
        changes["dispatch"] = parse_formats(dispatch, "--dispatch")
    if combine is not None:
        changes["combine"] = parse_formats(combine, "--combine")
    return replace(cfg, **changes)
