"""The streaming metrics: window sums on the device against a float64 oracle of the whole
evaluation, the exact baseline, memory that does not grow with the tokens, and the check
that every rank holds the same sums."""

from __future__ import annotations

import gc
import json
import math
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from moewire.eval import metrics
from moewire.eval.metrics import Reference, Totals, quantile

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 240


def _oracle(logits, base, targets):
    """Per-token KL, NLL and agreement of the whole evaluation at once, float64, with
    torch's own log_softmax (not the runner's z - logsumexp)."""
    logp, logp0 = logits.double().log_softmax(-1), base.double().log_softmax(-1)
    kl = (logp0.exp() * (logp0 - logp)).sum(-1)
    nll = -logp.gather(-1, targets[:, None])[:, 0]
    return kl, nll, (logits.argmax(-1) == base.argmax(-1)).double()


def _windows(tokens=70, vocab=50, seq=16, seed=0):
    """Random logits of a baseline and of a run 1e-2 away from it, split in windows (the
    last one shorter), and targets."""
    g = torch.Generator().manual_seed(seed)
    base = (3 * torch.randn(tokens, vocab, generator=g)).bfloat16()
    run = (base.float() + 0.05 * torch.randn(tokens, vocab, generator=g)).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    cuts = list(range(0, tokens, seq))
    return base, run, targets, [(c, min(c + seq, tokens)) for c in cuts]


@pytest.mark.parametrize("chunk", [metrics.CHUNK_ELEMENTS, 3 * 50], ids=["one-chunk", "3-rows"])
def test_totals_equal_the_oracle_of_the_whole_evaluation(chunk, monkeypatch):
    monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", chunk)
    base, run, targets, cuts = _windows()
    totals = Totals(2, ["a", "b"], base.shape[0], torch.device("cpu"))
    for lo, hi in cuts:
        ref = Reference.of(base[lo:hi])
        totals.add_logits(0, base[lo:hi], ref, targets[lo:hi], lo)
        totals.add_logits(1, run[lo:hi], ref, targets[lo:hi], lo)
    kl, nll, agree = _oracle(run, base, targets)
    # Every token's KL at its own place in the evaluation.
    assert torch.allclose(totals.token_kl(1), kl, rtol=1e-9, atol=0)
    got = totals.result(1)
    assert got["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-12)
    assert got["kl_p99"] == pytest.approx(np.quantile(kl.numpy(), 0.99), rel=1e-12)
    assert got["perplexity"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-12)
    assert got["top1_agreement"] == agree.mean().item()
    assert 0 < got["top1_agreement"] < 1 and got["kl_mean"] > 1e-5
    # The baseline against itself: exactly 0, not a rounding residue.
    base_result = totals.result(0)
    assert base_result["kl_mean"] == 0.0 and base_result["kl_p99"] == 0.0
    assert base_result["top1_agreement"] == 1.0


def test_layer_errors_are_the_relative_l2_of_all_windows():
    g = torch.Generator().manual_seed(1)
    y0 = torch.randn(40, 8, generator=g).bfloat16()
    y = (y0.float() + 0.01 * torch.randn(40, 8, generator=g)).bfloat16()
    totals = Totals(2, ["layer0"], 40, torch.device("cpu"))
    for lo in range(0, 40, 16):
        totals.add_reference_layer(0, y0[lo:lo + 16])
        totals.add_layer(1, 0, y[lo:lo + 16], y0[lo:lo + 16])
    want = ((y.double() - y0.double()).norm() / y0.double().norm()).item()
    assert totals.result(1)["layer_rel_l2"] == {"layer0": pytest.approx(want, rel=1e-12)}
    assert totals.result(0)["layer_rel_l2"] == {"layer0": 0.0}


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001], ids=lambda n: f"n{n}")
def test_quantile_is_numpys_linear_quantile(n):
    values = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    for q in (0.0, 0.5, 0.99, 1.0):
        assert quantile(values, q) == pytest.approx(np.quantile(values.numpy(), q), rel=1e-15)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Every rank adds the same windows to run 0; rank 1 adds another run's logits to run 1
    of a second buffer. Then each rank refuses (rank 1 only) and learns the first refusal."""
    try:
        sys.path.insert(0, str(HERE))
        import torch.distributed as dist
        from test_streaming import _windows

        from moewire.eval.checks import EvalError
        from moewire.eval.plan import _agree_on_refusal

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        base, run, targets, cuts = _windows()
        same = Totals(2, [], base.shape[0], torch.device("cpu"))
        apart = Totals(2, [], base.shape[0], torch.device("cpu"))
        for lo, hi in cuts:
            ref = Reference.of(base[lo:hi])
            for totals in (same, apart):
                totals.add_logits(0, base[lo:hi], ref, targets[lo:hi], lo)
            same.add_logits(1, run[lo:hi], ref, targets[lo:hi], lo)
            # One BF16 step on one logit of rank 1's last window: the sums must tell.
            other = run[lo:hi].clone()
            if rank == 1 and hi == base.shape[0]:
                other[0, 0] = other[0, 0] + other[0, 0].abs() * 2**-7
            apart.add_logits(1, other, ref, targets[lo:hi], lo)
        result = {"same": same.differing_runs(), "apart": apart.differing_runs()}
        try:
            _agree_on_refusal(EvalError("memory", "rank 1 is short") if rank == 1 else None)
        except EvalError as exc:
            result["refusal"] = str(exc)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def test_ranks_check_their_sums_agree_and_share_a_refusal(tmp_path):
    """Under expert parallelism every rank runs every window, and the runner checks that
    the sums are the same on every rank bit for bit; a refusal of one rank is every rank's."""
    from spawn_ranks import run_ranks

    results = run_ranks(_worker, 2, tmp_path, TIMEOUT_S)
    for got in results:
        assert got == {"same": [], "apart": [1], "refusal": "memory: rank 1 is short"}


