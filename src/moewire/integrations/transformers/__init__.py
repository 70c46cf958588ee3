"""moewire as a transformers experts implementation: ``experts_implementation="moewire"``.

transformers 5.23.0 (``transformers/integrations/moe.py``) gives every modern MoE model one
experts contract, ``Experts.forward(hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]``, and a registry of implementations
(``ExpertsInterface``) that ``use_experts_implementation`` dispatches to from
``config._experts_implementation``. This package registers ``"moewire"`` there
(:mod:`.registration`). Its forward (:mod:`.forward`) runs the experts through the
Mega-MoE contract of the stand-in DeepGEMM kernel (``moewire.reference.deep_gemm``) or
DeepGEMM's real SM90 kernel, the way vLLM's ``DeepGemmMegaMoEExperts`` does; the kernel
and its build are chosen by :func:`prepare` (:mod:`.state` lists them).
:func:`moewire.quantize` interposes on the forward's staging and kernel globals as on
vLLM's: each experts module, once converted, has ``dispatch_quantizer`` and
``combine_quantizer`` named ``model.layers.N.mlp.experts.{dispatch,combine}_quantizer``.

What the model keeps: its router (``top_k_weights`` arrive scaled by
``routed_scaling_factor``, which transformers' routers apply, e.g. DeepSeek-V3's
``DeepseekV3TopkRouter.forward``), its shared expert (added by the MoE block after the
experts, on unquantized tokens, as vLLM's unfused shared expert) and its SwiGLU limit
(DeepSeek-V4's ``swiglu_limit`` becomes the kernel's ``activation_clamp``).

A layout or an activation the kernel cannot express (biases, gpt-oss's ``(up + 1) * gate *
sigmoid(alpha * gate)``, a custom ``_apply_gate``, a non-SiLU activation) is refused
(:mod:`.architectures`).

Usage::

    import moewire.integrations.transformers as mt
    mt.register()
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moewire")
    mt.prepare(model)                    # build the Mega-MoE state of every experts module
    moewire.quantize(model, "moe_fp8", forward_loop)

Scale names map to the serving engines' module names with :func:`serving_name` (see
``docs/eval.md``).

Two more things run through this package:

- transformers' own Mega-MoE, ``experts_implementation="deepgemm_megamoe"`` (``FP8Experts``
  of a pre-quantized FP4 checkpoint, the kernels-hub DeepGEMM): a site moewire hooks like
  vLLM's (:mod:`.sites`, :mod:`.megamoe`); ``prepare(model)`` loads transformers' kernel,
  ``prepare(model, kernel="stand-in")`` opts in to moewire's stand-in of it (CPU, Hopper).
- expert parallelism (:mod:`.ep`): under ``torchrun`` with ``DistributedConfig(tp_size=N,
  ep_size=N, ep_implementation="moewire")`` the ``"moewire"`` experts run through
  transformers' ``MegaMoeEP``; ``prepare`` builds each buffer on the EP group, calibration
  reduces over EP and DP, and :func:`save_scales` writes one file from rank 0.

The package, one module per job: :mod:`.architectures` (the families and the layout check),
:mod:`.scales` (serving names, :func:`save_scales`), :mod:`.state` (kernels, builds, kernel
weights and buffers), :mod:`.forward` (the experts forward), :mod:`.registration`
(:func:`register`), :mod:`.prepare` (:func:`prepare`), :mod:`.sites` and :mod:`.megamoe`
(transformers' own Mega-MoE), :mod:`.ep` (expert parallelism). This file is the glue.
"""

from __future__ import annotations

from moewire.integrations.transformers import ep, megamoe, sites
from moewire.integrations.transformers.architectures import (
    ARCHITECTURES,
    Architecture,
    architecture_of,
)
from moewire.integrations.transformers.forward import (
    deep_gemm,
    moewire_experts_forward,
    stage_fp4_fp4_inputs,
)
from moewire.integrations.transformers.prepare import prepare, site_modules
from moewire.integrations.transformers.registration import (
    IMPLEMENTATION,
    experts_modules,
    register,
    unregister,
)
from moewire.integrations.transformers.scales import (
    save_scales,
    save_serving_scales,
    serving_name,
)
from moewire.integrations.transformers.state import DEFAULT_MAX_TOKENS, KERNELS, MMA_TYPES

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_MAX_TOKENS",
    "IMPLEMENTATION",
    "KERNELS",
    "MMA_TYPES",
    "Architecture",
    "architecture_of",
    "deep_gemm",
    "ep",
    "experts_modules",
    "megamoe",
    "moewire_experts_forward",
    "prepare",
    "register",
    "save_scales",
    "save_serving_scales",
    "serving_name",
    "site_modules",
    "sites",
    "stage_fp4_fp4_inputs",
    "unregister",
]
