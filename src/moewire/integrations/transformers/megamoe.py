"""transformers' own Mega-MoE (``experts_implementation="deepgemm_megamoe"``) as a moewire site.

Everything here is derived from the entries of :data:`moewire.integrations.transformers.sites.
SITES` (transformers 5.23.0, ``integrations/deepgemm.py``; the sources are in that module):

- **Recognition and the adapter** (:func:`site_adapter`): a module is the site's when its
  class is one of the entry's experts classes and its interface maps its
  ``config._experts_implementation`` to the site's forward. The forward reads its DeepGEMM
  bundle from the module global ``_DEEPGEMM`` at call time (``load_deepgemm_kernel()``
  returns it): that global is the kernel namespace moewire proxies, whose
  ``per_token_cast_to_fp8`` is the inline staging (the dispatch hook) and whose
  ``fp8_fp4_mega_moe`` is the kernel (the combine hook). The buffer of a call is the one the
  forward keeps in ``_SYMM_BUFFERS[group.group_name]`` for the call's shape.
- **The trampoline** (:func:`run_quantized`): transformers' ``EPImplementation`` binds
  ``experts.forward`` when the EP plan is applied and installs its own ``module.forward``, so
  under EP the class swap of ``moewire.quantize`` never runs. moewire puts a trampoline in
  the interface instead (``FP8ExpertsInterface.register``, transformers' own registration),
  which runs the forward inside the converted module's quantized forward and records the
  call's ``process_group``. Outside a converted module it calls the forward unchanged.
- **One rank** (:func:`one_rank_group`): the forward needs a ``process_group`` (its buffers
  rendezvous over it, ``_SYMM_BUFFERS[group.group_name]``), which only ``MegaMoeEP`` passes,
  and transformers 5.23 applies no EP plan for ``ep_size=1`` (``distributed/mixin.py``,
  ``_resolve_parallel_plans``: the EP plan is empty unless ``ep_size > 1``). For a module
  that runs on one process without an EP plan, ``prepare`` records a process group of one
  rank (:data:`ONE_RANK`) and the trampoline passes it when the call has none: what
  ``MegaMoeEP`` does on one rank (the slice is the whole batch and the all-gather a copy),
  without the DTensor sharding.
- **The stand-in as transformers' kernel** (:func:`install_stand_in`, the explicit opt-in
  ``prepare(model, kernel="stand-in")``): ``_DEEPGEMM`` becomes a ``DeepGEMM`` bundle whose
  five Mega-MoE entry points are :mod:`moewire.reference.hub_deep_gemm` (the stand-in of
  ``kernels-community/deep-gemm``) and whose other entry points refuse; and the one check
  that would stop it, ``_assert_sm100_requirements`` (which asks the CUDA device for
  Blackwell), is replaced by one that passes only while that stand-in bundle is the one
  loaded and keeps the check it makes on an SM100 GPU (FP32 scales are refused: the kernel
  reads UE8M0 scales). Nothing else
  of transformers changes: its forward, ``setup_megamoe_weights``, ``_SYMM_BUFFERS`` and
  ``MegaMoeEP`` run unmodified. The opt-in lasts until :func:`remove_stand_in` (called by
  ``unregister()``), not until ``moewire.unquantize``, so an unquantized model still runs.
- **FP8 checkpoints on CPU** (:func:`keep_fp8_on_cpu`): transformers 5.23's
  ``FineGrainedFP8HfQuantizer.validate_environment`` turns a pre-quantized FP8/FP4 checkpoint
  into BF16 when no GPU is present (``quantization_config.dequantize = True``), so
  ``FP8Experts`` never exists in a CPU ``from_pretrained``. Inside this context manager that
  one branch (and the accelerate check next to it) is skipped and the checkpoint loads
  quantized; for tests and the stand-in opt-in only.

May import: the standard library, torch, ``moewire.integrations._host``,
``moewire.integrations.deepgemm_sm90``, ``moewire.integrations.transformers.sites``,
``moewire.megamoe`` and ``moewire.reference.hub_deep_gemm``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from moewire.integrations.deepgemm_sm90 import one_rank_group as one_rank_nccl
from moewire.integrations.deepgemm_sm90 import symm_buffer_of
from moewire.integrations.transformers.sites import SITES, MegaMoeSite, recognise, resolve
from moewire.megamoe.active import ACTIVE
from moewire.megamoe.flavours import detect
from moewire.megamoe.quant_experts import QuantExperts
from moewire.megamoe.registry import (
    ExpertsAdapter,
    register_experts_class,
    unregister_experts_class,
)
from moewire.reference import hub_deep_gemm

__all__ = [
    "CALL_GROUP",
    "GROUPS",
    "ONE_RANK",
    "install_stand_in",
    "keep_fp8_on_cpu",
    "load_bundle",
    "one_rank_group",
    "register",
    "remove_stand_in",
    "run_quantized",
    "site_adapter",
    "site_of",
    "stand_in_installed",
    "unregister",
]

#: ``module.__dict__`` key: the EP group of the module's last call (the forward's argument).
CALL_GROUP = "_moewire_tf_call_group"
#: ``module.__dict__`` key: ``(EP group, DP groups)`` recorded by ``prepare`` from the mesh.
GROUPS = "_moewire_tf_groups"
#: ``module.__dict__`` key: the one-rank group ``prepare`` gives a module without an EP plan.
ONE_RANK = "_moewire_tf_one_rank"

# site name -> [(interface class, the value moewire replaced)], while registered.
_REGISTERED: dict[str, list[tuple[type, Callable]]] = {}
# site name -> (the stand-in bundle, the bundle before it, the arch check before it).
_STAND_INS: dict[str, tuple[Any, Any, Callable]] = {}
#: The hub kernel's field that is no function: its M alignment (the build-time default).
_M_ALIGNMENT = 128


def _where(module: nn.Module) -> str:
    return (module.__dict__.get("_moewire_name_") or module.__dict__.get("_moewire_tf_name")
            or type(module).__name__)


def run_quantized(fn: Callable[..., Any], module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``fn(module, *args, **kwargs)``, inside ``module``'s quantized forward when moewire
    converted it and that forward is not running already (transformers' EP bypassed it).

    Args:
        fn: an experts implementation (``fn(self, hidden_states, top_k_index,
            top_k_weights, ...)``).
        module: the experts module.
    """
    if isinstance(module, QuantExperts) and ACTIVE.get() is not module:
        return module.moewire_run(fn, module, *args, **kwargs)
    return fn(module, *args, **kwargs)