# -- end to end on a tiny model ----------------------------------------------------------


def test_a_bf16_pair_is_the_baseline_bit_for_bit(checkpoint):
    """The baseline runs with its quantizers disabled; a bf16:bf16 pair run through the
    quantizers and the combine re-sum in the same lockstep gives KL 0, top-1 1 and zero
    layer error: the swap of quantizers between runs is exact."""
    pytest.importorskip("transformers.integrations.moe")
    from eval_helpers import TEXT

    from moewire.eval import evaluate

    report = evaluate(checkpoint("qwen3_moe"), [("bf16", "bf16"), ("fp8", "nvfp4")], text=TEXT,
                      max_tokens=64, seq_len=32, device="cpu", log=lambda s: None)
    base, same, pair = report["pairs"]
    for r in (base, same):
        assert r["kl_mean"] == 0.0 and r["kl_p99"] == 0.0 and r["top1_agreement"] == 1.0
        assert set(r["layer_rel_l2"].values()) == {0.0}
        assert r["perplexity"] == base["perplexity"]
    assert pair["kl_mean"] > 0 and min(pair["layer_rel_l2"].values()) > 0


def _live_tensor_bytes() -> int:
    """Bytes of the plain tensors alive now. Only exact ``torch.Tensor`` objects that own
    memory count: parameters are the model's, and the fake or functional tensors an
    earlier ``torch.compile`` test can leave in the garbage collector's lists own none
    (their storage refuses ``data_ptr``)."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor and obj.device.type != "meta":
            storage = obj.untyped_storage()
            try:
                key = storage.data_ptr()
            except RuntimeError:
                continue
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def test_memory_does_not_grow_with_the_tokens(checkpoint):
    """The tensors alive at the end of each window, at 64 and at 192 tokens: only the
    per-token KLs (8 bytes per token and run) may grow, never a window's logits per token
    (the tiny vocabulary's 256 FP32 logits are 1 KiB a token)."""
    pytest.importorskip("transformers.integrations.moe")
    from eval_helpers import TEXT

    from moewire.eval import evaluate

    seen: dict[int, list[int]] = {64: [], 192: []}
    for tokens, sizes in seen.items():

        def progress(stage, done, total, sizes=sizes):
            if stage == "window":
                sizes.append(_live_tensor_bytes())

        evaluate(checkpoint("mixtral"), [("fp8", "nvfp4")], text=TEXT * 2, max_tokens=tokens,
                 seq_len=32, device="cpu", log=lambda s: None, progress=progress)
    peaks = {tokens: max(sizes) for tokens, sizes in seen.items()}
    runs = 2
    assert peaks[192] - peaks[64] <= runs * (192 - 64) * 8 + 4096, peaks


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernel", "float64-torch"])
def test_the_sums_on_the_gpu_equal_the_cpus(monkeypatch, fused):
    """The CUDA path (the fused kernel, or with the kernels off the float64 torch one) against
    the CPU's float64 definition: the fused kernel's FP32 terms to 1e-5 of the KL and 1e-6 of
    the perplexity, the float64 path to 1e-9."""
    from moewire.eval import metrics

    monkeypatch.setenv("MOEWIRE_DISABLE_KERNELS", "0" if fused else "1")
    base, run, targets, cuts = _windows(tokens=300, vocab=151936, seq=128)
    results = []
    for device in ("cpu", "cuda"):
        totals = Totals(2, [], base.shape[0], torch.device(device))
        for lo, hi in cuts:
            b, r, t = (x[lo:hi].to(device) for x in (base, run, targets))
            ref = Reference.of(b)
            assert (ref.lse is None) == (fused and device == "cuda") == metrics.fused(b)
            totals.add_logits(0, b, ref, t, lo)
            totals.add_logits(1, r, ref, t, lo)
        results.append((totals.result(0), totals.result(1)))
    (cpu0, cpu1), (gpu0, gpu1) = results
    assert gpu0["kl_mean"] == 0.0 and gpu0["top1_agreement"] == 1.0
    rel = {"kl_mean": 1e-5, "kl_p99": 1e-5, "perplexity": 1e-6} if fused else {}
    for key in ("kl_mean", "kl_p99", "perplexity"):
        assert gpu1[key] == pytest.approx(cpu1[key], rel=rel.get(key, 1e-9)), key
    assert gpu1["top1_agreement"] == cpu1["top1_agreement"]


@pytest.mark.gpu
def test_a_bf16_pair_is_the_baseline_bit_for_bit_on_the_gpu(checkpoint):
    pytest.importorskip("transformers.integrations.moe")
    from eval_helpers import TEXT

    from moewire.eval import evaluate

    report = evaluate(checkpoint("qwen3_moe"), [("bf16", "bf16"), ("fp8", "nvfp4")], text=TEXT,
                      max_tokens=128, seq_len=64, device="cuda", log=lambda s: None)
    base, same, pair = report["pairs"]
    for r in (base, same):
        assert r["kl_mean"] == 0.0 and r["top1_agreement"] == 1.0
        assert set(r["layer_rel_l2"].values()) == {0.0}
    assert pair["kl_mean"] > 0
