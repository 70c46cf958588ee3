"""Each recognised experts class registered with moewire's wrapper: the bridge installed for
its site, and the experts adapter built from the site entry
(:func:`moewire.integrations.vllm.sites.site_adapter`), for the class and for a model's
subclasses whose forward lives in another module.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moewire.integrations.vllm import bridge
from moewire.integrations.vllm.discovery import _version_or_unknown, experts_sites
from moewire.integrations.vllm.groups import dp_device_group, ep_device_group
from moewire.integrations.vllm.sites import ExpertsSite, holder_class, recognise, site_adapter

__all__ = ["kernel_flavour", "register_site", "register_vllm_experts"]


def kernel_flavour(module: nn.Module) -> str:
    """The flavour of the DeepGEMM build that vLLM calls for ``module``.

    Read from the module object vLLM imports (``moewire.megamoe.flavours.detect``: which
    Mega-MoE functions it has and their parameters; ``MOEWIRE_FLAVOUR`` overrides). The
    layout check of the first routed batch is what proves the choice on a given build.

    Raises:
        RuntimeError: vLLM finds no DeepGEMM, or one moewire cannot place.
    """
    namespace = bridge.kernel_source()
    if namespace is None:
        raise RuntimeError(
            f"{getattr(module, 'prefix', type(module).__name__)}: vLLM imports no DeepGEMM "
            "(neither `deep_gemm` nor `vllm.third_party.deep_gemm`); install DeepGEMM, or a "
            "vLLM CUDA wheel, which bundles it"
        )
    from moewire.megamoe.flavours import detect

    return detect(namespace, getattr(module, "prefix", type(module).__name__)).name


def _ep_group(module: nn.Module) -> Any:
    return ep_device_group()


def _dp_group(module: nn.Module) -> Any:
    return dp_device_group()


def register_site(cls: type, site: ExpertsSite) -> None:
    """Install the bridge for ``site`` and register ``cls`` with moewire's wrapper.

    Everything comes from the site entry (``moewire.integrations.vllm.sites``): the staging
    globals rebound through the bridge (none for inline staging: the cast and the kernel
    are hooked on the DeepGEMM module object vLLM's ``_import_deep_gemm()`` returns), the
    buffer, the group, and for an experts object that is no ``nn.Module`` the class holding
    it, registered for its instances that hold one.

    Args:
        cls: the experts class (from ``site.module``, or a copy of that module loaded
            under another name, as the 0.33 tests do on a 0.32 install).
        site: where ``cls``'s forward reads the staging function.
    """
    from moewire.megamoe.registry import register_experts_class

    bridge.install_access()
    stage_globals = tuple(bridge.install(cls.__module__, fn) for fn in site.stage_fns)
    target = cls if site.holder is None else holder_class(site)
    register_experts_class(
        target,
        site_adapter(
            site,
            cls,
            forward_module=bridge.__name__,
            stage_globals=stage_globals,
            flavour=kernel_flavour,
            ep_group=_ep_group if site.group == "ep" else _dp_group,
            runtime=lambda: f"vLLM {_version_or_unknown()}",
        ),
    )


def register_vllm_experts() -> list[type]:
    """Register every Mega-MoE experts class of the installed vLLM (:func:`experts_sites`).

    Returns:
        The registered classes.
    """
    return [cls for cls, _ in _register_found()]


def _register_found() -> list[tuple[type, ExpertsSite]]:
    found = experts_sites()
    for cls, site in found:
        register_site(cls, site)
    return found


def _overrides_forward(sub: type, base: type) -> bool:
    for klass in sub.__mro__:
        if klass is base:
            return False
        if "forward" in vars(klass):
            return True
    return False


def _register_subclasses(model: nn.Module, found: list[tuple[type, ExpertsSite]]) -> None:
    """Register the model's subclasses of a found class whose forward lives in another
    module (GLM-5-Next's ``Glm5NextMegaMoEExperts(DeepseekV4MegaMoEExperts)``, say): the
    bridge rebinds the staging global of the module that defines the forward. A subclass
    that keeps its base's forward keeps its base's adapter; one whose own module lacks the
    site's structure keeps it too, and fails closed at its first forward."""
    seen: set[type] = set()
    for module in model.modules():
        sub = type(module)
        if sub in seen:
            continue
        seen.add(sub)
        for cls, site in found:
            if (sub is cls or not issubclass(sub, cls) or sub.__module__ == cls.__module__
                    or not _overrides_forward(sub, cls)):
                continue
            if recognise(sub, site) is None:
                register_site(sub, site)
            break