def _trampoline(site: MegaMoeSite, forward: Callable[..., Any]) -> Callable[..., Any]:
    def megamoe_forward(self: nn.Module, hidden_states: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        *args: Any, **kwargs: Any) -> torch.Tensor:
        group = kwargs.get(site.group_arg, args[0] if args else None)
        if group is None and not args and ONE_RANK in self.__dict__:
            group = kwargs[site.group_arg] = self.__dict__[ONE_RANK]
        if group is not None:
            self.__dict__[CALL_GROUP] = group
        return run_quantized(forward, self, hidden_states, top_k_index, top_k_weights,
                             *args, **kwargs)

    megamoe_forward.__name__ = forward.__name__
    megamoe_forward.__doc__ = forward.__doc__
    megamoe_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    return megamoe_forward


def site_of(module: nn.Module) -> MegaMoeSite | None:
    """The site ``module`` runs now (its class and its interface's mapping), or ``None``."""
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return next((s for s in SITES if _maps_to_site(module, implementation, s)), None)


def _maps_to_site(module: nn.Module, implementation: Any, site: MegaMoeSite) -> bool:
    if not isinstance(implementation, str):
        return False
    try:
        forward = resolve(f"{site.module}:{site.function}")
    except (ImportError, AttributeError):
        return False
    for cls_path, interface_path in site.experts:
        try:
            cls, interface = resolve(cls_path), resolve(interface_path)
        except (ImportError, AttributeError):
            continue
        if isinstance(module, cls):
            mapped = interface.get(implementation)
            return getattr(mapped, "__wrapped__", mapped) is forward
    return False


