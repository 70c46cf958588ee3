"""``prepare(model)``: make every Mega-MoE experts module of a model ready to run and to
quantize, the ``"moewire"`` experts (their state, :mod:`.state`) and transformers' own
Mega-MoE sites (:mod:`.megamoe`) alike.

May import: the standard library, torch, ``moewire.reference.catalogue`` and this package's
modules below it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moewire.integrations.transformers import ep, megamoe
from moewire.integrations.transformers.registration import IMPLEMENTATION, experts_modules
from moewire.integrations.transformers.sites import SITES, MegaMoeSite
from moewire.integrations.transformers.sites import recognise as sites_recognise
from moewire.integrations.transformers.state import DEFAULT_MAX_TOKENS, _build_state, _local
from moewire.reference import catalogue

__all__ = ["prepare", "site_modules"]


def site_modules(model: nn.Module) -> list[tuple[str, nn.Module, MegaMoeSite]]:
    """``(name, module, site)`` of every experts module of ``model`` that runs one of
    transformers' own Mega-MoE implementations (:data:`.sites.SITES`)."""
    found = []
    for name, module in model.named_modules():
        site = megamoe.site_of(module)
        if site is not None:
            found.append((name, module, site))
    return found


#: The FP8 x FP4 tile of the stand-in kernel: H and I multiples of it.
_STAND_IN_FP4_MULTIPLE = catalogue.build(catalogue.STAND_IN, "fp8xfp4").hidden_multiple


def _check_site_layout(name: str, module: nn.Module, site: MegaMoeSite) -> None:
    """Refuse an experts module of ``site`` that the stand-in's FP8 x FP4 build cannot run."""
    weights = _local(module.gate_up_proj)
    hidden, intermediate = module.hidden_dim, module.intermediate_dim
    if not getattr(module, "has_gate", True) or getattr(module, "has_bias", False):
        raise ValueError(
            f"{name}: {site.name} runs the gated SwiGLU experts of fp8_fp4_mega_moe without "
            "biases; this module has has_gate=False or has_bias=True"
        )
    if weights.dtype != torch.int8:
        raise ValueError(
            f"{name}: {site.name} runs fp8_fp4_mega_moe on FP4 (int8-packed) expert weights, "
            f"these are {weights.dtype}; load a checkpoint with expert_dtype='fp4'"
        )
    if hidden % _STAND_IN_FP4_MULTIPLE or intermediate % _STAND_IN_FP4_MULTIPLE:
        raise ValueError(
            f"{name}: the stand-in's fp8_fp4_mega_moe tiles H and I by "
            f"{_STAND_IN_FP4_MULTIPLE} (FP4 weights, 128-byte rows), got H={hidden}, "
            f"I={intermediate}; use a model whose sizes are multiples of it"
        )


def _prepare_site(site: MegaMoeSite, modules: list[tuple[str, nn.Module]],
                  mma_type: str | None, kernel: str | None) -> None:
    where = modules[0][0]
    why = sites_recognise(site)
    if why is not None:
        raise RuntimeError(f"{where}: moewire cannot hook experts_implementation="
                           f"{site.name!r} in this transformers: {why}")
    if mma_type is not None:
        raise ValueError(
            f"{where}: experts_implementation={site.name!r} runs transformers' own "
            f"fp8_fp4_mega_moe on the checkpoint's FP4 weights; mma_type={mma_type!r} does "
            "not apply (leave it None)"
        )
    if kernel is None:
        megamoe.load_bundle(site, where)
        return
    if kernel != "stand-in":
        raise ValueError(
            f"{where}: experts_implementation={site.name!r} runs the kernel transformers "
            f"loads (kernel=None) or moewire's stand-in of it (kernel='stand-in'), got "
            f"kernel={kernel!r}"
        )
    for name, module in modules:
        _check_site_layout(name, module, site)
    megamoe.install_stand_in(site)


