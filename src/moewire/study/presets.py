"""Model presets: the MoE layer shapes the study builds.

The full-size shapes are the models' Hugging Face ``config.json`` values:
``n_routed_experts``, ``num_experts_per_tok``, ``hidden_size``, ``moe_intermediate_size``
and ``n_shared_experts`` (DeepSeek-V4-Flash: 256, 6, 4096, 2048, 1; DeepSeek-V4-Pro: 384, 6,
7168, 3072, 1; Kimi-K3: 896, 16, 3584 latent, 3072, 2). Kimi-K3's routed experts run on
its latent width (``routed_expert_hidden_size``: vLLM's ``kimi_k3/nvidia/model.py`` projects
the model's 7168 down to 3584 before the Mega-MoE and back up after its combine), so its
preset's ``hidden`` is 3584 and the bytes on its wire are latent bytes.

A preset fixes the routed experts, top-k, hidden size, expert intermediate size, shared
experts and the router's gating function. ``demo`` is what ``moewire study`` runs with
no arguments: DeepSeek-V4-Flash's wire width ``H = 4096``, top-k 6, sigmoid gating and a
shared expert, with 16 routed experts of ``I = 512`` instead of 256 of ``I = 2048``, so that
the whole sweep finishes in under two minutes on two CPU cores. What crosses the wire is
V4-Flash-shaped (a row of 4096 values per routed slot, in the formats' block structure);
what is smaller is the expert count (routing spreads over 16 experts, not 256) and the
expert MLP width (the rows are sums of 512 products in L2, not 2048).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelPreset:
    """The shapes of one MoE layer.

    Attributes:
        name: preset name (``--model``).
        num_experts: routed experts ``E``.
        top_k: routed slots per token ``k``.
        hidden: ``H``, the width of a token on the wire.
        intermediate: ``I``, each expert's intermediate size.
        num_shared: shared experts (run unfused, added after the kernel; their width is
            ``num_shared * intermediate``).
        gating: ``"sigmoid"`` (DeepSeek-V3/V4, Kimi: sigmoid scores, top-k, weights
            renormalised to sum 1) or ``"softmax"`` (softmax over all experts, top-k,
            weights not renormalised).
        description: one line for the terminal and the JSON.
    """

    name: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    num_shared: int
    gating: str
    description: str

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            "demo", 16, 6, 4096, 512, 1, "sigmoid",
            "DeepSeek-V4-Flash wire width and routing (H=4096, k=6, 1 shared expert, sigmoid "
            "gating) with 16 routed experts of I=512, sized for 2 CPU cores",
        ),
        ModelPreset(
            "v4-flash", 256, 6, 4096, 2048, 1, "sigmoid",
            "DeepSeek-V4-Flash (E=256, k=6, H=4096, I=2048, 1 shared expert)",
        ),
        ModelPreset(
            "v4-pro", 384, 6, 7168, 3072, 1, "sigmoid",
            "DeepSeek-V4-Pro (E=384, k=6, H=7168, I=3072, 1 shared expert)",
        ),
        ModelPreset(
            "kimi-k3", 896, 16, 3584, 3072, 2, "sigmoid",
            "Kimi-K3 (E=896, k=16, latent H=3584, I=3072, 2 shared experts)",
        ),
        ModelPreset(
            "tiny", 16, 4, 512, 512, 0, "softmax",
            "tiny test layer (E=16, k=4, H=512, I=512, no shared expert)",
        ),
    )
}

DEFAULT_MODEL = "demo"
