"""``moewire study`` end to end on ``tiny``: files, JSON schema, determinism, bad arguments."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from study_helpers import EXPERTS, LAYER, dense_checkpoint

from moewire import cli
from moewire.study import PRESETS, StudyConfig, run_study
from moewire.study.errors import StudyArgumentError
from moewire.study.layer import build_layer
from moewire.study.runner import _batches

TINY = ["study", "--model", "tiny", "--tokens", "16", "--calib-batches", "1",
        "--eval-batches", "1", "--dispatch", "fp8", "--combine", "nvfp4,mxfp8"]
METRICS = ("rel_l2", "sqnr_db", "cosine", "max_abs_err")
COSTS = ("dispatch_bytes_per_token", "combine_bytes_per_token", "bytes_per_token",
         "ratio_to_bf16", "dispatch_us", "combine_us", "comm_us", "bf16_comm_us", "saved_us",
         "time_ratio_to_bf16")


def _run(tmp_path, name, *extra):
    out = tmp_path / name
    assert cli.main([*TINY, "--out", str(out), *extra]) == 0
    return out, json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("study"), "a")


def test_writes_the_three_files(tiny_run, capsys):
    out, _ = tiny_run
    for name in ("results.json", "error_heatmap.png", "frontier.png"):
        data = (out / name).read_bytes()
        assert len(data) > 1000, name
    assert (out / "error_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_schema(tiny_run):
    _, doc = tiny_run
    assert doc["schema"] == "moewire.study/2"
    assert set(doc) == {"schema", "versions", "settings", "layer", "routing", "interconnect",
                        "baseline", "results"}
    assert doc["versions"]["torch"] == torch.__version__
    assert isinstance(doc["versions"]["moewire"], str)
    s = doc["settings"]
    assert s["model"] == "tiny" and s["seed"] == 0 and s["tokens"] == 16
    assert s["dispatch"] == ["bf16", "fp8"] and s["combine"] == ["bf16", "nvfp4", "mxfp8"]
    tiny = PRESETS["tiny"]
    layer = doc["layer"]
    assert (layer["num_experts"], layer["top_k"], layer["hidden"], layer["intermediate"]) == (
        tiny.num_experts, tiny.top_k, tiny.hidden, tiny.intermediate)
    assert doc["routing"]["eval_tokens"] == 16 and doc["routing"]["calib_tokens"] == 16
    pairs = [(r["dispatch"], r["combine"]) for r in doc["results"]]
    assert pairs == [(d, c) for d in s["dispatch"] for c in s["combine"]]
    for r in doc["results"]:
        for key in METRICS + COSTS:
            assert isinstance(r[key], (int, float)) or r[key] == "inf", (key, r)
        assert isinstance(r["calibrated"], bool)
        assert set(r["amax"]) == {"dispatch", "combine"}
        assert r["fake_quant_us"] is None  # measured on CUDA only
    # The time estimate: the default profile at EP 8 (16 experts, 16 tokens: 8 divides both).
    assert doc["interconnect"]["name"] == "nvlink-h200"
    assert "DeepEP" in doc["interconnect"]["source"]
    ep = doc["routing"]["ep"]
    assert ep["ep_size"] == 8 and ep["tokens_per_rank"] == 16 and ep["top_k"] == tiny.top_k
    assert 0.5 < ep["remote_fraction"] < 1 and ep["bottleneck"] >= 1


def test_baseline_is_exact_and_quantized_pairs_are_not(tiny_run):
    _, doc = tiny_run
    by_pair = {(r["dispatch"], r["combine"]): r for r in doc["results"]}
    base = by_pair["bf16", "bf16"]
    assert base["rel_l2"] == 0 and base["max_abs_err"] == 0 and base["cosine"] == 1
    assert base["sqnr_db"] == "inf" and math.isinf(float(base["sqnr_db"]))
    assert base["ratio_to_bf16"] == 1
    assert base["time_ratio_to_bf16"] == 1 and base["saved_us"] == 0
    assert base["comm_us"] == base["bf16_comm_us"] > 0
    for pair, r in by_pair.items():
        if pair != ("bf16", "bf16"):
            assert 0 < r["rel_l2"] < 1 and r["sqnr_db"] > 0, pair
            assert r["ratio_to_bf16"] < 1
            assert r["time_ratio_to_bf16"] < 1 and r["saved_us"] > 0
            assert r["comm_us"] == pytest.approx(r["dispatch_us"] + r["combine_us"])
    # fp8 (per tensor) needs a calibrated amax; mxfp8 computes its scales per block.
    assert by_pair["fp8", "bf16"]["calibrated"] and by_pair["fp8", "bf16"]["amax"]["dispatch"]
    assert not by_pair["bf16", "mxfp8"]["calibrated"]


def test_same_command_same_numbers(tiny_run, tmp_path):
    out_a, doc_a = tiny_run
    out_b, doc_b = _run(tmp_path, "b")
    doc_a["settings"].pop("out")
    doc_b["settings"].pop("out")
    assert doc_a == doc_b


def test_real_weights_and_activations(checkpoint, activations, tmp_path):
    path, _ = checkpoint
    acts, _ = activations
    out, doc = _run(tmp_path, "real", "--weights", str(path), "--layer", str(LAYER),
                    "--activations", str(acts))
    assert doc["layer"]["num_experts"] == EXPERTS
    assert doc["layer"]["shared_intermediate"] == 512
    assert doc["layer"]["weights"].endswith(f"layer {LAYER}")
    assert doc["settings"]["activations"] == str(acts)


def test_simulated_ranks_report_the_off_rank_fraction():
    cfg = StudyConfig(model="tiny", tokens=16, ranks=4, calib_batches=1, eval_batches=1,
                      dispatch=("bf16",), combine=("bf16",))
    doc = run_study(cfg)
    # Tiny has 16 experts: with 4 ranks, 3 of every 4 uniformly spread copies are remote.
    assert 0.4 < doc["routing"]["remote_fraction"] < 1.0
    assert doc["results"][0]["rel_l2"] == 0


def test_formats_command_prints_the_table(capsys):
    assert cli.main(["formats"]) == 0
    out = capsys.readouterr().out
    for name in ("bf16", "fp8", "nvfp4", "mxfp4", "logfmt10"):
        assert name in out
    assert "4.5" in out  # nvfp4 bits per element at H=4096


def test_builds_command_lists_the_nvfp4_x_nvfp4_kernel_per_build(capsys):
    """DeepGEMM 2.8.0's fp4_fp4_mega_moe supported, vLLM 0.33/0.34's refused: by build."""
    assert cli.main(["builds"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    fp4 = {r[0]: r[2] for r in rows if r[1] == "fp4_fp4_mega_moe"}
    assert fp4 == {"deepgemm-2.8": "supported", "vllm-0.33": "refused"}
    assert any(r[:3] == ["vllm-0.33", "nvfp4_mega_moe", "supported"] for r in rows)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--dispatch", "fp9"], "--dispatch: unknown wire format 'fp9'"),
        (["--combine", "nvfp4,int3"], "--combine: unknown wire format 'int3'"),
        (["--tokens", "0"], "argument --tokens: must be >= 1"),
        (["--tokens", "many"], "argument --tokens: expected an integer"),
        (["--calib-batches", "-1"], "argument --calib-batches: must be >= 1"),
        (["--model", "gpt5"], "argument --model: invalid choice"),
        (["--ranks", "3"], "--tokens: 16 tokens do not split evenly over --ranks 3"),
        (["--tokens", "15", "--ranks", "3"], "--ranks: 16 experts do not split evenly"),
        (["--weights", "/nonexistent/w.safetensors", "--layer", "0"],
         "--weights: /nonexistent/w.safetensors does not exist"),
        (["--weights", "{junk}", "--layer", "0"], "--weights: cannot read"),
        (["--weights", "{ckpt}"], "--layer: --weights and --layer go together"),
        (["--weights", "{ckpt}", "--layer", "7"], "--layer: "),
        (["--activations", "{short}"], "--tokens: "),
        (["--activations", "{narrow}"], "--activations: "),
        (["--experts", "2"], "--experts: 2 experts are fewer than top-k 4"),
        (["--weights", "{ckpt}", "--layer", "3", "--experts", "4"],
         "--experts: a --weights checkpoint fixes the expert count"),
        (["--weights", "{wide}", "--layer", "3"],
         "--weights: hidden size 640 is not a multiple of 512"),
    ],
    ids=["unknown-dispatch", "unknown-combine", "zero-tokens", "non-int-tokens",
         "negative-calib", "unknown-model", "tokens-vs-ranks", "experts-vs-ranks",
         "missing-weights", "unreadable-weights", "weights-without-layer", "wrong-layer",
         "too-few-activations", "activation-hidden-mismatch", "too-few-experts",
         "experts-with-weights", "hidden-not-kernel-multiple"],
)
def test_bad_arguments_exit_2_with_the_fix(args, needle, tmp_path, checkpoint, capsys):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 64)
    short, narrow = tmp_path / "short.pt", tmp_path / "narrow.pt"
    torch.save(torch.randn(8, 512), short)
    torch.save(torch.randn(64, 256), narrow)
    wide = tmp_path / "wide.safetensors"
    save_file(dense_checkpoint(hidden=640), str(wide))
    subst = {"{junk}": str(junk), "{ckpt}": str(checkpoint[0]), "{short}": str(short),
             "{narrow}": str(narrow), "{wide}": str(wide)}
    args = [subst.get(a, a) for a in args]
    code = cli.main([*TINY, "--out", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err, err
    assert not (tmp_path / "out" / "results.json").exists()


def test_study_argument_error_is_a_value_error():
    with pytest.raises(ValueError, match="--ranks"):
        run_study(StudyConfig(model="tiny", tokens=16, ranks=0))
    assert issubclass(StudyArgumentError, ValueError)


def test_calibration_sees_only_the_calibration_batches():
    cfg = StudyConfig(model="tiny", tokens=16, calib_batches=1, eval_batches=1,
                      dispatch=("bf16", "fp8"), combine=("bf16",))
    doc = run_study(cfg)
    g = torch.Generator().manual_seed(cfg.seed)
    calib, evals = _batches(cfg, build_layer(cfg, g), g)
    got = next(r for r in doc["results"] if r["dispatch"] == "fp8")["amax"]["dispatch"]
    # Every token is routed, so the dispatch amax is max |x| over the calibration tokens,
    # and not over the held-out ones.
    assert got == float(calib[0][0].abs().amax().float())
    assert got != float(evals[0][0].abs().amax().float())