def _buffer(site: MegaMoeSite) -> Callable[[nn.Module], Any]:
    """``module -> SymmBuffer`` of the running call: the one buffer transformers keeps in
    ``_SYMM_BUFFERS[group.group_name]`` for the call's shape (hidden, top-k, experts over the
    group, intermediate), matched on the buffer's own fields."""

    def get(module: nn.Module) -> Any:
        group = module.__dict__.get(CALL_GROUP)
        if group is None:
            raise RuntimeError(
                f"{_where(module)}: no call of {site.function} has given this module a "
                f"{site.group_arg}, so moewire cannot find its buffer; run it through "
                "transformers' expert parallelism (MegaMoeEP passes it)"
            )
        buffers = getattr(importlib.import_module(site.module), site.buffers)
        want = {
            "hidden": module.hidden_dim,
            "num_topk": int(module.config.num_experts_per_tok),
            "num_experts": module.num_experts * group.size(),
            "intermediate_hidden": module.intermediate_dim,
        }
        found = [b for b in buffers.get(group.group_name, {}).values()
                 if all(getattr(b, key, None) == value for key, value in want.items())]
        if len(found) != 1:
            raise RuntimeError(
                f"{_where(module)}: {site.module}.{site.buffers} holds {len(found)} buffers of "
                f"this call's shape {want} for group {group.group_name!r}, where transformers "
                "5.23 keeps exactly one; this transformers keeps its buffers differently "
                "(moewire.integrations.transformers.sites)"
            )
        return found[0]

    return get


def _groups(module: nn.Module) -> tuple[Any, tuple[Any, ...]]:
    """``(EP group, DP groups)``: from ``prepare`` (the model's mesh), else the last call's."""
    recorded = module.__dict__.get(GROUPS)
    if recorded is not None and recorded[0] is not None:
        return recorded
    return module.__dict__.get(CALL_GROUP), () if recorded is None else recorded[1]


def site_adapter(site: MegaMoeSite) -> ExpertsAdapter:
    """The experts adapter of ``site`` (see the module docstring)."""
    import transformers

    def flavour(module: nn.Module) -> str:
        namespace = getattr(importlib.import_module(site.module), site.bundle)
        return detect(namespace, _where(module)).name

    return ExpertsAdapter(
        name=f"transformers-{site.name}",
        forward_module=site.module,
        stage_fn=(),
        stage_hidden_arg=0,
        kernel_ns=site.bundle,
        get_symm_buffer=symm_buffer_of(_buffer(site)),
        flavour=flavour,
        fused_shared=lambda m: False,
        ep_group=lambda m: _groups(m)[0],
        dp_groups=lambda m: _groups(m)[1],
        runtime=lambda: (
            f"transformers {transformers.__version__}; moewire.integrations.transformers."
            f"prepare(model) loads its DeepGEMM ({site.module}.{site.loader})"
        ),
        applies=lambda m: _maps_to_site(
            m, getattr(getattr(m, "config", None), "_experts_implementation", None), site),
    )


def register() -> list[str]:
    """Put moewire's trampoline in each recognised site's interfaces (transformers' own
    ``register``) and register the site's experts adapters; idempotent.

    Returns:
        Why each site transformers lacks was skipped (empty when all are recognised).
    """
    skipped = []
    for site in SITES:
        why = recognise(site)
        if why is not None:
            skipped.append(f"{site.name}: {why}")
            continue
        forward = resolve(f"{site.module}:{site.function}")
        replaced = _REGISTERED.setdefault(site.name, [])
        for cls_path, interface_path in site.experts:
            interface = type(resolve(interface_path))
            current = interface._global_mapping.get(site.name)
            if getattr(current, "__wrapped__", None) is not forward:
                replaced.append((interface, current))
                interface.register(site.name, _trampoline(site, forward))
            register_experts_class(resolve(cls_path), site_adapter(site))
    return skipped


