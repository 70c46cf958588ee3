"""The transformers side of the serving-scales end-to-end tests (tests/vllm and tests/sglang
``test_serving_scales_e2e.py``), run as ``python serving_scales_source.py OUT`` with the
Python that has transformers 5.23 (the engines' test environments have none or an older one).

In ``OUT`` it writes:

- ``v4-fp4/``, ``v4-bf16/``: the tiny DeepSeek-V4 (``_tiny.deepseek_v4_checkpoints``), FP4
  experts with UE8M0 scales in DeepSeek-V4-Flash's layout;
- ``scales-vllm.json``, ``scales-sglang.json``: the amaxes of that model loaded with
  ``experts_implementation="deepgemm_megamoe"`` on one process, ``prepare(model,
  kernel="stand-in")``, calibrated with :data:`RECIPE` over :data:`CALIBRATION` token ids, as
  ``save_scales(model, path, host=...)`` writes them under each engine's names;
- ``batch.pt``: one batch of the experts (``x`` BF16 ``[T, H]``, ``idx`` int64 ``[T, k]``
  with invalid slots ``-1``, ``w`` FP32 ``[T, k]``) and the calibrated experts' output ``y``
  BF16 ``[T, H]`` on it, with the amaxes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: The recipe calibrated here and served by the engines.
RECIPE = "moe_fp8_dispatch_nvfp4_combine"
#: Token ids of the calibration forward, ``[batch, seq]``.
CALIBRATION = (2, 12)
#: Tokens of the compared batch.
TOKENS = 11


def batch(hidden: int, experts: int, top_k: int) -> tuple[torch.Tensor, ...]:
    """Gaussian BF16 tokens, distinct expert ids (two invalid slots), FP32 weights."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(TOKENS, hidden, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(TOKENS)])
    idx[0, -1] = idx[5, 0] = -1
    w = (0.1 + 2.4 * torch.rand((TOKENS, top_k), generator=g)).float()
    return x, idx, w


def main(out: Path) -> None:
    import _tiny
    import transformers as tf

    import moewire
    import moewire.integrations.transformers as mt

    out.mkdir(parents=True, exist_ok=True)
    fp4, _ = _tiny.deepseek_v4_checkpoints(out)
    mt.register()
    with mt.megamoe.keep_fp8_on_cpu():
        model = tf.AutoModelForCausalLM.from_pretrained(
            fp4, experts_implementation="deepgemm_megamoe")
    mt.prepare(model, kernel="stand-in")
    ids = torch.randint(0, _tiny.VOCAB, CALIBRATION, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        moewire.quantize(model, RECIPE, lambda m: m(ids))
    for host in ("vllm", "sglang"):
        mt.save_scales(model, out / f"scales-{host}.json", host=host)
    experts = model.model.layers[0].mlp.experts
    x, idx, w = batch(_tiny.V4["hidden"], _tiny.V4["experts"], _tiny.V4["top_k"])
    with torch.no_grad():
        y = experts(x, idx, w)
    torch.save({"x": x, "idx": idx, "w": w, "y": y,
                "dispatch_amax": experts.dispatch_quantizer.static_amax,
                "combine_amax": experts.combine_quantizer.static_amax}, out / "batch.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
