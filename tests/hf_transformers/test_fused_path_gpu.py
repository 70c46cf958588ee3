"""On CUDA, the "moewire" transformers implementation's quantizers run moewire's fused Triton
kernels (the dispatch QDQ and the combine's one-pass re-sum), not the torch references: the
same kernels vLLM's and SGLang's sites use, through the shared quantized forward."""

from __future__ import annotations

import collections

import pytest

pytest.importorskip("transformers.integrations.moe")

import _tiny  # noqa: E402
import torch  # noqa: E402

import moewire
from moewire import kernels

pytestmark = pytest.mark.gpu


def test_the_quantized_forward_runs_the_fused_kernels_on_cuda(checkpoints, moewire_registered,
                                                              monkeypatch):
    if not torch.cuda.is_available() or not kernels.available():
        pytest.skip("needs CUDA and Triton (run `pytest -m gpu` on a machine with a CUDA GPU)")
    import transformers as tf

    mt = moewire_registered
    model = tf.AutoModelForCausalLM.from_pretrained(
        checkpoints("qwen3_moe"), experts_implementation="moewire").cuda()
    mt.prepare(model)
    ids = torch.randint(0, _tiny.VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    ids = ids.cuda()
    with torch.no_grad():
        moewire.quantize(model, "moe_fp8_dispatch_nvfp4_combine", lambda m: m(ids))
        model(ids)  # the first routed batch: the layout check

        calls: collections.Counter[str] = collections.Counter()
        for name in ("fused_combine", "qdq"):
            real = getattr(kernels, name)

            def spy(*args, _real=real, _name=name, **kwargs):
                calls[_name] += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(kernels, name, spy)
        model(ids)
    layers = len(mt.experts_modules(model))
    assert layers > 0
    # One fused combine per layer; the dispatch QDQ (fp8) at least once per layer.
    assert calls["fused_combine"] == layers, calls
    assert calls["qdq"] >= layers, calls
    moewire.unquantize(model)
