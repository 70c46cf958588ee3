"""What the study feeds the layer: hidden states, expert weights and the router.

Synthetic data (the default) is seeded and has the outlier structure of real MoE inputs:

- hidden states ``x`` BF16 ``[N, H]``, shaped like the input of a MoE layer, which comes
  out of an RMSNorm: ``x[t] = u[t] / rms(u[t]) * gamma``. ``u`` is standard normal, except
  that one token in 64 (at least one per batch) is an outlier token with 4 spike channels
  of magnitude ``U(50, 100)`` (as a sequence's first token has): after the norm its energy
  sits in those channels, values near ``sqrt(H / 4)``. ``gamma[c] = exp(0.3 * n_c)``, with
  ``max(1, H // 512)`` outlier channels multiplied by 10 (the norm weights of "massive"
  channels). Every ``u[t] / rms(u[t])`` has RMS 1, as after a real norm, so tokens differ
  in shape (spikes), not in overall scale. ``gamma`` is one per layer (:func:`norm_gamma`),
  shared by all of its batches and by the router fit, as a model's RMSNorm weights are;
- the router's synthetic weights are built by :func:`moewire.study.layer.build_layer`,
  the experts' by :func:`moewire.reference.make_weights` (outlier input channels).

Real data: expert weights from a safetensors checkpoint in DeepSeek's naming
(:data:`WEIGHT_NAMES`), and hidden states captured from a model (``.pt`` or
``.safetensors``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moewire.study.errors import StudyArgumentError
from moewire.study.paths import existing_file

#: Tensor names read from ``--weights`` for layer ``L`` and expert ``e`` (DeepSeek-V3/V4
#: and Kimi checkpoints in Hugging Face naming). Shapes: gate/up ``[I, H]``, down ``[H, I]``,
#: router ``[E, H]``, bias ``[E]``; shared experts ``[Is, H]`` / ``[H, Is]``.
WEIGHT_NAMES = {
    "gate": "model.layers.{L}.mlp.experts.{e}.gate_proj.weight",
    "up": "model.layers.{L}.mlp.experts.{e}.up_proj.weight",
    "down": "model.layers.{L}.mlp.experts.{e}.down_proj.weight",
    "router": "model.layers.{L}.mlp.gate.weight",
    "router_bias": "model.layers.{L}.mlp.gate.e_score_correction_bias",
    "shared_gate": "model.layers.{L}.mlp.shared_experts.gate_proj.weight",
    "shared_up": "model.layers.{L}.mlp.shared_experts.up_proj.weight",
    "shared_down": "model.layers.{L}.mlp.shared_experts.down_proj.weight",
}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass
class LayerWeights:
    """Dense weights of one MoE layer, before conversion to the kernel's formats.

    Attributes:
        w1: BF16 ``[E, 2I, H]``, rows ``[gate | up]`` (gate rows first).
        w2: BF16 ``[E, H, I]`` (down projection).
        router: FP32 ``[E, H]``.
        router_bias: FP32 ``[E]`` selection bias, or ``None``.
        shared_w1: BF16 ``[2Is, H]`` or ``None``; shared_w2: BF16 ``[H, Is]`` or ``None``.
        source: ``"synthetic(seed=S)"`` or the checkpoint path and layer.
    """

    w1: torch.Tensor
    w2: torch.Tensor
    router: torch.Tensor
    router_bias: torch.Tensor | None
    shared_w1: torch.Tensor | None
    shared_w2: torch.Tensor | None
    source: str

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w1.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2]

    @property
    def num_shared_intermediate(self) -> int:
        return 0 if self.shared_w2 is None else self.shared_w2.shape[1]


# --------------------------------------------------------------------------- synthetic


def norm_gamma(hidden: int, generator: torch.Generator) -> torch.Tensor:
    """Seeded FP32 ``[hidden]`` norm weights ``gamma`` (module docstring): one per layer."""
    gamma = torch.exp(0.3 * torch.randn(hidden, generator=generator))
    outlier_channels = torch.randperm(hidden, generator=generator)[: max(1, hidden // 512)]
    gamma[outlier_channels] *= 10.0
    return gamma


def synthetic_hidden_states(num_tokens: int, hidden: int, generator: torch.Generator,
                            gamma: torch.Tensor | None = None):
    """Seeded BF16 ``[num_tokens, hidden]`` post-norm hidden states (module docstring).

    ``gamma``: the layer's norm weights (:func:`norm_gamma`); pass the same one for every
    batch of a layer, as a model's RMSNorm has one. ``None`` draws a fresh one.
    """
    if gamma is None:
        gamma = norm_gamma(hidden, generator)
    u = torch.randn(num_tokens, hidden, generator=generator)
    num_outliers = max(1, num_tokens // 64)
    tokens = torch.randperm(num_tokens, generator=generator)[:num_outliers]
    for t in tokens.tolist():
        spikes = torch.randperm(hidden, generator=generator)[:4]
        sign = torch.randint(0, 2, (4,), generator=generator) * 2 - 1
        u[t, spikes] = sign * (50.0 + 50.0 * torch.rand(4, generator=generator))
    u = u * torch.rsqrt(u.square().mean(dim=1, keepdim=True))
    return (u * gamma).to(torch.bfloat16)


# --------------------------------------------------------------------------- router


@dataclass
class Router:
    """Top-k gating over router logits ``x @ weight.T``.

    ``sigmoid`` (DeepSeek-V3/V4, Kimi): ``s = sigmoid(logits)``; the top-k experts of
    ``s + bias`` are chosen; their weights are ``s`` at those experts divided by the sum
    of the ``k`` chosen ``s``. ``softmax``: ``p = softmax(logits + bias)``; the top-k of
    ``p`` with their ``p`` as weights (not renormalised). Everything in FP32.

    Attributes:
        weight: FP32 ``[E, H]``.
        bias: FP32 ``[E]`` or ``None``.
        top_k: ``k``.
        gating: ``"sigmoid"`` or ``"softmax"``.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    top_k: int
    gating: str

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route BF16 ``[T, H]`` tokens; returns FP32 weights and int64 ids, ``[T, k]``."""
        logits = x.float() @ self.weight.to(x.device).float().t()
        bias = None if self.bias is None else self.bias.to(x.device).float()
        if self.gating == "sigmoid":
            scores = torch.sigmoid(logits)
            choice = scores if bias is None else scores + bias
            ids = choice.topk(self.top_k, dim=-1).indices
            w = scores.gather(-1, ids)
            w = w / w.sum(dim=-1, keepdim=True)
        elif self.gating == "softmax":
            probs = torch.softmax(logits if bias is None else logits + bias, dim=-1)
            w, ids = probs.topk(self.top_k, dim=-1)
        else:
            raise ValueError(f"Router: unknown gating {self.gating!r}; use sigmoid or softmax")
        return w.float().contiguous(), ids.to(torch.int64).contiguous()


def load_profile(num_experts: int, imbalance: float) -> torch.Tensor:
    """Relative expected loads FP32 ``[num_experts]``, mean 1 and max ``imbalance``.

    ``v[e] = exp(-beta * e / (E - 1))`` rescaled to mean 1, with ``beta`` found by bisection
    so that ``max(v) = imbalance``: a few hot experts, a tail of cold ones (the shape of
    measured DeepSeek/Mixtral expert loads). ``imbalance = 1`` is uniform.
    """
    u = torch.linspace(0.0, 1.0, num_experts, dtype=torch.float64)
    lo, hi = 0.0, 60.0
    for _ in range(100):
        beta = (lo + hi) / 2
        v = torch.exp(-beta * u)
        if float(v.max() / v.mean()) < imbalance:
            lo = beta
        else:
            hi = beta
    v = torch.exp(-lo * u)
    return (v / v.mean()).float()


def balanced_bias(router: Router, imbalance: float, generator: torch.Generator,
                  gamma: torch.Tensor | None = None, steps: int = 120) -> torch.Tensor:
    """A selection bias FP32 ``[E]`` that gives ``router`` the expected load of
    :func:`load_profile` (hottest expert ``imbalance`` x the mean), in a seeded order.

    DeepSeek-V3/V4 learn their selection bias to balance the experts' load ("auxiliary-loss
    free" balancing: raise the bias of an under-loaded expert, lower an over-loaded one's);
    this does the same on synthetic tokens (:func:`synthetic_hidden_states`), toward a
    target profile instead of a flat one. Without it, a random bias swamps the router's
    scores at a few hundred experts and a handful of experts get most tokens.

    Args:
        router: the router (its ``bias`` is ignored); ``weight`` FP32 ``[E, H]``.
        imbalance: the hottest expert's expected load over the mean, in
            ``[1, E / top_k]`` (an expert cannot get more than every token).
        generator: seeds the tokens and which experts are hot.
        gamma: the layer's norm weights (:func:`norm_gamma`) its tokens are drawn with.
        steps: update steps.

    Returns:
        The bias, FP32 ``[E]`` on the router's device.
    """
    num_experts, hidden = router.weight.shape
    k = router.top_k
    # Enough tokens that the fit follows the router, not the sample: >= 128 per expert.
    tokens = min(16384, max(4096, 128 * num_experts // k))
    x = synthetic_hidden_states(tokens, hidden, generator, gamma).to(router.weight.device)
    logits = x.float() @ router.weight.float().t()
    base = torch.sigmoid(logits) if router.gating == "sigmoid" else logits
    target = load_profile(num_experts, imbalance)[torch.randperm(num_experts,
                                                                 generator=generator)]
    target = target.to(base.device) * (tokens * k / num_experts)
    spread = float(base.std())
    bias = torch.zeros(num_experts, device=base.device)
    for step in range(steps):
        ids = (base + bias).topk(k, dim=-1).indices
        load = torch.bincount(ids.reshape(-1), minlength=num_experts).float()
        rate = 0.5 * spread * (1.0 - step / steps) + 0.01 * spread
        bias += rate * (target - load) / (tokens * k / num_experts)
    return bias


# --------------------------------------------------------------------------- real data


def _as_float(t: torch.Tensor, what: str, arg: str) -> torch.Tensor:
    if t.dtype not in _FLOAT_DTYPES:
        raise StudyArgumentError(
            arg,
            f"{what} has dtype {t.dtype}; the study reads BF16/FP16/FP32 tensors "
            "(dequantize FP8/FP4 checkpoints to BF16 first)",
        )
    return t


def _no_experts(path: Path, keys: set[str], layer: int, wanted: str) -> tuple[str, str]:
    """``(flag, message)`` for a file without layer ``layer``'s experts under
    :data:`WEIGHT_NAMES`: the layer is missing (name the ones there), or its experts are
    named otherwise (show one of those names and the naming the study reads)."""
    prefix = f"model.layers.{layer}.mlp.experts."
    other = sorted(k for k in keys if k.startswith(prefix))
    if other:
        return "--weights", (
            f"{path} has tensors under {prefix}* but none named {wanted} (e.g. "
            f"{other[0]}); --weights reads DeepSeek's Hugging Face naming "
            f"({WEIGHT_NAMES['gate']}, up_proj, down_proj): rename the tensors"
        )
    layers = sorted({int(k.split(".")[2]) for k in keys if k.startswith("model.layers.")
                     and ".mlp.experts." in k and k.split(".")[2].isdigit()})
    if layers:
        return "--layer", (f"{path} has no experts of layer {layer}; layers with experts in "
                           f"this file: {layers}; pick one with --layer")
    return "--weights", (f"{path} has no tensor named like {WEIGHT_NAMES['gate']} (e.g. "
                         f"{sorted(keys)[0] if keys else 'it is empty'}); --weights reads "
                         "DeepSeek's Hugging Face naming: rename the tensors")


def load_weights(path: str | Path, layer: int, top_k: int) -> LayerWeights:
    """Read layer ``layer``'s routed experts, router and shared experts from safetensors.

    Names are :data:`WEIGHT_NAMES`; experts ``0, 1, ...`` are read until the first
    missing index. The router and shared experts are optional (without a router the
    study uses a seeded synthetic one; the caller decides).

    Args:
        path: a ``.safetensors`` file.
        layer: the layer index ``L`` in the names.
        top_k: routed slots per token (must not exceed the number of experts found).

    Returns:
        :class:`LayerWeights` in BF16 (router FP32); ``router`` is an empty ``[0, H]``
        tensor when the file has none.

    Raises:
        StudyArgumentError: unreadable file, no experts for ``layer``, inconsistent shapes,
            or non-float tensors. The message names ``--weights`` / ``--layer`` and the fix.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise StudyArgumentError(
            "--weights", f"{path} does not exist or is not a file; pass a .safetensors file"
        )
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
        keys = set(handle.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise StudyArgumentError(
            "--weights", f"cannot read {path} as safetensors ({exc}); pass a .safetensors file"
        ) from None

    def name(kind: str, e: int | None = None) -> str:
        return WEIGHT_NAMES[kind].format(L=layer, e=e)

    def get(key: str) -> torch.Tensor:
        return _as_float(handle.get_tensor(key), key, "--weights")

    experts = []
    while name("gate", len(experts)) in keys:
        e = len(experts)
        parts = []
        for kind in ("gate", "up", "down"):
            if name(kind, e) not in keys:
                raise StudyArgumentError(
                    "--weights", f"{path} has {name('gate', e)} but no {name(kind, e)}"
                )
            parts.append(get(name(kind, e)))
        experts.append(parts)
    if not experts:
        raise StudyArgumentError(*_no_experts(path, keys, layer, name("gate", 0)))
    gate0, _, down0 = experts[0]
    inter, hidden = gate0.shape
    for e, (gate, up, down) in enumerate(experts):
        for what, t, want in (("gate_proj", gate, (inter, hidden)),
                              ("up_proj", up, (inter, hidden)),
                              ("down_proj", down, (hidden, inter))):
            if tuple(t.shape) != want:
                raise StudyArgumentError(
                    "--weights",
                    f"expert {e} {what} of layer {layer} has shape {tuple(t.shape)}, expected "
                    f"{want} (from expert 0's gate_proj [I, H]); mismatched shapes in {path}",
                )
    if top_k > len(experts):
        raise StudyArgumentError(
            "--model", f"top-k {top_k} exceeds the {len(experts)} experts of layer {layer} "
            f"in {path}; pick a --model preset with a smaller top-k"
        )
    w1 = torch.stack([torch.cat([g, u]) for g, u, _ in experts]).to(torch.bfloat16)
    w2 = torch.stack([d for _, _, d in experts]).to(torch.bfloat16)

    router = torch.empty(0, hidden)
    bias = None
    if name("router") in keys:
        router = get(name("router")).float()
        if tuple(router.shape) != (len(experts), hidden):
            raise StudyArgumentError(
                "--weights", f"{name('router')} has shape {tuple(router.shape)}, expected "
                f"({len(experts)}, {hidden}) (experts, hidden); mismatched shapes in {path}"
            )
        if name("router_bias") in keys:
            bias = get(name("router_bias")).float().reshape(-1)
            if bias.numel() != len(experts):
                raise StudyArgumentError(
                    "--weights", f"{name('router_bias')} has {bias.numel()} entries, "
                    f"expected {len(experts)}; mismatched shapes in {path}"
                )
    shared_w1 = shared_w2 = None
    if name("shared_gate") in keys:
        sg, su, sd = (get(name(k)) for k in ("shared_gate", "shared_up", "shared_down"))
        inter_s = sg.shape[0]
        if (tuple(sg.shape) != (inter_s, hidden) or tuple(su.shape) != (inter_s, hidden)
                or tuple(sd.shape) != (hidden, inter_s)):
            raise StudyArgumentError(
                "--weights", f"shared expert of layer {layer} has shapes gate "
                f"{tuple(sg.shape)}, up {tuple(su.shape)}, down {tuple(sd.shape)}; expected "
                f"[Is, {hidden}], [Is, {hidden}], [{hidden}, Is]; mismatched shapes in {path}"
            )
        shared_w1 = torch.cat([sg, su]).to(torch.bfloat16)
        shared_w2 = sd.to(torch.bfloat16)
    return LayerWeights(w1, w2, router, bias, shared_w1, shared_w2, f"{path}:layer {layer}")


def load_activations(path: str | Path, hidden: int) -> torch.Tensor:
    """Captured hidden states: BF16 ``[N, H]`` from a ``.pt`` or ``.safetensors`` file.

    The file holds one tensor, or a dict with one tensor or a ``"hidden_states"`` entry.
    Leading dims are flattened (``[B, S, H]`` -> ``[B * S, H]``).

    Raises:
        StudyArgumentError: unreadable file, no usable tensor, or a last dim that is not
            the layer's hidden size (message names ``--activations``).
    """
    path = existing_file(path, "--activations",
                         "a .pt or .safetensors file holding [N, H] hidden states")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj = load_file(str(path))
        else:
            obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to read means the same fix
        raise StudyArgumentError(
            "--activations", f"cannot read {path} ({type(exc).__name__}: {exc}); pass a .pt "
            "(torch.save of a tensor) or .safetensors file"
        ) from None
    if isinstance(obj, dict):
        if "hidden_states" in obj:
            obj = obj["hidden_states"]
        elif len(obj) == 1:
            obj = next(iter(obj.values()))
        else:
            raise StudyArgumentError(
                "--activations", f"{path} holds {len(obj)} tensors {sorted(obj)[:5]}; store "
                "one tensor, or name the hidden states 'hidden_states'"
            )
    if not isinstance(obj, torch.Tensor) or obj.dim() < 2:
        raise StudyArgumentError(
            "--activations", f"{path} must hold a [N, H] tensor, got "
            + (f"shape {tuple(obj.shape)}" if isinstance(obj, torch.Tensor) else type(obj).__name__)
        )
    _as_float(obj, f"{path}", "--activations")
    if obj.shape[-1] != hidden:
        raise StudyArgumentError(
            "--activations", f"{path} has hidden size {obj.shape[-1]} but the layer has "
            f"H={hidden}; mismatched shapes: capture the layer's input or pick the --model "
            "/ --weights it belongs to"
        )
    return obj.reshape(-1, hidden).to(torch.bfloat16).contiguous()