def unregister() -> None:
    """Undo :func:`register` and :func:`install_stand_in`."""
    for site in SITES:
        remove_stand_in(site)
        for interface, original in reversed(_REGISTERED.pop(site.name, [])):
            interface._global_mapping[site.name] = original
        for cls_path, _ in site.experts:
            with contextlib.suppress(ImportError, AttributeError):
                unregister_experts_class(resolve(cls_path))


# ---------------------------------------------------------------------------- the kernel


def _absent(name: str) -> Callable[..., Any]:
    def entry(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"moewire's stand-in DeepGEMM bundle has the Mega-MoE entry points only; {name} "
            "is not modelled (use a GPU with the kernels-hub DeepGEMM)"
        )

    entry.__name__ = name
    return entry


def stand_in_installed(site: MegaMoeSite) -> bool:
    """Whether moewire's stand-in bundle is ``site``'s loaded DeepGEMM now."""
    entry = _STAND_INS.get(site.name)
    if entry is None:
        return False
    namespace = getattr(importlib.import_module(site.module), site.bundle)
    return getattr(namespace, "_moewire_namespace", namespace) is entry[0]


def _stand_in_bundle(site: MegaMoeSite) -> Any:
    """transformers' ``DeepGEMM`` dataclass filled with the stand-in's entry points."""
    cls = resolve(f"{site.module}:{site.bundle_class}")
    hub = {
        "per_token_cast_to_fp8": hub_deep_gemm.utils.per_token_cast_to_fp8,
        "transform_sf_into_required_layout": hub_deep_gemm.transform_sf_into_required_layout,
        "transform_weights_for_mega_moe": hub_deep_gemm.transform_weights_for_mega_moe,
        "get_symm_buffer_for_mega_moe": hub_deep_gemm.get_symm_buffer_for_mega_moe,
        "fp8_fp4_mega_moe": hub_deep_gemm.fp8_fp4_mega_moe,
        "m_alignment": _M_ALIGNMENT,
    }
    return cls(**{f.name: hub.get(f.name, _absent(f.name)) for f in dataclasses.fields(cls)})


