"""Loading real weights and activations, the router, and the weight conversion."""

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from study_helpers import EXPERTS, HIDDEN, INTER, LAYER, SHARED_INTER, dense_checkpoint

from moewire.reference import dequantize_weight
from moewire.reference.dense import from_dense
from moewire.study.data import (
    WEIGHT_NAMES,
    Router,
    load_activations,
    load_weights,
    synthetic_hidden_states,
)
from moewire.study.errors import StudyArgumentError


def test_load_weights_reads_every_tensor(checkpoint):
    path, tensors = checkpoint
    w = load_weights(path, LAYER, top_k=4)
    assert (w.num_experts, w.hidden, w.intermediate) == (EXPERTS, HIDDEN, INTER)
    for e in (0, EXPERTS - 1):
        gate = tensors[WEIGHT_NAMES["gate"].format(L=LAYER, e=e)]
        up = tensors[WEIGHT_NAMES["up"].format(L=LAYER, e=e)]
        down = tensors[WEIGHT_NAMES["down"].format(L=LAYER, e=e)]
        assert torch.equal(w.w1[e], torch.cat([gate, up]))
        assert torch.equal(w.w2[e], down)
    assert torch.equal(w.router, tensors[WEIGHT_NAMES["router"].format(L=LAYER)])
    assert w.router_bias.shape == (EXPERTS,)
    assert w.shared_w1.shape == (2 * SHARED_INTER, HIDDEN)
    assert w.num_shared_intermediate == SHARED_INTER


def test_kernel_weights_equal_an_ml_dtypes_fp4_oracle():
    g = torch.Generator().manual_seed(2)
    w1 = torch.randn(2, 2 * 512, 512, generator=g).bfloat16()
    w2 = torch.randn(2, 512, 512, generator=g).bfloat16()
    kw = from_dense(w1, w2, "fp8xfp4")
    for dense, raw in ((w1, kw.l1_raw), (w2, kw.l2_raw)):
        groups = dense.float().numpy().astype(np.float64).reshape(*dense.shape[:-1], -1, 32)
        amax = np.maximum(np.abs(groups).max(axis=-1, keepdims=True), 1e-4)
        sf = 2.0 ** np.ceil(np.log2(amax / 6.0))
        q = (groups / sf).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
        want = (q * sf).reshape(dense.shape)
        got = dequantize_weight(*raw).double().numpy()
        np.testing.assert_array_equal(got, want)


def test_bf16_kernel_weights_are_the_dense_weights():
    g = torch.Generator().manual_seed(2)
    w1 = torch.randn(2, 256, 128, generator=g).bfloat16()
    w2 = torch.randn(2, 128, 128, generator=g).bfloat16()
    kw = from_dense(w1, w2, "bf16xbf16")
    assert torch.equal(kw.l1_raw, w1) and torch.equal(kw.l2_raw, w2)


def _corrupt(tmp_path, change):
    tensors = dense_checkpoint()
    change(tensors)
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path))
    return path


def _replace(key, shape):
    return lambda t: t.__setitem__(key, torch.zeros(shape, dtype=torch.bfloat16))


def _rename(old: str, new: str):
    def change(tensors):
        for key in [k for k in tensors if old in k]:
            tensors[key.replace(old, new)] = tensors.pop(key)

    return change


