"""What the eval tests share: the text, and checkpoints with a tokenizer and a local task."""

from __future__ import annotations

import json
from pathlib import Path

#: The evaluation text of the tests (bytes modulo the tiny vocabulary).
TEXT = "The quick brown fox jumps over the lazy dog. " * 8


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer of 256 tokens into checkpoint ``path``: token ``i`` is byte
    ``i`` (as moewire eval reads a checkpoint without one), and ``<eos>`` replaces byte 0,
    which no test text holds; no merges, so a text's tokens are its bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_chars()
    assert set(chars.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {chars[b]: b for b in range(1, 256)} | {"<eos>": 0}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(path)


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character table (the one ``ByteLevel`` uses)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


#: The local task's documents: "a + b =", the right sum at ``gold``, a wrong one beside it
#: (lm-eval puts its ``target_delimiter``, one space, between the question and a choice).
DOCS = [{"question": f"{a} + {b} =",
         "choices": [f"{a + b}", f"{a + b + 1}"][:: 1 if (a + b) % 2 == 0 else -1],
         "gold": (a + b) % 2} for a in range(3) for b in range(3)]


def write_task(directory: Path) -> str:
    """A multiple-choice lm-eval task over a local JSON-lines file, in ``directory``;
    returns its name."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "sums.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (directory / "tiny_sums.yaml").write_text(
        "task: tiny_sums\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return "tiny_sums"
