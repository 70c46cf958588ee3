"""What the eval tests share: the text, and checkpoints with a tokenizer and a local task."""

from __future__ import annotations

import json
from pathlib import Path

#: The evaluation text of the tests (bytes modulo the tiny vocabulary).
TEXT = "The quick brown fox jumps over the lazy dog. " * 8


def save_byte_tokenizer(path: Path) -> None:
    """``moewire.checkpoints.save_byte_tokenizer`` (token ``i`` is byte ``i``, ``<eos>``
    replaces byte 0, which no test text holds), whose byte table is ``ByteLevel``'s alphabet."""
    from tokenizers import pre_tokenizers

    from moewire import checkpoints

    assert set(checkpoints._byte_chars().values()) == set(pre_tokenizers.ByteLevel.alphabet())
    checkpoints.save_byte_tokenizer(path)


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
