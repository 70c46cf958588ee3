"""``moewire eval --tasks``: lm-evaluation-harness's accuracy and stderr for the baseline and a
pair, on a tiny model with a local multiple-choice task over a JSON-lines file, offline;
each run's accuracy equals an independent scoring of the same documents by that run's
model."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers.integrations.moe")
pytest.importorskip("lm_eval")

import torch  # noqa: E402
from eval_helpers import DOCS, TEXT, save_byte_tokenizer, write_task  # noqa: E402

import moewire
from moewire.cli import main
from moewire.eval import pair_entries
from moewire.eval.tasks import scores


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network, and the datasets cache of this test only."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


@pytest.fixture
def tokenized(checkpoint, tmp_path):
    """The tiny Qwen3-MoE checkpoint with a byte tokenizer (token i is byte i)."""
    path = tmp_path / "ckpt"
    path.mkdir()
    for f in checkpoint("qwen3_moe").iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    save_byte_tokenizer(path)
    return path


def _accuracy(model) -> float:
    """lm-eval's multiple-choice ``acc``, scored here: the choice with the largest summed
    log-probability of its tokens (a space, then the choice's bytes) after the question is
    the answer."""
    right = 0
    for doc in DOCS:
        context = list(doc["question"].encode())
        logliks = []
        for choice in doc["choices"]:
            ids = torch.tensor(context + list(f" {choice}".encode()))
            with torch.no_grad():
                logp = model(ids[None, :-1]).logits[0].double().log_softmax(-1)
            tail = ids[len(context):]
            logliks.append(logp[len(context) - 1:].gather(-1, tail[:, None]).sum().item())
        right += max(range(len(logliks)), key=logliks.__getitem__) == doc["gold"]
    return right / len(DOCS)


def test_tasks_report_accuracy_and_stderr_beside_the_baseline(tokenized, tmp_path, offline,
                                                              capsys, monkeypatch):
    from moewire.eval import tasks

    installed = []
    real = tasks.run_tasks

    def spy(model, *args, **kwargs):
        """Which formats the model's quantizers have while lm-eval runs."""
        installed.append({(q.fmt.name if q.enabled else "off")
                          for _, _, q in moewire.megamoe.api.quantizers(model)})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(tasks, "run_tasks", spy)
    task, out, code = _eval_with_a_task(tokenized, tmp_path)
    printed = capsys.readouterr().out
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    assert report["tasks"] == [task]
    accs = {}
    for run in report["pairs"]:
        score = run["tasks"][task]["acc"]
        # lm-eval's standard error of a mean over 9 documents.
        n, p = len(DOCS), score["value"]
        assert score["stderr"] == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)), rel=1e-9)
        accs[run["name"]] = p
        assert f"{p:.4f}±{score['stderr']:.4f}" in printed
    assert f"{task}/acc" in printed.splitlines()[0]
    assert installed == [{"off"}, {"fp8", "nvfp4"}]

    # The same runs scored independently: the baseline, then the pair calibrated as the
    # eval calibrates it (on its first window of the text).
    import transformers as tf

    import moewire.integrations.transformers as mt

    mt.register()
    model = mt.prepare(tf.AutoModelForCausalLM.from_pretrained(
        tokenized, experts_implementation="moewire", dtype=torch.bfloat16), max_num_tokens=32)
    assert accs["bf16:bf16"] == _accuracy(model)
    ids = torch.tensor(list(TEXT.encode())[:32])
    moewire.quantize(model, {"quant_cfg": pair_entries("fp8", "nvfp4")},
                     lambda m: m(ids[None], use_cache=False))
    try:
        assert accs["fp8:nvfp4"] == _accuracy(model)
    finally:
        moewire.unquantize(model)


