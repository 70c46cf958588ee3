"""The groups calibration reduces over under transformers' expert parallelism, without ranks:
the EP group and the data-parallel dimensions of transformers' expert mesh
(``mesh_groups``), recorded by ``prepare`` and handed by the adapters to every
calibration (``api.calibrating``)."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("transformers.distributed.expert_parallel")

import _tiny  # noqa: E402
import torch  # noqa: E402

import moewire  # noqa: E402
from moewire.integrations.transformers import ep, megamoe  # noqa: E402
from moewire.quantizer import WireQuantizer  # noqa: E402


class _Mesh:
    def __init__(self, name: str) -> None:
        self.name = name

    def get_group(self) -> str:
        return f"group:{self.name}"


class _Manager:
    """transformers 5.23's ``TransformersDeviceMesh.get_mesh``, one group per dimension."""

    def get_mesh(self, dim: str) -> _Mesh:
        return _Mesh(dim)


def _model(**sizes):
    config = types.SimpleNamespace(**{"ep_size": 2, "dp_replicate_size": 1, "efsdp_size": 1,
                                      **sizes})
    return types.SimpleNamespace(_mesh_manager=_Manager(),
                                 config=types.SimpleNamespace(distributed_config=config))


@pytest.mark.parametrize(
    ("sizes", "want"),
    [
        ({}, ("group:ep", ())),
        ({"efsdp_size": 2}, ("group:ep", ("group:efsdp",))),
        ({"dp_replicate_size": 2, "efsdp_size": 4},
         ("group:ep", ("group:dp_replicate", "group:efsdp"))),
        ({"ep_size": 1}, (None, ())),
    ],
    ids=["ep-only", "efsdp", "hsdp", "no-ep"],
)
def test_mesh_groups_reads_the_expert_mesh(sizes, want):
    assert ep.mesh_groups(_model(**sizes)) == want


def test_calibration_reduces_over_the_recorded_dp_groups(checkpoints, moewire_registered,
                                                         monkeypatch):
    """prepare records the mesh's groups on every experts module; calibrating reduces each
    amax over them after the EP group, in that order."""
    import transformers as tf

    mt = moewire_registered
    model = tf.AutoModelForCausalLM.from_pretrained(checkpoints("qwen3_moe"),
                                                   experts_implementation="moewire")
    monkeypatch.setattr(ep, "mesh_groups", lambda m: (None, ("dp-a", "dp-b")))
    mt.prepare(model)
    experts = model.model.layers[0].mlp.experts
    assert experts.__dict__[megamoe.GROUPS] == (None, ("dp-a", "dp-b"))
    synced = []
    monkeypatch.setattr(WireQuantizer, "sync_amax", lambda self, group: synced.append(group))
    ids = torch.randint(0, _tiny.VOCAB, (1, 8))
    with torch.no_grad():
        moewire.quantize(model, "moe_fp8", lambda m: m(ids))
    assert synced == ["dp-a", "dp-b"] * 4  # 2 layers x (dispatch, combine)