def prepare(
    model: nn.Module,
    mma_type: str | None = None,
    *,
    max_num_tokens: int = DEFAULT_MAX_TOKENS,
    kernel: str | None = None,
    group: Any = None,
) -> nn.Module:
    """Make every Mega-MoE experts module of ``model`` ready to run and to quantize.

    Call it after ``from_pretrained`` and before :func:`moewire.quantize`.

    - ``"moewire"`` experts: build the Mega-MoE state (kernel weights, buffer). A module
      without a state builds the default one on its first forward (not under EP).
    - transformers' ``"deepgemm_megamoe"`` experts: load the DeepGEMM transformers runs
      (``kernel=None``: its kernels-hub build, SM100), or opt in to moewire's stand-in of that
      build (``kernel="stand-in"``: CPU or any GPU; :mod:`.megamoe` says exactly what is
      bypassed: transformers' SM100 assertion). The stand-in is used only when asked for.
    - Under transformers' expert parallelism (``model`` loaded with a ``DistributedConfig``
      with ``ep_size > 1``): every buffer spans the EP group and calibration reduces over
      the EP group and the data-parallel dimensions of the expert mesh (:mod:`.ep`).
    - ``"deepgemm_megamoe"`` experts on one process without an EP plan (a plain
      ``from_pretrained``, or ``DistributedConfig(ep_size=1)``, for which transformers applies
      none): each gets a one-rank process group that the forward is given
      (:func:`.megamoe.one_rank_group`; a process group of world size 1 is started when none
      runs). Under a process group of several ranks such a model is refused.

    Args:
        model: a transformers model.
        mma_type: ``"moewire"`` experts: a build of ``kernel`` (:data:`KERNELS`); default its
            first: ``"bf16xbf16"`` for the stand-in, ``"fp8xfp8"`` for ``"deepgemm-sm90"``.
        max_num_tokens: ``"moewire"`` experts: tokens per kernel call (a longer batch is
            split).
        kernel: ``"moewire"`` experts: ``"stand-in"`` (``None``, the default) or
            ``"deepgemm-sm90"`` (DeepGEMM's real SM90 ``fp8_mega_moe``; the model on a
            Hopper GPU). ``"deepgemm_megamoe"`` experts: ``None`` (transformers' kernel) or
            ``"stand-in"``.
        group: the process group the ``"moewire"`` buffers span; default the EP group of a
            model transformers distributed, else one rank (``"deepgemm-sm90"``: a one-rank
            NCCL group, ``deepgemm_sm90.one_rank_group``).

    Returns:
        ``model``.

    Raises:
        ValueError: no experts module runs ``"moewire"`` or one of transformers' Mega-MoE
            implementations; a module's layout or activation is one the kernel cannot
            express; an unknown kernel or build (the message names the module).
        RuntimeError: ``"deepgemm-sm90"`` without a Hopper GPU or DeepGEMM's SM90 package;
            transformers' kernel without an SM100 GPU; ``"deepgemm_megamoe"`` experts without
            an EP plan under a process group of several ranks.
    """
    ours, theirs = experts_modules(model), site_modules(model)
    if not ours and not theirs:
        names = ", ".join(repr(n) for n in (IMPLEMENTATION, *(s.name for s in SITES)))
        raise ValueError(
            f"prepare: {type(model).__name__} has no experts module running "
            f"experts_implementation {names}; load it with from_pretrained(path, "
            f"experts_implementation={IMPLEMENTATION!r}) after register()"
        )
    ep_group, dp_groups = ep.mesh_groups(model)
    group = ep_group if group is None else group
    for name, module in ours:
        module.__dict__["_moewire_tf_name"] = name
        module.__dict__[megamoe.GROUPS] = (group, dp_groups)
        module.__dict__["_moewire_mega"] = _build_state(
            module, mma_type, max_num_tokens, kernel or "stand-in", group
        )
    by_site: dict[MegaMoeSite, list[tuple[str, nn.Module]]] = {}
    for name, module, site in theirs:
        module.__dict__["_moewire_tf_name"] = name
        module.__dict__[megamoe.GROUPS] = (ep_group, dp_groups)
        by_site.setdefault(site, []).append((name, module))
    for site, modules in by_site.items():
        _prepare_site(site, modules, mma_type, kernel)
        if ep_group is None:
            _give_one_rank_group(modules)
    return model


def _give_one_rank_group(modules: list[tuple[str, nn.Module]]) -> None:
    """Record a one-rank group on every module that runs without an EP plan (transformers
    marks the modules its plans reach ``_is_hooked``), for the trampoline to pass
    (:func:`.megamoe.one_rank_group`); one group for all of them."""
    group = None
    for name, module in modules:
        if getattr(module, "_is_hooked", False):
            continue
        if group is None:
            group = megamoe.one_rank_group(name, _local(module.gate_up_proj).device)
        module.__dict__[megamoe.ONE_RANK] = group
        module.__dict__[megamoe.GROUPS] = (group, ())