@pytest.mark.parametrize(
    ("results", "expected"),
    [
        ({"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1}},
         {"t": {"acc": {"value": 0.5, "stderr": 0.1}}}),
        ({"t": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": "N/A"}},
         {"t": {"exact_match,strict-match": {"value": 0.25, "stderr": None}}}),
        ({"g": {"name": "g", "sample_len": 9, "acc_norm,none": 1, "acc_norm_stderr,none": 0}},
         {"g": {"acc_norm": {"value": 1.0, "stderr": 0.0}}}),
    ],
    ids=["acc", "filtered-no-stderr", "group"],
)
def test_scores_read_lm_evals_results(results, expected):
    assert scores(results) == expected


def _not_loaded(*args, **kwargs):
    raise AssertionError("the model was loaded before the refusal")


def _hub_task(directory, dataset: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "hub_task.yaml").write_text(
        f"task: hub_task\ndataset_path: {dataset}\ndataset_name: tiny\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: ['a', 'b']\n"
        "doc_to_target: 0\nmetric_list:\n  - metric: acc\n")
    return "hub_task"


def test_a_tasks_dataset_missing_offline_is_refused_before_loading(tokenized, tmp_path, offline,
                                                                   capsys, monkeypatch):
    """Downloads off and the dataset not in the cache: one line naming the dataset and how to
    fetch it, exit 2, before the model loads and before --out is claimed."""
    import datasets.config
    import huggingface_hub.constants

    from moewire.eval import runner

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(runner, "_load", _not_loaded)
    task = _hub_task(tmp_path / "tasks", "moewire-tests/absent")
    out = tmp_path / "out"
    code = main(["eval", str(tokenized), "--pairs", "fp8:nvfp4", "--tasks", task,
                 "--tasks-path", str(tmp_path / "tasks"), "--max-tokens", "32", "--seq-len",
                 "32", "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert ("--tasks: task 'hub_task' reads the dataset 'moewire-tests/absent' (config 'tiny'), "
            "which is not in the datasets cache") in err
    assert ("datasets.load_dataset('moewire-tests/absent', 'tiny')" in err
            and "HF_HUB_OFFLINE" in err), err
    assert not out.exists() or not any(out.iterdir())


def test_a_failing_task_leaves_the_metrics_on_disk_and_ends_in_one_line(tokenized, tmp_path,
                                                                       offline, capsys,
                                                                       monkeypatch):
    from moewire.eval import tasks

    def offline_hub(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'x' on the Hub (OfflineModeIsEnabled)\nsecond line")

    monkeypatch.setattr(tasks, "run_tasks", offline_hub)
    task, out, code = _eval_with_a_task(tokenized, tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == (
        "moewire eval: error: --tasks: lm-eval failed on run bf16:bf16 (ConnectionError: "
        "Couldn't reach 'x' on the Hub (OfflineModeIsEnabled)); the perplexity, KL and top-1 "
        f"results are in {out / 'results.json'}")
    report = json.loads((out / "results.json").read_text())
    assert report["complete"] is False and f"moewire eval: error: {report['error']}" == err[-1]
    assert [r["name"] for r in report["pairs"]] == ["bf16:bf16", "fp8:nvfp4"]
    assert report["pairs"][1]["kl_mean"] > 0 and math.isfinite(report["pairs"][1]["perplexity"])
    assert (out / "kl.png").stat().st_size > 0


def _eval_with_a_task(checkpoint, tmp_path) -> tuple[str, object, int]:
    """``moewire eval CHECKPOINT --pairs fp8:nvfp4 --tasks TASK`` on the local task and the
    test text, 32 tokens on the CPU: (the task's name, --out, the exit code)."""
    task = write_task(tmp_path / "tasks")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "out"
    code = main(["eval", str(checkpoint), "--pairs", "fp8:nvfp4", "--tasks", task,
                 "--tasks-path", str(tmp_path / "tasks"), "--text", str(text),
                 "--max-tokens", "32", "--seq-len", "32", "--device", "cpu", "--out", str(out)])
    return task, out, code

