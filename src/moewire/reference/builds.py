"""The DeepGEMM kernel builds the stand-in imitates, and which one new buffers get.

A *flavour* names a kernel build (DeepGEMM main, vLLM 0.32-0.34's bundled copies, DeepGEMM PR #323,
the two lines of vLLM's own DeepGEMM fork ``vllm-project/DeepGEMM``, DeepGEMM 2.8.0):
``deepgemm-main``, ``vllm-0.32``, ``vllm-0.33`` (the default), ``deepgemm-sm90``,
``deepgemm-vllm-situ``, ``deepgemm-vllm-dev`` or ``deepgemm-2.8`` (its NVFP4 x NVFP4
``fp4_fp4_mega_moe`` only, ``reference.fp4_fp4``);
:class:`KernelBuild` is what the stand-in needs to know of one (its kernels, where a fused shared
expert is added, its buffer's extra regions and kind of views). ``moewire.megamoe.flavours`` is
moewire's own, independent description of the same builds under the same names; the layout check is
what proves the two agree.

Choose the flavour with :class:`use_flavour` (a setter and a context manager) or the
environment variable ``MOEWIRE_REFERENCE_FLAVOUR``; :func:`moewire_flavour` says which
build the stand-in imitates now (how ``moewire.megamoe.flavours.detect`` recognises it).

May import: the standard library and ``catalogue`` (the MMA type of each kernel function;
nothing else of moewire, nor torch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from moewire.reference.catalogue import MMA_OF_KERNEL

ENV_FLAVOUR = "MOEWIRE_REFERENCE_FLAVOUR"
DEFAULT_FLAVOUR = "vllm-0.33"
# Names of earlier moewire versions, refused with their successors named (as
# moewire.megamoe.flavours).
RENAMED = {
    "upstream": "deepgemm-main",
    "vllm": "vllm-0.32 (shared expert added last) or vllm-0.33 (added first)",
    "sgl": "deepgemm-sm90",
}
#: How a build's kernel names SiTU's two tanh scales: (gate scale, up scale) keywords.
#: DeepGEMM 2.8.x (vLLM's bundled copies; vllm-project/DeepGEMM dev, ``deep_gemm/_C.py`` at
#: 051140f) takes ``activation_alpha`` and ``activation_beta``; vllm-project/DeepGEMM's 2.6.1
#: SiTU line (``deep_gemm/mega/__init__.py`` at 51655f2) takes ``activation_beta`` and
#: ``activation_linear_beta``: the same keyword ``activation_beta`` names the other scale.
SITU_ALPHA_BETA = ("activation_alpha", "activation_beta")
SITU_BETA_LINEAR_BETA = ("activation_beta", "activation_linear_beta")


@dataclass(frozen=True)
class KernelBuild:
    """A kernel build, as the stand-in imitates it.

    Attributes:
        name: the flavour: ``deepgemm-main``, ``vllm-0.32``, ``vllm-0.33``,
            ``deepgemm-sm90`` or ``deepgemm-2.8``.
        kernels: the Mega-MoE kernel functions the build has.
        shared_position: where a fused shared expert's row (stored at slot ``k``) is added
            in the sum: ``"first"``, ``"last"``, or ``None`` (fusion refused).
        norm_after_combine: mma types whose buffer has a ``combine_norm_buffer`` after the
            combine region.
        dlpack_views: the views are DLPack tensors, not storage-sharing views.
        situ_kwargs: the keywords of SiTU's gate and up tanh scales in its kernels
            (:data:`SITU_ALPHA_BETA` or :data:`SITU_BETA_LINEAR_BETA`).
    """

    name: str
    kernels: tuple[str, ...]
    shared_position: str | None
    norm_after_combine: tuple[str, ...] = ()
    dlpack_views: bool = False
    situ_kwargs: tuple[str, str] = SITU_ALPHA_BETA

    @property
    def mma_types(self) -> tuple[str, ...]:
        return tuple(MMA_OF_KERNEL[k] for k in self.kernels)


_BOTH = ("fp8_fp4_mega_moe", "bf16_mega_moe")

KERNEL_BUILDS: dict[str, KernelBuild] = {
    # DeepGEMM 54e2261 adds bf16_mega_moe (deep_gemm/mega/__init__.py); its combine
    # region is the buffer's last, as fp8_fp4_mega_moe's (csrc/apis/mega.hpp).
    "deepgemm-main": KernelBuild("deepgemm-main", _BOTH, None),
    "vllm-0.32": KernelBuild("vllm-0.32", _BOTH, "last"),
    "vllm-0.33": KernelBuild("vllm-0.33", _BOTH, "first", norm_after_combine=("bf16xbf16",)),
    "deepgemm-sm90": KernelBuild(
        "deepgemm-sm90", ("fp8_fp4_mega_moe",), None, dlpack_views=True
    ),
    # vllm-project/DeepGEMM's 2.6.1 SiTU line (51655f2): impls/sm100_fp8_fp4_mega_moe.cuh
    # adds the valid lanes in ascending order (__ffs), the shared lane k among them: last.
    "deepgemm-vllm-situ": KernelBuild(
        "deepgemm-vllm-situ", ("fp8_fp4_mega_moe",), "last",
        situ_kwargs=SITU_BETA_LINEAR_BETA,
    ),
    # vllm-project/DeepGEMM dev (2.8.1, 63aa62a): "Shared slot goes first" in both kernels;
    # the combine region is the buffer's last (layout/mega_moe.cuh: no norm buffer after it).
    "deepgemm-vllm-dev": KernelBuild("deepgemm-vllm-dev", _BOTH, "first"),
    # DeepGEMM 2.8.0 (deepseek-ai/DeepGEMM 0274ad7): the stand-in has its NVFP4 x NVFP4
    # kernel only (reference.fp4_fp4); a BF16 shared expert's row (slot k) is added last,
    # after the routed sum was rounded to BF16 (impls/sm100_fp4_fp4_mega_moe.cuh, 794783a).
    "deepgemm-2.8": KernelBuild("deepgemm-2.8", ("fp4_fp4_mega_moe",), "last"),
}

_flavour_setting: str | None = None


def _check_flavour(name: Any, where: str) -> str:
    if isinstance(name, str) and name in RENAMED:
        raise ValueError(
            f"{where}: reference kernel flavour {name!r} was renamed (one flavour per DeepGEMM "
            f"build); use {RENAMED[name]}"
        )
    if name not in KERNEL_BUILDS:
        raise ValueError(
            f"{where}: unknown reference kernel flavour {name!r}; "
            f"use one of {sorted(KERNEL_BUILDS)}"
        )
    return name


def current_flavour() -> str:
    """The flavour new buffers get: ``use_flavour``'s, else the env var's, else
    ``vllm-0.33``."""
    if _flavour_setting is not None:
        return _flavour_setting
    env = os.environ.get(ENV_FLAVOUR)
    if env:
        return _check_flavour(env, f"environment variable {ENV_FLAVOUR}")
    return DEFAULT_FLAVOUR


def moewire_flavour() -> str:
    """The build the stand-in imitates now (:func:`current_flavour`): the fact
    ``moewire.megamoe.flavours.detect`` reads from a stand-in module."""
    return current_flavour()


class use_flavour:  # lower case: used as a plain call (a setter) as often as in `with`
    """Select the flavour (kernel build) of buffers built from now on.

    ``use_flavour("vllm-0.32")`` sets it until changed; ``with use_flavour(...): ...`` sets it
    for the block and restores the previous setting on exit.
    """

    def __init__(self, name: str) -> None:
        global _flavour_setting
        _check_flavour(name, "use_flavour")
        self.name = name
        self._previous = _flavour_setting
        _flavour_setting = name

    def __enter__(self) -> use_flavour:
        return self

    def __exit__(self, *exc: object) -> None:
        global _flavour_setting
        _flavour_setting = self._previous