def _arch_check(site: MegaMoeSite, original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' arch assertion, passing only while the stand-in bundle is loaded."""

    def check(weight: torch.Tensor, scale: torch.Tensor) -> None:
        if not stand_in_installed(site):
            return original(weight, scale)
        if scale.dtype == torch.float32:
            raise NotImplementedError(
                f"{site.module}: these scales are FP32 and the SM100 Mega-MoE reads UE8M0 "
                "scales only (transformers' check on SM100, kept by moewire's stand-in); load "
                "a checkpoint quantized with scale_fmt='ue8m0'"
            )
        return None

    check.__name__ = original.__name__
    check._moewire_stand_in = True  # type: ignore[attr-defined]
    return check


def install_stand_in(site: MegaMoeSite) -> None:
    """Make moewire's stand-in the DeepGEMM ``site``'s forward loads (the explicit opt-in of
    ``prepare(model, kernel="stand-in")``); idempotent. See the module docstring for exactly
    what changes.

    Raises:
        RuntimeError: transformers lacks the site's structure, or it has loaded a real
            DeepGEMM already (moewire never replaces a real kernel by its stand-in).
    """
    if stand_in_installed(site):
        return
    why = recognise(site)
    if why is not None:
        raise RuntimeError(f"moewire: cannot install the stand-in for {site.name}: {why}")
    module = importlib.import_module(site.module)
    loaded = getattr(module, site.bundle)
    if loaded is not None:
        raise RuntimeError(
            f"{site.module}.{site.bundle} holds a loaded DeepGEMM ({type(loaded).__name__}); "
            "moewire does not replace a real kernel by its stand-in: drop kernel='stand-in' "
            "to run the one transformers loaded"
        )
    bundle = _stand_in_bundle(site)
    original_check = getattr(module, site.arch_check)
    _STAND_INS[site.name] = (bundle, loaded, original_check)
    setattr(module, site.bundle, bundle)
    setattr(module, site.arch_check, _arch_check(site, original_check))


def remove_stand_in(site: MegaMoeSite) -> None:
    """Undo :func:`install_stand_in` (a no-op when it is not installed); the bundle slot is
    emptied as it was, so transformers loads its own kernel on the next forward."""
    entry = _STAND_INS.pop(site.name, None)
    if entry is None:
        return
    bundle, before, check = entry
    module = importlib.import_module(site.module)
    current = getattr(module, site.bundle)
    if getattr(current, "_moewire_namespace", current) is bundle:
        setattr(module, site.bundle, before)
    if getattr(getattr(module, site.arch_check), "_moewire_stand_in", False):
        setattr(module, site.arch_check, check)


def one_rank_group(where: str, device: torch.device) -> Any:
    """The process group of one rank that ``where``'s forward rendezvous over when the model
    runs on one process without an EP plan (the module docstring's "One rank").

    A model on a GPU gets ``deepgemm_sm90.one_rank_group`` (NCCL: the real kernel's buffer is
    symmetric memory over it). A model on the CPU gets a gloo group of rank 0, over the
    running process group of world size 1 or, without one, over one this starts (gloo, an
    in-process store: no port).

    Raises:
        RuntimeError: a process group of several ranks is running and the module has no EP
            plan; the message gives the ``DistributedConfig`` that applies it.
    """
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() != 1:
        world = dist.get_world_size()
        raise RuntimeError(
            f"{where}: experts_implementation='deepgemm_megamoe' runs on {world} ranks without "
            "expert parallelism, and transformers' Mega-MoE exchanges the tokens of the EP "
            "group inside its kernel; load the model with from_pretrained(path, "
            f"distributed_config=DistributedConfig(tp_size={world}, ep_size={world})) so "
            "transformers applies its EP plan (MegaMoeEP)"
        )
    if device.type == "cuda":
        return one_rank_nccl()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.new_group([0], backend="gloo")


def load_bundle(site: MegaMoeSite, where: str) -> None:
    """Load the DeepGEMM ``site``'s forward uses (transformers' own loader), so moewire can
    hook it before the first forward.

    Raises:
        RuntimeError: transformers cannot load it here (no SM100 GPU, no ``kernels``); the
            message gives transformers' reason and the opt-in for CPU or Hopper.
    """
    module = importlib.import_module(site.module)
    if getattr(module, site.bundle) is not None:
        return
    try:
        getattr(module, site.loader)()
    except ImportError as exc:
        raise RuntimeError(
            f"{where}: experts_implementation={site.name!r} runs the kernels-hub DeepGEMM, "
            f"which transformers cannot load here ({exc}); run on a Blackwell (SM100) GPU, or "
            "pass prepare(model, kernel='stand-in') to run moewire's stand-in of that build "
            "(CPU and any GPU)"
        ) from exc


@contextlib.contextmanager
def keep_fp8_on_cpu() -> Iterator[None]:
    """Inside: ``from_pretrained`` of a pre-quantized FP8/FP4 checkpoint on a machine without
    a GPU keeps it quantized (``FP8Experts``, ``FP8Linear``) instead of transformers 5.23's
    fallback to BF16 (``FineGrainedFP8HfQuantizer.validate_environment``). With a GPU the
    method runs as it is. For tests and the stand-in opt-in only."""
    quantizer = resolve(
        "transformers.quantizers.quantizer_finegrained_fp8:FineGrainedFP8HfQuantizer")
    original = quantizer.__dict__["validate_environment"]

    def validate_environment(self: Any, *args: Any, **kwargs: Any) -> Any:
        if (not torch.cuda.is_available() and self.pre_quantized
                and not self.quantization_config.dequantize):
            return None
        return original(self, *args, **kwargs)

    quantizer.validate_environment = validate_environment
    try:
        yield
    finally:
        quantizer.validate_environment = original
