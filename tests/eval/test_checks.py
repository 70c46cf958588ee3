"""Every mistake of a ``moewire eval`` command line is refused before the model loads: one
line on stderr naming the argument and the fix, exit code 2, no traceback. Also the other
first-hour mistakes the command and the API refuse: ``calibrate`` without ``quantize``,
``--version``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers.integrations.moe")

import torch  # noqa: E402
from eval_helpers import TEXT  # noqa: E402

import moewire
from moewire.cli import main
from moewire.eval import EvalError, evaluate, runner


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model fails the test: every refusal must come before it."""

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(runner, "_load", load)


def _fake_checkpoint(tmp_path, **config):
    """A checkpoint directory with a qwen3_moe config.json and an (empty) weights file:
    enough for every check, never loaded."""
    path = tmp_path / "ckpt"
    path.mkdir()
    cfg = {"model_type": "qwen3_moe", "num_experts": 8, "hidden_size": 128,
           "vocab_size": 256, "num_hidden_layers": 2, "max_position_embeddings": 256, **config}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").write_bytes(b"")
    return path


def _text_file(tmp_path, data: bytes):
    path = tmp_path / "text.txt"
    path.write_bytes(data)
    return str(path)


# (argv after the checkpoint, or a callable(tmp_path) -> argv; the message's start)
CASES = {
    "out-is-a-file": (lambda tmp: ["--out", _text_file(tmp, b"x")],
                      "--out: {tmp}/text.txt exists and is not a directory"),
    "out-cannot-be-written": (["--out", "/proc/x"], "--out: cannot write into /proc/x"),
    "recipe-misspelt": (["--recipe", "moe_fp9"], "--recipe: unknown recipe 'moe_fp9'"),
    "recipe-file-missing": (lambda tmp: ["--recipe", str(tmp / "none.yaml")],
                            "--recipe: recipe file"),
    "pairs-without-a-value": (["--pairs"], "--pairs: the flag is given without a pair"),
    "pairs-unknown-format": (["--pairs", "fp9:fp8"], "--pairs: 'fp9:fp8': unknown format"),
    "pairs-not-a-pair": (["--pairs", "fp8"], "--pairs: 'fp8' is not DISPATCH:COMBINE"),
    "per-layer-not-a-pair": (["--per-layer", "nvfp4"], "--per-layer: 'nvfp4' is not"),
    "text-missing": (lambda tmp: ["--text", str(tmp / "none.txt")],
                     "--text: {tmp}/none.txt does not exist"),
    "text-not-utf8": (lambda tmp: ["--text", _text_file(tmp, b"\xff\xfe\x00")],
                      "--text: {tmp}/text.txt is not UTF-8"),
    "text-empty": (lambda tmp: ["--text", _text_file(tmp, b"")],
                   "--text: the text gives 0 token(s)"),
    "device-unknown": (["--device", "tpu"], "--device: 'tpu'"),
    "seq-len-beyond-positions": (["--seq-len", "512"],
                                 "--seq-len: 512 tokens per window is more than"),
    "mma-fp4xfp4-sizes": (["--mma", "fp4xfp4"],
                          "--mma fp4xfp4: the NVFP4 x NVFP4 kernel needs sizes that are "
                          "multiples of 512, but the model's hidden_size is"),
    "tasks-empty": (["--tasks", ","], "--tasks: ',' names no task"),
    "tasks-without-tokenizer": (["--tasks", "gsm8k"], "--tasks: lm-eval's tasks are text"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_each_mistake_is_one_line_before_the_model_loads(case, checkpoint, tmp_path,
                                                         no_model, capsys):
    argv, message = CASES[case]
    argv = argv(tmp_path) if callable(argv) else argv
    path = checkpoint("mixtral")
    capsys.readouterr()
    code = main(["eval", str(path), "--device", "cpu",
                 "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2
    assert lines == [lines[0]] and "Traceback" not in err, err
    assert lines[0].startswith("moewire eval: error: " + message.format(tmp=tmp_path)), err
    if case != "out-is-a-file":
        # A refused run leaves no output directory behind.
        assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu(checkpoint, no_model, capsys):
    path = checkpoint("mixtral")
    capsys.readouterr()
    assert main(["eval", str(path), "--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith(
        "moewire eval: error: --device: cuda was asked for but torch sees no CUDA device; "
        "pass --device cpu")


def _broken_config(tmp):
    path = _fake_checkpoint(tmp)
    (path / "config.json").write_text('{"model_type": "qwen3_moe",\n "num_experts": }')
    return path


def _broken_tokenizer(tmp):
    path = _fake_checkpoint(tmp)
    (path / "tokenizer.json").write_text("{not a tokenizer")
    (path / "tokenizer_config.json").write_text("{}")
    return path


CHECKPOINTS = {
    "config-not-json": (_broken_config,
                        "checkpoint: {tmp}/ckpt/config.json is not valid JSON (line 2, column"),
    "config-not-an-object": (lambda tmp: _fake_checkpoint(tmp).joinpath("config.json")
                             .write_text("[1, 2]") and tmp / "ckpt",
                             "checkpoint: {tmp}/ckpt/config.json holds a list"),
    "no-weights": (lambda tmp: (_fake_checkpoint(tmp) / "model.safetensors").unlink()
                   or tmp / "ckpt", "checkpoint: {tmp}/ckpt has config.json but no weights"),
    "block-does-not-divide-hidden": (lambda tmp: _fake_checkpoint(tmp, hidden_size=200),
                                     "--pairs: format 'nvfp4' has blocks of 16, which do not "
                                     "divide the model's hidden size 200"),
    "tokenizer-broken": (_broken_tokenizer, "checkpoint: its tokenizer cannot be loaded"),
}


@pytest.mark.parametrize("case", list(CHECKPOINTS), ids=list(CHECKPOINTS))
def test_a_broken_checkpoint_is_one_line_before_the_model_loads(case, tmp_path, no_model,
                                                                capsys):
    make, message = CHECKPOINTS[case]
    path = make(tmp_path)
    code = main(["eval", str(path), "--device", "cpu", "--pairs", "nvfp4:nvfp4",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("moewire eval: error: " + message.format(tmp=tmp_path)), err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 1}, "--max-tokens: must be an integer >= 2, got 1"),
        ({"seq_len": 1.5}, "--seq-len: must be an integer >= 2, got 1.5"),
        ({"budget": float("nan")}, "--budget: must be a finite mean KL >= 0"),
        ({"budget": -1e-3}, "--budget: must be a finite mean KL >= 0"),
        ({"pairs": []}, "--pairs: no pair, recipe or --per-layer pair to measure"),
        ({"interconnect": "ethernet"}, "interconnect: 'ethernet' is not one of"),
        ({"tasks": ["x"], "tasks_path": "/nonexistent"}, "--tasks: lm-eval's tasks are text"),
    ],
    ids=["max-tokens", "seq-len-not-int", "budget-nan", "budget-negative", "nothing-to-measure",
         "interconnect", "tasks-need-a-tokenizer"],
)
def test_the_python_api_refuses_the_same_way(kwargs, message, checkpoint, no_model):
    with pytest.raises(EvalError) as info:
        evaluate(checkpoint("mixtral"), **{"device": "cpu", "text": TEXT,
                                           "log": lambda s: None, **kwargs})
    assert str(info.value).startswith(message)


def test_tasks_need_lm_eval(checkpoint, tmp_path, no_model, monkeypatch):
    """Without lm-eval installed, --tasks names the extra to install."""
    import importlib.util

    from eval_helpers import save_byte_tokenizer

    path = tmp_path / "ckpt"
    path.mkdir()
    for f in checkpoint("mixtral").iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    save_byte_tokenizer(path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "lm_eval" else real(name, *a))
    with pytest.raises(EvalError, match=r"--tasks: needs lm-evaluation-harness, which this "
                       r"Python lacks; run: .* -m pip install -e '.*\[eval\]'"):
        evaluate(path, tasks=["gsm8k"], device="cpu", log=lambda s: None)


def test_calibrate_refuses_a_model_that_was_never_quantized(checkpoint):
    import transformers as tf

    import moewire.integrations.transformers as mt

    mt.register()
    model = mt.prepare(tf.AutoModelForCausalLM.from_pretrained(
        checkpoint("mixtral"), experts_implementation="moewire"))
    with pytest.raises(ValueError, match=r"calibrate: MixtralForCausalLM has no moewire "
                       r"quantizer .* call moewire.quantize\(model, recipe, forward_loop\)"):
        moewire.calibrate(model, lambda m: m(torch.arange(8)[None]))


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"moewire {moewire.__version__}\n"


SHAPES = {
    "default-build-hidden": ({"hidden_size": 192},
                             "checkpoint: the BF16 x BF16 kernel (--kernel stand-in's default "
                             "--mma bf16xbf16) needs sizes that are multiples of 128, but the "
                             "model's hidden_size is 192; no build of --kernel stand-in takes "
                             "this model"),
    "default-build-intermediate": ({"moe_intermediate_size": 96},
                                   "checkpoint: the BF16 x BF16 kernel (--kernel stand-in's "
                                   "default --mma bf16xbf16) needs sizes that are multiples of "
                                   "128, but the model's moe_intermediate_size is 96"),
    "top-k-beyond-experts": ({"num_experts_per_tok": 9},
                             "checkpoint: {tmp}/ckpt: config.json routes each token to "
                             "num_experts_per_tok=9 of 8 routed experts"),
}


@pytest.mark.parametrize("case", list(SHAPES), ids=list(SHAPES))
def test_a_shape_the_build_cannot_take_is_refused_from_the_config(case, tmp_path, no_model,
                                                                  capsys):
    """The build's shape rules come from config.json alone: the fake checkpoint's weights
    file is empty, so nothing could be loaded."""
    config, message = SHAPES[case]
    path = _fake_checkpoint(tmp_path, **config)
    code = main(["eval", str(path), "--device", "cpu", "--pairs", "nvfp4:nvfp4"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("moewire eval: error: " + message.format(tmp=tmp_path)), err


def test_the_build_refusal_names_the_builds_that_fit(tmp_path, no_model):
    """H 512 and I 128: the FP8 x FP4 build (512) refuses I, the BF16 one (128) fits."""
    path = _fake_checkpoint(tmp_path, hidden_size=512, moe_intermediate_size=128)
    with pytest.raises(EvalError, match=r"^--mma fp8xfp4: the FP8 x FP4 kernel needs sizes that "
                       r"are multiples of 512, but the model's moe_intermediate_size is 128; "
                       r"use --mma bf16xbf16 for this model$"):
        evaluate(path, [("fp8", "fp8")], mma_type="fp8xfp4", device="cpu", text=TEXT,
                 log=lambda s: None)


@pytest.mark.parametrize("pattern", ["*combine_quantiser", "*layers.*.moe.combine_quantizer"],
                         ids=["misspelt-quantizer", "no-module-matches"])
def test_a_recipe_that_matches_no_quantizer_is_refused_before_loading(pattern, checkpoint,
                                                                     tmp_path, no_model, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f'quant_cfg:\n  - quantizer_name: "{pattern}"\n    cfg:\n'
                      "      format: nvfp4\n")
    path = checkpoint("mixtral")
    capsys.readouterr()
    code = main(["eval", str(path), "--device", "cpu", "--recipe", str(recipe),
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"moewire eval: error: --recipe: {recipe}: no entry ('{pattern}') "
                          "matches any wire quantizer of the model"), err
    assert "model.layers.0.mlp.experts.dispatch_quantizer" in err
    assert not (tmp_path / "out").exists()


def test_a_recipe_entry_for_no_quantizer_beside_a_good_one_is_refused(checkpoint, tmp_path,
                                                                      no_model):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text('quant_cfg:\n  - quantizer_name: "*dispatch_quantizer"\n    cfg:\n'
                      '      format: fp8\n  - quantizer_name: "*combine_quantiser"\n    cfg:\n'
                      "      format: nvfp4\n")
    with pytest.raises(EvalError, match=r"^--recipe: .*recipe.yaml: the recipe entry "
                       r"'\*combine_quantiser' .* matches no wire quantizer of the model"):
        evaluate(checkpoint("mixtral"), recipes=[str(recipe)], pairs=[], device="cpu",
                 text=TEXT, log=lambda s: None)


def _without(monkeypatch, package: str) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))


DEPENDENCIES = {
    "matplotlib-for-the-plot": ("matplotlib", {}, ["--out", "{tmp}/out"],
                                "--out: the plot kl.png needs matplotlib, which this Python "
                                "lacks; run: "),
    "accelerate-for-a-quantized-checkpoint": (
        "accelerate", {"quantization_config": {"quant_method": "fp8"}}, [],
        "checkpoint: {tmp}/ckpt is pre-quantized (quant_method 'fp8'), and transformers' "
        "loading of it needs accelerate, which this Python lacks; run: "),
    "accelerate-for-tasks": ("accelerate", {}, ["--tasks", "arc_easy"],
                             "--tasks: lm-eval's transformers model (lm_eval.models.huggingface "
                             "imports it) needs accelerate"),
    "transformers": ("transformers", {}, [], "checkpoint: moewire eval needs transformers"),
}


@pytest.mark.parametrize("case", list(DEPENDENCIES), ids=list(DEPENDENCIES))
def test_a_missing_dependency_is_one_line_before_loading(case, tmp_path, no_model, monkeypatch,
                                                         capsys):
    package, config, argv, message = DEPENDENCIES[case]
    path = _fake_checkpoint(tmp_path, **config)
    if case == "accelerate-for-tasks":
        (path / "tokenizer.json").write_text("{}")
    _without(monkeypatch, package)
    code = main(["eval", str(path), "--device", "cpu", "--pairs", "fp8:fp8",
                 *[a.format(tmp=tmp_path) for a in argv]])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("moewire eval: error: " + message.format(tmp=tmp_path)), err
    assert not (tmp_path / "out").exists()


def test_several_ranks_need_accelerate(tmp_path, monkeypatch):
    from moewire.eval.checks import Ranks, _check_dependencies

    _without(monkeypatch, "accelerate")
    with pytest.raises(EvalError, match=r"^torchrun: transformers' distributed loading "
                       r"\(DistributedConfig\) needs accelerate"):
        _check_dependencies({}, tmp_path, Ranks(world=2, local_world=2))
    _check_dependencies({}, tmp_path, Ranks())
