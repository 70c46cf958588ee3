"""The serving hooks: the general plugin's loader wrap and the calibration worker extension."""

from __future__ import annotations

import itertools
import types

import _standin as standin
import _vllm_world as setup
import pytest
import torch

pytestmark = pytest.mark.vllm

vllm_mod = pytest.importorskip("moewire.integrations.vllm")
api = pytest.importorskip("moewire.megamoe.api")

RECIPE = "moe_fp8_dispatch_nvfp4_combine"
_layers = itertools.count(200)


def _prefix() -> str:
    return f"model.layers.{next(_layers)}.ffn.experts"


def _batches(config, model, seeds):
    from vllm.forward_context import create_forward_context, override_forward_context

    for seed in seeds:
        x, ids, w = setup.routing(6, seed)
        pad = torch.zeros(6, dtype=torch.bool)
        pad[0] = True
        with override_forward_context(create_forward_context(None, config, is_padding=pad)):
            model["experts"](x, w, ids, activation_clamp=10.0)


class _Worker(vllm_mod.MoewireWorkerExtension):
    """The attributes of vLLM's worker that the extension reads, around a real model."""

    def __init__(self, model, enforce_eager: bool = True) -> None:
        self.model_runner = types.SimpleNamespace(get_model=lambda: model)
        self.vllm_config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(enforce_eager=enforce_eager)
        )


def _model(config):
    experts = setup.make_experts(config, prefix=_prefix())
    experts.finalize_weights()
    return torch.nn.ModuleDict({"experts": experts})


def test_extension_adds_methods_only():
    """vLLM asserts an extension attribute is not already on the worker class."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    added = [a for a in dir(vllm_mod.MoewireWorkerExtension) if not a.startswith("__")]
    assert added
    assert [a for a in added if hasattr(CPUWorker, a)] == []


def test_worker_calibration_rpcs_equal_moewire_calibrate(vllm_config, tmp_path):
    vllm_mod.register_vllm_experts()
    with standin.use_reference_deep_gemm("vllm-0.32"):
        model = _model(vllm_config)
        worker = _Worker(model)
        assert worker.moewire_begin_calibration(RECIPE) == 1
        _batches(vllm_config, model, seeds=(1, 2))
        path = worker.moewire_finish_calibration(str(tmp_path / "scales.rank{rank}.pt"))
        assert path == str(tmp_path / "scales.rank0.pt")
        direct = _model(vllm_config)
        api.quantize(direct, RECIPE, forward_loop=lambda m: _batches(vllm_config, m, (1, 2)))
    for name in ("dispatch_quantizer", "combine_quantizer"):
        ours = getattr(model["experts"], name)
        assert ours.mode == "quantize"
        assert torch.equal(ours.amax, getattr(direct["experts"], name).amax)


def test_finish_without_begin_is_refused(vllm_config, tmp_path):
    worker = _Worker(torch.nn.ModuleDict())
    with pytest.raises(RuntimeError, match="no calibration in progress"):
        worker.moewire_finish_calibration(str(tmp_path / "s.pt"))


def test_calibration_with_captured_graphs_is_refused(vllm_config):
    worker = _Worker(torch.nn.ModuleDict(), enforce_eager=False)
    with pytest.raises(RuntimeError, match="enforce_eager=True"):
        worker.moewire_begin_calibration(RECIPE)


def test_model_without_mega_moe_experts_is_refused(vllm_config):
    vllm_mod.register_vllm_experts()
    with pytest.raises(RuntimeError, match="--moe-backend deep_gemm_mega_moe"):
        vllm_mod.quantize_vllm_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), RECIPE)


def test_plugin_wraps_the_loader_and_loads_scales(vllm_config, tmp_path, monkeypatch):
    """With MOEWIRE_RECIPE/MOEWIRE_SCALES the loaded model comes back quantized."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    vllm_mod.register_vllm_experts()
    with standin.use_reference_deep_gemm("vllm-0.32"):
        calibrated = _model(vllm_config)
        api.quantize(calibrated, RECIPE, forward_loop=lambda m: _batches(vllm_config, m, (3,)))
        api.save_scales(calibrated, tmp_path / "scales.rank0.pt")
        fresh = _model(vllm_config)
        # The loader vLLM would run: it returns the finalized model.
        monkeypatch.setattr(BaseModelLoader, "load_model", lambda self, *a, **k: fresh)
        monkeypatch.setenv(vllm_mod.ENV_RECIPE, RECIPE)
        monkeypatch.setenv(vllm_mod.ENV_SCALES, str(tmp_path / "scales.rank{rank}.pt"))
        vllm_mod.register()
        vllm_mod.register()  # vLLM loads plugins in several places: wrap once
        assert BaseModelLoader.load_model._moewire
        loaded = BaseModelLoader.load_model(object(), vllm_config, None)
    assert loaded is fresh
    for name in ("dispatch_quantizer", "combine_quantizer"):
        assert torch.equal(
            getattr(fresh["experts"], name).amax, getattr(calibrated["experts"], name).amax
        )


