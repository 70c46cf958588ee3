"""The quantized experts class: what ``Quant<Cls>.forward`` does around the experts' own.

:class:`QuantExperts` is the mixin first in the MRO of every generated ``Quant<Cls>``
(:mod:`moewire.megamoe.convert`). Its forward marks itself running
(:mod:`moewire.megamoe.active`), runs the experts' own forward, and fails closed if an
enabled quantizer's hook was not reached. The hooks (:mod:`moewire.megamoe.hooks`) call
back into it:

- the staging hook (:meth:`QuantExperts._moewire_stage`): the ``hidden_states`` argument
  of the staging call is replaced by ``dispatch_quantizer(hidden_states)``, out of place,
  so the router and an unfused shared expert (added after the kernel) see the original
  tokens;
- the combine hook (:meth:`QuantExperts._moewire_combine`), right after the kernel returns
  (before ``y += shared_experts(...)``): the combine rows are read from the buffer (at the
  place the flavour gives for that kernel), checked (:mod:`moewire.megamoe.layout_check`),
  fake-quantized, re-summed in the kernel's order (:func:`~moewire.megamoe.resum.resum`)
  and written into ``y`` in place.

A shared expert fused into the kernel reads the staged tokens too (DeepGEMM's SM100 kernels:
``shared_l1_acts = x``), while the dispatch quantizer stands for the wire, which the shared
expert's tokens never cross. With the dispatch quantizer quantizing, the kernel runs twice
(:meth:`QuantExperts._moewire_shared_pass`): first on the original tokens staged with no
routed slot, which leaves exactly the shared expert's row (the first call's ``y``, proven
equal to the row the build stores at slot ``k``), then on the quantized tokens; the second
call's routed rows and the first call's shared row are re-summed in the build's order.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moewire.megamoe import flavours as _flavours
from moewire.megamoe import layout_check
from moewire.megamoe.active import (
    ACTIVE,
    CAST_CALIBRATION,
    IN_STAGING_CALL,
    PLAIN_COPY_HOOK,
    REACHED,
    SHARED_PASS,
)
from moewire.megamoe.layout import (
    ENV_FP8_COMBINE,
    combine_fp8_rows,
    combine_rows,
    dequantize_fp8_rows,
    holds_fp8_combine,
)
from moewire.megamoe.registry import ExpertsAdapter, adapter_for, stage_fn_names
from moewire.quantizer.contract import WireQuantizerModule

__all__ = [
    "FUSION_SWITCH",
    "QUANTIZER_NAMES",
    "STATE_KEYS",
    "QuantExperts",
    "amax_rows",
    "kernel_rows",
    "original_class",
    "set_amax_rows",
    "set_module_name",
]

FUSION_SWITCH = "VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION=1"
QUANTIZER_NAMES = ("dispatch_quantizer", "combine_quantizer")
# What a converted module keeps in its __dict__ (``convert.unconvert`` removes them).
STATE_KEYS = (
    "_moewire_adapter_", "_moewire_name_", "_moewire_kernel_rows_", "_moewire_amax_rows_"
)

# A call's positional and keyword arguments, as a hook receives and rebuilds them.
Args = tuple[Any, ...]
Kwargs = dict[str, Any]


def _locate_hidden(
    fn: Callable[..., Any], args: Args, kwargs: Kwargs, where: int | str, name: str
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[Args, Kwargs]]]:
    """Find ``hidden_states`` in a staging call; returns it and a function that rebuilds
    the call's ``(args, kwargs)`` with a replacement."""
    if isinstance(where, int) and len(args) > where:

        def put_positional(value: torch.Tensor) -> tuple[Args, Kwargs]:
            return args[:where] + (value,) + args[where + 1 :], kwargs

        return args[where], put_positional
    if isinstance(where, str) and where in kwargs:

        def put_keyword(value: torch.Tensor) -> tuple[Args, Kwargs]:
            return args, {**kwargs, where: value}

        return kwargs[where], put_keyword
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    key = params[where] if isinstance(where, int) and where < len(params) else where
    if isinstance(key, str) and key in kwargs:
        return _locate_hidden(fn, args, kwargs, key, name)
    if isinstance(key, str) and key in params and params.index(key) < len(args):
        return _locate_hidden(fn, args, kwargs, params.index(key), name)
    raise RuntimeError(
        f"{name}: the staging call has no hidden_states argument at {where!r} (got "
        f"{len(args)} positional and keywords {sorted(kwargs)}); fix the adapter's "
        "stage_hidden_arg"
    )



