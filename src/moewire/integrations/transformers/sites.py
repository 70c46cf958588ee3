"""Where transformers runs a DeepGEMM Mega-MoE kernel itself, one declarative entry per site.

A site is an experts implementation of transformers (a name in an experts interface mapped to
a forward function) whose forward stages the tokens and calls a Mega-MoE kernel. An entry
says which function that is, which experts classes dispatch to it through which interface,
how its forward reaches DeepGEMM (the loaded bundle it reads at call time), where it keeps
its buffers, which argument carries the EP group, what recognises it (the calls its source
makes, never a version) and which DeepGEMM build it loads. The glue
(:mod:`moewire.integrations.transformers.megamoe`) derives everything from the entries; the
kernel side (where that build leaves its rows) is ``moewire.megamoe.builds``.

Sources read (the transformers 5.23.0 wheel):

- ``transformers/integrations/finegrained_fp8.py``: ``FP8ExpertsInterface._global_mapping``
  maps ``"deepgemm_megamoe"`` to ``deepgemm_fp8_fp4_megamoe_experts_forward``;
  ``replace_with_fp8_linear`` builds every ``*.experts`` module of a pre-quantized FP8/FP4
  checkpoint as ``FP8Experts`` through ``use_experts_implementation(experts_interface=
  ALL_FP8_EXPERTS_FUNCTIONS)``, whose forward looks the implementation up in that interface
  at call time (``integrations/moe.py``). No other interface maps the name.
- ``transformers/integrations/deepgemm.py``: the forward asserts the arch
  (``_assert_sm100_requirements``), no grad, int8 (FP4) weights and a ``process_group``;
  ``load_deepgemm_kernel()`` returns the module global ``_DEEPGEMM`` (a frozen ``DeepGEMM``
  dataclass of the hub kernel's entry points, loaded once); ``setup_megamoe_weights`` packs
  the weights once (``_megamoe_transformed``); one buffer per (group name, (H, k, E, I)) in
  the module dict ``_SYMM_BUFFERS``, made again only for a larger batch; staging
  ``deepgemm.per_token_cast_to_fp8(hidden_states, use_ue8m0=True, gran_k=32,
  use_packed_ue8m0=True)`` copied into ``x``/``x_sf`` with the ids and weights; then
  ``deepgemm.fp8_fp4_mega_moe(y, (l1, l1_sf), (l2, l2_sf), symm_buffer,
  activation_clamp=config.swiglu_limit)``.
- ``transformers/distributed/expert_parallel.py``: ``MegaMoeEP`` hands the forward the EP
  group as ``process_group=`` (``EPImplementation`` binds ``experts.forward`` when the plan is
  applied, before any class swap: moewire reaches the forward through the interface).
- The bundle's kernel, ``kernels-community/deep-gemm`` (huggingface/kernels-community
  ``deep-gemm/torch-ext/deep_gemm/mega/__init__.py`` at 84232ce, ``csrc/apis/mega.hpp`` at
  388adb9), is upstream DeepGEMM: ``get_symm_buffer_for_mega_moe`` without
  ``num_shared_experts``, the combine region last, as ``deepgemm-main``.

May import: the standard library and ``moewire.integrations._host`` (nothing of
transformers at import).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from moewire.integrations._host import missing_call

__all__ = ["SITES", "MegaMoeSite", "resolve", "recognise"]


@dataclass(frozen=True)
class MegaMoeSite:
    """One transformers experts implementation that runs a Mega-MoE kernel.

    Attributes:
        name: the implementation's name in the interfaces (``config._experts_implementation``).
        module: the module defining the forward.
        function: the forward, ``fn(self, hidden_states, top_k_index, top_k_weights, *,
            <group_arg>)``.
        experts: ``("module:Class", "module:INTERFACE")`` pairs: an experts class and the
            interface instance its forward dispatches through.
        bundle: the global of ``module`` holding the loaded DeepGEMM entry points (what the
            forward's loader returns): moewire's kernel namespace.
        loader: the function the forward calls for the bundle.
        bundle_class: the class of the bundle (a frozen dataclass).
        buffers: the global dict ``group name -> {shape key: buffer}``.
        group_arg: the forward's parameter carrying the EP group.
        arch_check: the function asserting the GPU arch (what the stand-in opt-in bypasses).
        calls: calls the module's source must make (the structure moewire hooks).
        build: the flavour of the DeepGEMM build the bundle is (``moewire.megamoe.builds``).
        read_from: the sources the entry was read from.
    """

    name: str
    module: str
    function: str
    experts: tuple[tuple[str, str], ...]
    bundle: str
    loader: str
    bundle_class: str
    buffers: str
    group_arg: str
    arch_check: str
    calls: tuple[str, ...]
    build: str
    read_from: str


SITES: tuple[MegaMoeSite, ...] = (
    MegaMoeSite(
        name="deepgemm_megamoe",
        module="transformers.integrations.deepgemm",
        function="deepgemm_fp8_fp4_megamoe_experts_forward",
        experts=(("transformers.integrations.finegrained_fp8:FP8Experts",
                  "transformers.integrations.finegrained_fp8:ALL_FP8_EXPERTS_FUNCTIONS"),),
        bundle="_DEEPGEMM",
        loader="load_deepgemm_kernel",
        bundle_class="DeepGEMM",
        buffers="_SYMM_BUFFERS",
        group_arg="process_group",
        arch_check="_assert_sm100_requirements",
        calls=("load_deepgemm_kernel(", ".per_token_cast_to_fp8(", ".fp8_fp4_mega_moe(",
               ".get_symm_buffer_for_mega_moe(", "setup_megamoe_weights(",
               "_assert_sm100_requirements("),
        build="deepgemm-main",
        read_from="transformers 5.23.0 integrations/deepgemm.py, integrations/finegrained_fp8.py, "
        "distributed/expert_parallel.py; kernels-community deep-gemm mega/__init__.py (84232ce)",
    ),
)


def resolve(path: str) -> object:
    """The object at ``"module:name"`` (imports the module)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def recognise(site: MegaMoeSite) -> str | None:
    """Why transformers lacks ``site``'s structure, or ``None`` if it has it.

    The structure: the module imports and defines the forward, the bundle, loader, buffers
    and arch check; its source makes every call of ``site.calls``; the forward takes the
    group argument; every experts class exists and its interface maps ``site.name`` to the
    forward (or to moewire's trampoline of it, once registered).
    """
    try:
        module = importlib.import_module(site.module)
    except ImportError as exc:
        return f"{site.module} does not import ({exc})"
    forward = getattr(module, site.function, None)
    if not callable(forward):
        return f"{site.module} has no function {site.function}"
    if site.group_arg not in inspect.signature(forward).parameters:
        return f"{site.module}.{site.function} takes no {site.group_arg}"
    for name in (site.loader, site.bundle_class, site.buffers, site.arch_check, site.bundle):
        if not hasattr(module, name):
            return f"{site.module} has no {name}"
    missing = missing_call(site.module, site.calls)
    if missing is not None:
        return missing
    for cls_path, interface_path in site.experts:
        try:
            cls, interface = resolve(cls_path), resolve(interface_path)
        except (ImportError, AttributeError) as exc:
            return f"{cls_path} or {interface_path} is missing ({exc})"
        if not isinstance(cls, type):
            return f"{cls_path} is no class"
        mapped = interface.get(site.name) if hasattr(interface, "get") else None
        if getattr(mapped, "__wrapped__", mapped) is not forward:
            return f"{interface_path} does not map {site.name!r} to {site.function}"
    return None
