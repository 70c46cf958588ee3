"""``moewire checkpoint``: the tiny checkpoints the docs run, made from the docs."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from moewire import checkpoints, cli  # noqa: E402


def test_the_byte_tokenizer_reads_a_text_as_its_bytes(tmp_path):
    from transformers import AutoTokenizer

    checkpoints.save_byte_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "Wire formats: ±1.5 µs, déjà vu\n\t~"
    assert tokenizer(text)["input_ids"] == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text
    assert tokenizer.eos_token_id == 0


def test_the_fp4_checkpoint_holds_the_bf16_twins_values(tmp_path):
    from safetensors.torch import load_file

    fp4, bf16 = checkpoints.deepseek_v4_checkpoints(tmp_path / "fp4", tmp_path / "bf16")
    packed, twin = load_file(fp4 / "model.safetensors"), load_file(bf16 / "model.safetensors")
    assert json.loads((fp4 / "config.json").read_text())["quantization_config"][
        "expert_dtype"] == "fp4"
    inter = checkpoints.V4["intermediate"]
    for e in (0, checkpoints.V4["experts"] - 1):
        prefix = f"model.layers.0.ffn.experts.{e}"
        w1 = packed[f"{prefix}.w1.weight"].view(torch.uint8).long()
        codes = torch.stack([w1 & 15, w1 >> 4], dim=-1).reshape(w1.shape[0], -1)
        assert packed[f"{prefix}.w1.scale"].float().unique().tolist() == [checkpoints.L1_SCALE]
        assert twin[f"{prefix}.w1.weight"].shape == (inter, checkpoints.V4["hidden"])
        torch.testing.assert_close(checkpoints.decode(codes) * checkpoints.L1_SCALE,
                                   twin[f"{prefix}.w1.weight"].double(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["checkpoint", "llama", "DIR"], "argument kind: invalid choice: 'llama'"),
     (["checkpoint", "qwen3-moe", "FILE"], "exists and is not an empty directory")],
    ids=["unknown-kind", "existing-path"])
def test_checkpoint_refusals(argv, message, tmp_path, capsys):
    (tmp_path / "FILE").write_text("x")
    argv = [str(tmp_path / a) if a in ("DIR", "FILE") else a for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert err.startswith("moewire checkpoint: error: ")


def test_the_docs_example_model_has_the_docs_shapes(tmp_path, capsys):
    assert cli.main(["checkpoint", "qwen3-moe", str(tmp_path / "m")]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_local_experts"], config["num_experts_per_tok"],
            config["hidden_size"], config["moe_intermediate_size"], config["vocab_size"]) == (
        4, 16, 4, 256, 256, 4096)
    assert not (tmp_path / "m" / "tokenizer.json").exists()