def test_unquantize_unwraps_the_loader(vllm_config, monkeypatch):
    """Once the loaded model is unquantized (and no other converted module lives), the
    loader is vLLM's again. Break: patch ``load_model`` with a plain assignment: it stays
    moewire's wrapper."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from moewire.megamoe import convert

    # vLLM's static forward context keeps earlier tests' layers alive: undo them first.
    for module in list(convert._CONVERTED):
        convert.unconvert(module)
    vllm_mod.register_vllm_experts()
    with standin.use_reference_deep_gemm("vllm-0.32"):
        fresh = _model(vllm_config)
    loader = lambda self, *a, **k: fresh  # noqa: E731  (the loader vLLM would run)
    monkeypatch.setattr(BaseModelLoader, "load_model", loader)
    monkeypatch.setenv(vllm_mod.ENV_RECIPE, RECIPE)
    monkeypatch.delenv(vllm_mod.ENV_SCALES, raising=False)
    vllm_mod.register()
    assert BaseModelLoader.load_model._moewire
    with standin.use_reference_deep_gemm("vllm-0.32"):
        loaded = BaseModelLoader.load_model(object(), vllm_config, None)
    api.unquantize(loaded)
    assert BaseModelLoader.load_model is loader


def test_eval_mixed_recipe_loads_through_the_plugin(vllm_config, tmp_path, monkeypatch):
    """The mixed recipe ``moewire eval --per-layer`` writes (its own writer), served through
    MOEWIRE_RECIPE: exactly the named layers get the 4-bit pair, every other one the high
    pair."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from moewire.eval import mixed_recipe_yaml

    path = tmp_path / "mixed_recipe.yaml"
    path.write_text(mixed_recipe_yaml(("nvfp4", "nvfp4"), [1, 3], ("fp8", "fp8"), "mixed"))
    vllm_mod.register_vllm_experts()
    with standin.use_reference_deep_gemm("vllm-0.32"):
        layers = torch.nn.ModuleList()
        for _ in range(4):  # vLLM's tree: model.layers.N.ffn.experts
            layer = torch.nn.Module()
            layer.ffn = _model(vllm_config)
            layers.append(layer)
        fresh = torch.nn.Module()
        fresh.layers = layers
        monkeypatch.setattr(BaseModelLoader, "load_model", lambda self, *a, **k: fresh)
        monkeypatch.setenv(vllm_mod.ENV_RECIPE, str(path))
        monkeypatch.delenv(vllm_mod.ENV_SCALES, raising=False)
        vllm_mod.register()
        assert BaseModelLoader.load_model(object(), vllm_config, None) is fresh
    formats = {
        (n, q): getattr(layer.ffn["experts"], q).fmt.name
        for n, layer in enumerate(fresh.layers)
        for q in ("dispatch_quantizer", "combine_quantizer")
    }
    api.unquantize(fresh)
    assert {key for key, fmt in formats.items() if fmt == "nvfp4"} == {
        (n, q) for n in (1, 3) for q in ("dispatch_quantizer", "combine_quantizer")}
    assert set(formats.values()) == {"nvfp4", "fp8"}
