"""What the eval tests share: the text, and checkpoints with a tokenizer and a local task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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


def torchrun_eval(checkpoint: Path, tmp: Path, ranks: int, args: list[str],
                  timeout: float) -> tuple[dict, list[list[str]], str]:
    """``ranks`` ranks of ``rank_main.py eval CHECKPOINT ARGS`` under real torchrun (the
    test's text in ``tmp/text.txt``, ``--out tmp/out``): rank 0's results.json, each rank's
    written paths under ``tmp/out`` (``rank_main.py``'s audit hook) and the command's
    stdout."""
    text = tmp / "text.txt"
    text.write_text(TEXT)
    writes = tmp / "writes"
    writes.mkdir()
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, OMP_NUM_THREADS="1", MOEWIRE_TEST_WRITES=str(writes),
               PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    out = tmp / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(ranks), str(Path(__file__).resolve().parent / "rank_main.py"), "eval",
           str(checkpoint), *args, "--text", str(text), "--out", str(out)]
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"{ranks} ranks: {time.perf_counter() - started:.1f} s")
    assert done.returncode == 0, done.stderr[-4000:]
    written = [[p for p in json.loads((writes / f"rank{r}.json").read_text())
                if Path(p).resolve().is_relative_to(out.resolve())] for r in range(ranks)]
    return json.loads((out / "results.json").read_text()), written, done.stdout