if TYPE_CHECKING:
    # The mixin is only ever first in the MRO of an experts nn.Module (Quant<Cls>).
    _ExpertsModule = nn.Module
else:
    _ExpertsModule = object


class QuantExperts(_ExpertsModule):
    """Mixin of the generated ``Quant<Cls>`` classes (first in their MRO).

    Needs two submodules, ``dispatch_quantizer`` and ``combine_quantizer``, with the
    :class:`~moewire.quantizer.WireQuantizer` surface (``mode``, ``is_static_scale()``,
    ``static_amax``, ``collect(x)``, ``__call__``); another class-swap framework (ModelOpt's
    ``QuantModuleRegistry``) can put this mixin first in its own generated class, create
    the two quantizers and call :func:`install_proxies` for the class's adapter. The
    adapter is looked up from the class (``adapter_for``); :func:`set_module_name` sets the
    name used in errors (default: the class name).
    """

    _moewire_quant_class = True
    dispatch_quantizer: WireQuantizerModule
    combine_quantizer: WireQuantizerModule

    @property
    def _moewire_adapter(self) -> ExpertsAdapter:
        adapter = self.__dict__.get("_moewire_adapter_")
        if adapter is None:
            adapter = adapter_for(self)
            if adapter is None:
                raise TypeError(
                    f"{type(self).__name__} has no experts adapter; register its base class "
                    "with moewire.megamoe.register_experts_class"
                )
            self.__dict__["_moewire_adapter_"] = adapter
        return adapter

    @property
    def _moewire_name(self) -> str:
        return self.__dict__.get("_moewire_name_") or type(self).__name__

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.moewire_run(super().forward, *args, **kwargs)

    def moewire_run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` as this module's Mega-MoE forward: hooks active,
        then the fail-closed check of :meth:`forward`.

        A host whose forward is a function taking the experts module rather than the
        module's own ``forward`` (SGLang's ``run_mega_routed_experts(moe.experts, ...)``)
        runs that function through here.
        """
        self._moewire_refuse()
        reached: set[str] = set()
        pending: list[torch.Tensor] = []
        owed: list[Callable[[], Any]] = []
        token, reached_token = ACTIVE.set(self), REACHED.set(reached)
        pending_token, owed_token = CAST_CALIBRATION.set(pending), SHARED_PASS.set(owed)
        try:
            args, kwargs = self._moewire_stage_forward(args, kwargs)
            result = fn(*args, **kwargs)
        finally:
            ACTIVE.reset(token)
            REACHED.reset(reached_token)
            CAST_CALIBRATION.reset(pending_token)
            SHARED_PASS.reset(owed_token)
        if owed:
            raise RuntimeError(
                f"{self._moewire_name}: the forward of {original_class(type(self)).__qualname__} "
                "staged its tokens for a fused shared expert's own kernel launch, but no hooked "
                "Mega-MoE kernel call followed, so the quantized tokens were never staged and "
                "the buffer holds the original ones; call the kernel through the deep_gemm "
                "module in the same forward as the staging"
            )
        if pending:
            raise RuntimeError(
                f"{self._moewire_name}: dispatch_quantizer is calibrating and the forward of "
                f"{original_class(type(self)).__qualname__} staged its tokens with DeepGEMM's "
                "per_token_cast_to_fp8, but no hooked Mega-MoE kernel call followed, so "
                "moewire never saw which tokens were staged with a valid slot (padding must "
                "stay out of the amax) and collected nothing; call the kernel through the "
                "deep_gemm module in the same forward, or calibrate through a staging "
                "function (an experts adapter's stage_fn)"
            )
        self._moewire_require_hooks(reached)
        return result

    def _moewire_refuse(self) -> None:
        """Refuse a class whose adapter says moewire cannot quantize it, unless every
        quantizer is disabled."""
        refusal = self._moewire_adapter.refusal
        if refusal is not None and any(
            getattr(self, q).mode != "disabled" for q in QUANTIZER_NAMES
        ):
            raise RuntimeError(
                f"{self._moewire_name}: moewire does not quantize "
                f"{original_class(type(self)).__qualname__}: {refusal}"
            )

    def _moewire_stage_forward(self, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        """The staging hook of a forward that stages with a plain copy (the adapter's
        ``forward_dispatch``): the tokens' argument of this forward becomes
        ``dispatch_quantizer(tokens)``, out of place (calibrating: collected at the kernel
        call, once the ids are staged). Other forwards pass unchanged."""
        adapter = self._moewire_adapter
        if adapter.forward_dispatch is None or self.dispatch_quantizer.mode == "disabled":
            return args, kwargs
        where = adapter.forward_dispatch(self)
        if where is None:
            return args, kwargs

        def rebuild(*a: Any, **k: Any) -> tuple[Args, Kwargs]:
            return a, k

        rebuild.__signature__ = inspect.signature(super().forward)  # type: ignore[attr-defined]
        # Both marks live in this forward's REACHED set: "staging" for the fail-closed
        # check, the plain-copy mark so a staging call or cast in the same forward refuses
        # (the tokens are quantized already).
        REACHED.get().update(("staging", PLAIN_COPY_HOOK))  # type: ignore[union-attr]
        staged: tuple[Args, Kwargs] = self._moewire_stage(
            rebuild, args, kwargs, cast="plain copy", where=where
        )
        return staged

    def _moewire_require_hooks(self, reached: set[str]) -> None:
        """Fail closed: an enabled quantizer whose hook the forward never reached.

        The dispatch quantizer acts in the staging call, the combine quantizer right after
        the kernel call; a forward that stages inline, imports ``deep_gemm`` under another
        name or calls a kernel function no flavour describes would otherwise run
        unquantized without a word.
        """
        needed = (
            ("dispatch_quantizer", "staging", "the staging call"),
            ("combine_quantizer", "kernel", "the Mega-MoE kernel call"),
        )
        for quantizer_name, hook, what in needed:
            if getattr(self, quantizer_name).mode == "disabled" or hook in reached:
                continue
            adapter = self._moewire_adapter
            if hook == "staging":
                globals_ = "|".join(stage_fn_names(adapter))
                casts = "|".join(sorted(_flavours.staging_casts()))
                looked = (
                    (f"{adapter.forward_module}.<{globals_}>, or " if globals_ else "")
                    + f"the first {casts} of [T, hidden] tokens through the hooked deep_gemm "
                    "module before the kernel call"
                )
            else:
                looked = (
                    f"{adapter.forward_module}.{adapter.kernel_ns}.<"
                    f"{'|'.join(sorted(_flavours.kernel_functions()))}>"
                )
            raise RuntimeError(
                f"{self._moewire_name}: the forward of {original_class(type(self)).__qualname__} "
                f"({adapter.runtime()}) finished without reaching moewire's {hook} hook "
                f"({what}, through {looked}), so {quantizer_name} did not run and the output "
                "is unquantized. This forward stages or calls the kernel some other way "
                "(inline staging, a local import of deep_gemm, a kernel function no flavour "
                f"describes); register an experts adapter for it, or disable {quantizer_name}"
            )

    # -- dispatch ------------------------------------------------------------------------

    def _moewire_stage(
        self,
        fn: Callable[..., Any],
        args: Args,
        kwargs: Kwargs,
        cast: str | None = None,
        where: int | str | None = None,
    ) -> Any:
        """The staging hook: run ``fn`` (the staging function, or with ``cast`` DeepGEMM's
        staging cast of that name, hidden states first or at ``where``) on
        ``dispatch_quantizer(hidden)``.

        Calibrating, ``fn`` runs on the original tokens and the tokens with a valid staged
        slot are collected: right after a staging function (it stages the ids), or at the
        kernel call after a cast (the caller stages the ids after casting).
        """
        quantizer = self.dispatch_quantizer
        if quantizer.mode == "disabled":
            return fn(*args, **kwargs)
        adapter = self._moewire_adapter
        fused = adapter.fused_shared(self) and quantizer.mode == "quantize"
        if fused and cast is not None:
            raise RuntimeError(
                f"{self._moewire_name}: the dispatch quantizer is enabled but a shared expert "
                "is fused into the Mega-MoE kernel, which reads the same staged tokens; "
                "moewire gives it the original tokens by a second kernel launch only where "
                "the forward stages through a staging function it can call again, and this "
                f"forward stages with {cast}, so the shared expert would see quantized inputs "
                f"too; run with {FUSION_SWITCH} (vLLM) or build the layer with the shared "
                "expert unfused, or disable the dispatch quantizer"
            )
        if where is None:
            where = adapter.stage_hidden_arg if cast is None else 0
        hidden, put = _locate_hidden(fn, args, kwargs, where, self._moewire_name)
        _on_device(quantizer, hidden.device, self._moewire_name, "dispatch_quantizer")
        if fused:
            return self._moewire_stage_for_shared_pass(fn, args, kwargs, put(quantizer(hidden)))
        if quantizer.mode == "calibrate":
            result = fn(*args, **kwargs)
            if cast is None:
                self._moewire_collect_staged(hidden)
            else:
                pending = CAST_CALIBRATION.get()
                if pending is not None:
                    pending.append(hidden)
            return result
        args, kwargs = put(quantizer(hidden))
        return fn(*args, **kwargs)

    def _moewire_stage_for_shared_pass(
        self, fn: Callable[..., Any], args: Args, kwargs: Kwargs, quantized: tuple[Args, Kwargs]
    ) -> Any:
        """Stage a forward whose kernel fuses a shared expert, with the dispatch quantizer
        quantizing: now the original tokens with every routed slot invalid (``topk_ids`` all
        -1: no EPLB load is recorded, no token is dispatched), which is what the shared
        expert's own launch reads (:meth:`_moewire_shared_pass`); the call on the quantized
        tokens (``quantized``: its ``(args, kwargs)``) is owed to the kernel hook, which
        makes it after that launch."""
        name = self._moewire_name
        try:
            ids, put_ids = _locate_hidden(fn, args, kwargs, "topk_ids", name)
        except RuntimeError:
            raise RuntimeError(
                f"{name}: the dispatch quantizer is enabled and a shared expert is fused into "
                "the Mega-MoE kernel; moewire stages the original tokens with no routed slot "
                "for the shared expert's own launch, but the staging call has no topk_ids "
                f"argument to clear; run with {FUSION_SWITCH} (vLLM) or build the layer with "
                "the shared expert unfused, or disable the dispatch quantizer"
            ) from None
        owed = SHARED_PASS.get()
        if owed is None or owed:
            raise RuntimeError(
                f"{name}: a second staging call in one forward while the fused shared "
                "expert's pass of the first is still owed; stage once per forward"
            )
        shared_args, shared_kwargs = put_ids(torch.full_like(ids, -1))
        result = fn(*shared_args, **shared_kwargs)
        quantized_args, quantized_kwargs = quantized
        owed.append(lambda: fn(*quantized_args, **quantized_kwargs))
        return result

    def _moewire_shared_pass(
        self, kernel_fn: Callable[..., Any], args: Args, kwargs: Kwargs, kernel: str
    ) -> torch.Tensor | None:
        """At the kernel call of a forward that owes a quantized staging (a fused shared
        expert, the dispatch quantizer quantizing): the shared expert's own launch, then the
        owed staging. Returns its output (the shared row of every token, BF16 ``[T, H]``),
        or ``None`` when nothing is owed.

        The launch is the forward's own kernel call with its ``y`` replaced: the buffer holds
        the original tokens with no routed slot, so the kernel dispatches nothing and sums
        only the shared row, stored at slot ``k`` and never quantized; the first time a
        buffer is unchecked, that output is checked to equal the row the build stores there
        (:func:`~moewire.megamoe.layout_check.check_shared_pass`). Then the quantized tokens
        are staged (with their routing), and the forward's call runs on them.
        """
        owed = SHARED_PASS.get()
        if not owed:
            return None
        restage = owed.pop()
        adapter = self._moewire_adapter
        symm_buffer = adapter.get_symm_buffer(self)
        if holds_fp8_combine(symm_buffer):
            raise RuntimeError(
                f"{self._moewire_name}: the buffer holds DeepGEMM's FP8 combine "
                f"({ENV_FP8_COMBINE}=1), whose shared row moewire cannot put back in its "
                "place; unset it, or run the dispatch quantizer with the shared expert "
                f"unfused ({FUSION_SWITCH} under vLLM)"
            )
        flavour = _flavours.get(adapter.flavour(self))
        y = args[0] if args else kwargs["y"]
        shared_row = torch.empty_like(y)
        if args:
            kernel_fn(shared_row, *args[1:], **kwargs)
        else:
            kernel_fn(*args, **{**kwargs, "y": shared_row})
        state = layout_check.buffer_state(symm_buffer)
        if not state.checked:
            rows = combine_rows(symm_buffer, flavour, kernel, fused_shared=True)
            layout_check.check_shared_pass(
                self._moewire_name, state, rows[-1, : y.shape[0]], shared_row, flavour, kernel
            )
        token = IN_STAGING_CALL.set(True)
        try:
            restage()
        finally:
            IN_STAGING_CALL.reset(token)
        return shared_row

    def _moewire_collect_staged(self, hidden: torch.Tensor) -> None:
        """Calibrate the dispatch amax on the tokens staged with a valid slot."""
        staged = self._moewire_adapter.get_symm_buffer(self).topk_idx[: hidden.shape[0]]
        # Only tokens with a valid slot reach an expert; padding never does. Boolean
        # indexing syncs with the host, which calibration (eager, before capture) allows.
        self.dispatch_quantizer.collect(hidden[(staged >= 0).any(dim=1)])

    def _moewire_collect_cast_calibration(self) -> None:
        """At the kernel call, before the kernel runs (it may clear the buffer): collect
        the tokens a staging cast saw, now that their ids are staged."""
        pending = CAST_CALIBRATION.get()
        while pending:
            self._moewire_collect_staged(pending.pop())

    # -- combine -------------------------------------------------------------------------

    def _moewire_before_kernel(
        self, y: torch.Tensor, shared_pass: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The staged ids and router weights of this call, copied before the kernel runs
        (or None when the combine is off): a kernel may clear the buffer
        (``DG_COMM_KERNEL_DEBUG=1`` zeroes all of it), and validity read afterwards would
        turn padding into routed slots.

        A buffer that holds DeepGEMM's FP8 combine rows (``DG_USE_FP8_COMBINE=1``) is read
        with the combine off too, until its layout check has passed; with the combine
        quantizer on it is refused here, before the kernel runs: the kernel already
        quantizes its combine, and a quantizer on top would quantize it twice. After a
        fused shared expert's own launch (``shared_pass``) they are read whatever the
        combine's mode: its shared row goes back into the sum."""
        symm_buffer = self._moewire_adapter.get_symm_buffer(self)
        mode = self.combine_quantizer.mode
        if holds_fp8_combine(symm_buffer):
            if mode != "disabled":
                raise RuntimeError(
                    f"{self._moewire_name}: the combine quantizer is in {mode!r} mode, but the "
                    f"Mega-MoE buffer holds DeepGEMM's FP8 combine ({ENV_FP8_COMBINE}=1): the "
                    "kernel already quantizes its combine, and a combine quantizer on top "
                    "would quantize it twice. Disable the combine quantizer (a dispatch-only "
                    f"recipe), or unset {ENV_FP8_COMBINE} and study that combine with the "
                    "deepgemm_fp8_combine recipe"
                )
            if layout_check.buffer_state(symm_buffer).checked:
                return None
        elif mode == "disabled" and not shared_pass:
            return None
        t = y.shape[0]
        return symm_buffer.topk_idx[:t].clone(), symm_buffer.topk_weights[:t].clone()

    def _moewire_combine(
        self,
        y: torch.Tensor,
        staged: tuple[torch.Tensor, torch.Tensor],
        kernel: str,
        call_args: tuple[Callable[..., Any], Args, Kwargs] | None = None,
        shared_row: torch.Tensor | None = None,
    ) -> None:
        """Check, then calibrate or re-sum the combine rows into ``y``.

        Args:
            y: the kernel's output, BF16 ``[T, H]``.
            staged: int64 ``[T, k]`` ids and FP32 ``[T, k]`` router weights, as staged
                before the kernel ran (the weights enter the sum of a weighted kernel only).
            kernel: the kernel function that ran (``"fp8_fp4_mega_moe"``).
            call_args: ``(function, args, kwargs)`` of that call, where a layout reads one
                of its arguments (``KernelLayout.routed_scale``).
            shared_row: BF16 ``[T, H]``, the fused shared expert's row on the original
                tokens (:meth:`_moewire_shared_pass`), or ``None``. After the layout check
                of this call's own rows it takes the place of this call's shared row (which
                read the quantized tokens), and ``y`` is re-summed whatever the mode.
        """
        topk_idx, topk_weights = staged
        quantizer = self.combine_quantizer
        name = self._moewire_name
        if quantizer.mode == "quantize" and not quantizer.is_static_scale():
            raise RuntimeError(
                f"{name}: the combine quantizer needs a calibrated or constant amax (each "
                "rank re-quantizes rows from all expert ranks, and a scale computed per call "
                "from this rank's rows would also see padding and stale rows); run "
                "calibration or set constant_amax"
            )
        adapter = self._moewire_adapter
        flavour = _flavours.get(adapter.flavour(self))
        fused = bool(adapter.fused_shared(self))
        symm_buffer = adapter.get_symm_buffer(self)
        if holds_fp8_combine(symm_buffer):
            self._moewire_check_fp8_combine(y, topk_idx, topk_weights, kernel)
            return
        layout = flavour.layout(kernel)
        rows = combine_rows(symm_buffer, flavour, kernel, fused_shared=fused)
        kind = _flavours.rows_kind(layout)
        self.__dict__["_moewire_kernel_rows_"] = kind
        described = amax_rows(self)
        if quantizer.mode == "quantize" and described not in (None, kind):
            raise RuntimeError(
                f"{name}: the combine quantizer's amax was calibrated on {described} combine "
                f"rows, but {kernel} leaves {kind} rows (nvfp4_mega_moe's rows are unweighted "
                "expert outputs, fp8_fp4_mega_moe's and bf16_mega_moe's are router-weighted); "
                "calibrate the combine amax on this kernel, or load scales saved from it"
            )
        shared = layout.shared_position if fused else None
        # nvfp4_mega_moe's rows are unweighted: its combine applies the router weights.
        weights = topk_weights.float() if layout.weighted else None
        num_tokens = y.shape[0]
        _on_device(quantizer, y.device, name, "combine_quantizer")
        state = layout_check.buffer_state(symm_buffer)
        scale = _routed_scale(name, layout, kernel, call_args, fused)
        call = layout_check.Combine(rows, topk_idx, num_tokens, shared, weights, y, flavour, kernel,
                                    scale)
        if (shared_row is None and scale is None and not state.checked
                and layout_check.one_pass(quantizer, y)):
            layout_check.check_in_one_pass(name, quantizer, state, call)
            return
        if not state.checked:
            layout_check.check(name, state, call)
        if shared_row is not None:
            rows[topk_idx.shape[1], :num_tokens].copy_(shared_row)
        if quantizer.mode == "calibrate":
            # Valid rows only: invalid slots hold stale rows, padding tokens have no valid
            # slot, and the fused shared row (index k) is not on the wire. For a weighted
            # kernel these are the unweighted expert outputs (docs/formats.md).
            valid = (topk_idx[:num_tokens] >= 0).T
            quantizer.collect(rows[: topk_idx.shape[1], :num_tokens][valid])
            self.__dict__["_moewire_amax_rows_"] = kind
            if shared_row is not None:
                call.resum(out=y)
            return
        call.resum(row_quantizer=quantizer if quantizer.mode == "quantize" else None, out=y)

    def _moewire_check_fp8_combine(
        self, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, kernel: str
    ) -> None:
        """The layout check of a buffer with DeepGEMM's FP8 combine rows (the combine
        quantizer is off: :meth:`_moewire_before_kernel` refuses it): the rows read as the
        kernel reads them (``layout.combine_fp8_rows``, ``layout.dequantize_fp8_rows``),
        summed in the kernel's order in FP32 from +0.0 and rounded to BF16 once, must equal
        ``y`` bit for bit; ``y`` is left as the kernel wrote it."""
        adapter = self._moewire_adapter
        flavour = _flavours.get(adapter.flavour(self))
        fused = bool(adapter.fused_shared(self))
        symm_buffer = adapter.get_symm_buffer(self)
        layout = flavour.layout(kernel)
        q, sf = combine_fp8_rows(symm_buffer, flavour, kernel, fused_shared=fused)
        num_tokens = y.shape[0]
        rows = dequantize_fp8_rows(q, sf, num_tokens)
        weights = topk_weights.float() if layout.weighted else None
        shared = layout.shared_position if fused else None
        call = layout_check.Combine(rows, topk_idx, num_tokens, shared, weights, y, flavour, kernel)
        layout_check.check(self._moewire_name, layout_check.buffer_state(symm_buffer), call)


def _routed_scale(
    name: str,
    layout: Any,
    kernel: str,
    call_args: tuple[Callable[..., Any], Args, Kwargs] | None,
    fused: bool,
) -> float | None:
    """The factor of a layout's ``routed_scale`` step for this kernel call (its keyword
    argument, by keyword or position, else the function's default), or ``None`` where the
    step is the identity (factor 1 and no fused shared row) or the layout has none."""
    arg = layout.routed_scale
    if arg is None:
        return None
    fn, args, kwargs = call_args if call_args is not None else (None, (), {})
    if arg in kwargs:
        value = kwargs[arg]
    else:
        try:
            if fn is None:  # no call to read it from
                raise TypeError(kernel)
            bound = inspect.signature(fn).bind_partial(*args, **kwargs)
            bound.apply_defaults()
            value = bound.arguments[arg]
        except (TypeError, ValueError, KeyError):
            raise RuntimeError(
                f"{name}: {kernel} scales its routed sum by its argument {arg!r}, which moewire "
                "cannot read from this call (the function's signature is unreadable or lacks "
                f"it); pass {arg}= by keyword"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
        value
    ):
        raise RuntimeError(
            f"{name}: {kernel} was called with {arg}={value!r}; moewire re-sums its combine "
            "with a finite Python float only (DeepGEMM takes a C float)"
        )
    factor = float(torch.tensor(float(value), dtype=torch.float32))
    return None if factor == 1.0 and not fused else factor


def amax_rows(module: nn.Module) -> str | None:
    """Which combine rows the module's combine amax describes (``flavours.rows_kind``):
    set by calibration or :func:`set_amax_rows`; ``None`` when unknown."""
    return module.__dict__.get("_moewire_amax_rows_")


def kernel_rows(module: nn.Module) -> str | None:
    """The kind of combine rows the module's kernel left in its last forward, or ``None``."""
    return module.__dict__.get("_moewire_kernel_rows_")


def set_amax_rows(module: nn.Module, kind: str | None) -> None:
    """Record which combine rows a loaded amax describes (``load_scales``)."""
    if kind is not None and kind not in _flavours.ROWS_KINDS:
        raise ValueError(
            f"set_amax_rows: kind must be 'weighted', 'unweighted' or None, got {kind!r}"
        )
    module.__dict__["_moewire_amax_rows_"] = kind



def _on_device(
    quantizer: WireQuantizerModule, device: torch.device, name: str, which: str
) -> None:
    """Keep the quantizer's state where the data is: moved eagerly, refused mid-capture."""
    state = [t for t in (quantizer.static_amax, *quantizer.buffers()) if t is not None]
    if all(t.device == device for t in state):
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{name}.{which}: its state is on {state[0].device} while a CUDA graph is being "
            f"captured on {device}; move the model to the device (model.to({str(device)!r})) "
            "or run one eager forward before capture"
        )
    quantizer.to(device)



def set_module_name(module: nn.Module, name: str) -> None:
    """Set the name a quantized experts module uses in its errors (its path in the model)."""
    module.__dict__["_moewire_name_"] = name


def original_class(quant: type) -> type:
    """The experts class a generated ``Quant<Cls>`` was made from.

    Raises:
        TypeError: ``quant`` is not a class generated by moewire's ``convert``.
    """
    cls: type | None = quant.__dict__.get("_moewire_original_class")
    if cls is None:
        raise TypeError(f"{quant.__qualname__} is not a class generated by moewire's convert")
    return cls