@pytest.mark.parametrize(
    "change, layer, argument, needle",
    [
        (_replace(WEIGHT_NAMES["up"].format(L=LAYER, e=1), (INTER, HIDDEN + 1)), LAYER,
         "--weights", "mismatched shapes"),
        (_replace(WEIGHT_NAMES["down"].format(L=LAYER, e=0), (HIDDEN, INTER * 2)), LAYER,
         "--weights", "mismatched shapes"),
        (_replace(WEIGHT_NAMES["router"].format(L=LAYER), (EXPERTS + 1, HIDDEN)), LAYER,
         "--weights", "mismatched shapes"),
        (lambda t: t.pop(WEIGHT_NAMES["down"].format(L=LAYER, e=2)), LAYER,
         "--weights", "no model.layers.3.mlp.experts.2.down_proj"),
        (lambda t: None, LAYER + 1, "--layer", "layers with experts in this file: [3]"),
        (lambda t: t.__setitem__(WEIGHT_NAMES["gate"].format(L=LAYER, e=0),
                                 torch.zeros(INTER, HIDDEN, dtype=torch.int8)), LAYER,
         "--weights", "dequantize"),
        (_rename("gate_proj", "w1"), LAYER, "--weights",
         "has tensors under model.layers.3.mlp.experts.* but none named "
         "model.layers.3.mlp.experts.0.gate_proj.weight (e.g. model.layers.3.mlp.experts.0.down"),
        (_rename(".mlp.experts.", ".block_sparse_moe.experts."), LAYER, "--weights",
         "has no tensor named like model.layers.{L}.mlp.experts.{e}.gate_proj.weight"),
    ],
    ids=["expert-shape", "down-shape", "router-shape", "missing-down", "wrong-layer",
         "int8-weights", "other-expert-naming", "other-layer-naming"],
)
def test_weight_refusals(tmp_path, change, layer, argument, needle):
    path = _corrupt(tmp_path, change)
    with pytest.raises(StudyArgumentError) as info:
        load_weights(path, layer, top_k=4)
    assert info.value.argument == argument
    assert needle in str(info.value)
    if argument == "--weights":
        assert "layers with experts in this file" not in str(info.value)


def test_unreadable_weights_file(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"this is not a safetensors file")
    with pytest.raises(StudyArgumentError, match="--weights: cannot read"):
        load_weights(path, 0, top_k=4)


def test_activations_round_trip(activations):
    path, x = activations
    got = load_activations(path, HIDDEN)
    assert torch.equal(got, x.reshape(-1, HIDDEN))


@pytest.mark.parametrize(
    "payload, needle",
    [
        (torch.zeros(4, 256), "mismatched shapes"),
        (torch.zeros(4), "must hold a [N, H] tensor"),
        ({"a": torch.zeros(2, 512), "b": torch.zeros(2, 512)}, "name the hidden states"),
        (torch.zeros(4, 512, dtype=torch.int32), "dtype torch.int32"),
    ],
    ids=["hidden-size", "1-d", "two-tensors", "int-dtype"],
)
def test_activation_refusals(tmp_path, payload, needle):
    path = tmp_path / "acts.pt"
    torch.save(payload, path)
    with pytest.raises(StudyArgumentError, match="--activations") as info:
        load_activations(path, HIDDEN)
    assert needle in str(info.value)


def test_synthetic_tokens_are_post_norm_with_spikes():
    g = torch.Generator().manual_seed(0)
    x = synthetic_hidden_states(128, 512, g).float()
    rms = x.square().mean(dim=1).sqrt()
    # After the norm no token is much louder than another (gamma alone moves the RMS)...
    assert float(rms.max() / rms.min()) < 3.0
    # ...but the two outlier tokens (128 // 64) put most of their energy into 4 spikes.
    energy = x.square()
    top4 = energy.topk(4, dim=1).values.sum(dim=1) / energy.sum(dim=1)
    assert int((top4 > 0.9).sum()) == 2
    assert float(top4.sort(descending=True).values[2]) < 0.8


@pytest.mark.parametrize("gating", ["sigmoid", "softmax"])
def test_router_against_hand_math(gating):
    g = torch.Generator().manual_seed(9)
    weight, bias = torch.randn(6, 16, generator=g), torch.randn(6, generator=g)
    x = torch.randn(5, 16, generator=g).bfloat16()
    w, ids = Router(weight, bias, 2, gating)(x)
    logits = x.double() @ weight.double().t()
    for t in range(5):
        if gating == "sigmoid":
            s = torch.sigmoid(logits[t])
            want_ids = torch.argsort(s + bias.double(), descending=True)[:2]
            want_w = s[want_ids] / s[want_ids].sum()
        else:
            p = torch.softmax(logits[t] + bias.double(), dim=0)
            want_ids = torch.argsort(p, descending=True)[:2]
            want_w = p[want_ids]
        assert ids[t].tolist() == want_ids.tolist()
        torch.testing.assert_close(w[t].double(), want_w, rtol=1e-5, atol=1e-6)
