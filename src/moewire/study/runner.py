"""Run a study: build the layer, route the batches, sweep every dispatch x combine pair.

Simulated expert parallelism (``--ranks R``): the study runs in one process. A batch of
``T`` tokens stands for ``R`` ranks of ``T / R`` tokens each (token ``t`` on rank
``t // (T / R)``), and experts are split as DeepGEMM splits them (expert ``e`` on rank
``e // (E / R)``). The numbers equal those of ``R`` real ranks because:

- every combine row is computed from one token and one expert, wherever that expert
  lives, and the combine re-quantization and re-sum are per row and per token: the rank
  count changes no row and no sum;
- the dispatch quantizer quantizes each token on its own rank with the same scale;
- the one place ranks meet is calibration: each rank's amax is the max over its own
  tokens and rows, then max-all-reduced over the EP group. A max of maxes is the max
  over the union, exactly, so one process that sees all ``R`` ranks' calibration tokens
  gets the synced amax bit for bit.

What ``R`` does change is how much traffic leaves a rank: copies whose expert lives on
the token's own rank stay local. The study reports that fraction (``remote_fraction``).

The time estimate (:mod:`moewire.study.comm`) splits the same routing over ``--ep-size``
ranks (which need not be ``R``) to measure the fraction of copies that leave their rank
and the busiest rank's load, and turns each pair's bytes into dispatch and combine time on
the ``--interconnect`` profile.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import moewire
from moewire.study import comm, real_kernel
from moewire.study.data import load_activations, synthetic_hidden_states
from moewire.study.errors import StudyArgumentError
from moewire.study.layer import (
    Batch,
    StudyLayer,
    build_layer,
    check_resources,
    needs_calibration,
    reference_outputs,
    run_pair,
)
from moewire.study.metrics import error_metrics
from moewire.study.settings import SCHEMA, StudyConfig, ep_size, validate
from moewire.study.wire import remote_fraction, wire_cost


@dataclass
class Progress:
    """Callbacks the runner reports to; the defaults do nothing.

    Attributes:
        phase: ``phase(label)`` when a stage begins (building, the reference, done).
        build: ``build(experts built, experts total)`` while the layer is built.
        pair_start: ``pair_start(pairs done, pairs total, label)`` before a pair runs.
        pair_done: ``pair_done(pairs done, pairs total, label)`` after it (``done``
            counts it).
    """

    phase: Callable[[str], None] = lambda label: None
    build: Callable[[int, int], None] = lambda done, total: None
    pair_start: Callable[[int, int, str], None] = lambda done, total, label: None
    pair_done: Callable[[int, int, str], None] = lambda done, total, label: None


def _batches(cfg: StudyConfig, layer: StudyLayer, generator: torch.Generator):
    n_calib, n_eval, t = cfg.calib_batches, cfg.eval_batches, cfg.tokens
    if cfg.activations is not None:
        x = load_activations(cfg.activations, layer.hidden)
        need = (n_calib + n_eval) * t
        if x.shape[0] < need:
            raise StudyArgumentError(
                "--tokens", f"{cfg.activations} holds {x.shape[0]} tokens but "
                f"(--calib-batches {n_calib} + --eval-batches {n_eval}) x --tokens {t} = "
                f"{need} are needed; lower --tokens or the batch counts, or capture more"
            )
        chunks = list(x[:need].split(t))
    else:
        chunks = [synthetic_hidden_states(t, layer.hidden, generator, layer.norm_gamma)
                  for _ in range(n_calib + n_eval)]
    batches: list[Batch] = []
    for chunk in chunks:
        chunk = chunk.to(layer.device)
        w, ids = layer.router(chunk)
        batches.append((chunk, w, ids))
    return batches[:n_calib], batches[n_calib:]


def preflight(cfg: StudyConfig) -> StudyConfig:
    """Every check that needs no data: :func:`moewire.study.settings.validate`, then, for
    ``--kernel deepgemm-sm90``, whether the real kernel can run here. Returns ``cfg``."""
    validate(cfg)
    if cfg.kernel == "deepgemm-sm90":
        real_kernel.check(cfg)
    return cfg


def _pairs(cfg: StudyConfig) -> list[tuple[str, str]]:
    return [(d, c) for d in cfg.dispatch for c in cfg.combine]


def run_study(cfg: StudyConfig, progress: Progress | None = None) -> dict:
    """Run the sweep of ``cfg`` and return the ``results.json`` document.

    Args:
        cfg: validated or not (validated here).
        progress: optional callbacks for a progress display.

    Returns:
        A JSON-ready dict (schema in ``docs/study.md``): ``schema``, ``versions``,
        ``settings``, ``layer``, ``routing`` (with the time estimate's EP split),
        ``interconnect``, ``baseline``, ``results`` (one entry per pair, dispatch-major,
        ``bf16`` first on both axes, with its error, bytes and estimated time).
        Non-finite floats are Python ``inf``; :func:`moewire.study.report.to_json` writes
        them as ``"inf"``.
    """
    preflight(cfg)
    progress = progress or Progress()
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    started = time.perf_counter()

    plan = check_resources(cfg)
    progress.phase(f"building the layer ({plan})")
    if cfg.kernel == "deepgemm-sm90":
        layer = real_kernel.build_layer(cfg, generator)
    else:
        layer = build_layer(cfg, generator, progress.build)
    calib, evals = _batches(cfg, layer, generator)
    pairs = _pairs(cfg)
    # The fake quantization's own cost is measured where it means something: on the GPU.
    timed = layer.device.type == "cuda"

    progress.phase("unquantized reference")
    ref_outputs = reference_outputs(layer, evals)
    ref = torch.cat(ref_outputs)
    ids = torch.cat([b[2] for b in evals])
    ref64 = ref.double()
    link = comm.custom_interconnect(comm.INTERCONNECTS[cfg.interconnect], cfg.link_gbps,
                                    cfg.link_latency_us)
    traffic = comm.measure_traffic([b[2] for b in evals], layer.num_experts,
                                   ep_size(cfg, layer.num_experts),
                                   cfg.ep_tokens or cfg.tokens_per_rank)
    results = []
    for done, (d, c) in enumerate(pairs):
        label = f"dispatch {d} x combine {c}"
        progress.pair_start(done, len(pairs), label)
        run = run_pair(layer, d, c, calib, evals, timed=timed)
        y = torch.cat(run.outputs)
        metrics = error_metrics(y, ref)
        results.append({
            "dispatch": d,
            "combine": c,
            **metrics.as_dict(),
            **wire_cost(d, c, layer.hidden, layer.top_k).as_dict(),
            **comm.comm_time(link, traffic, d, c, layer.hidden).as_dict(),
            "fake_quant_us": run.added_us,
            "calibrated": needs_calibration(d, c),
            "amax": run.amax,
        })
        progress.pair_done(done + 1, len(pairs), label)

    per_rank = cfg.tokens_per_rank
    remote = [remote_fraction(b[2], layer.num_experts, cfg.ranks, per_rank) for b in evals]
    load = torch.bincount(ids.reshape(-1).clamp(min=0), minlength=layer.num_experts)
    doc = {
        "schema": SCHEMA,
        "versions": {
            "moewire": moewire.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "settings": cfg.as_dict(),
        "layer": {**layer.shapes(), "preset": cfg.preset.as_dict()},
        "routing": {
            "eval_tokens": int(ref.shape[0]),
            "calib_tokens": sum(int(b[0].shape[0]) for b in calib),
            "tokens_per_rank": per_rank,
            "remote_fraction": sum(remote) / len(remote),
            "expert_load_max_over_mean": float(load.max()) / float(load.float().mean()),
            # The synthetic router's expected-load target; None for a checkpoint's router.
            "target_max_over_mean": layer.router_imbalance,
            # The time estimate's EP split of the same routing (moewire.study.comm).
            "ep": traffic.as_dict(),
            # The evaluation batches' expert ids, [batches][T][k]: what `--from` splits
            # over another EP size without running the sweep again (moewire.study.retime).
            "eval_topk_ids": [b[2].cpu().tolist() for b in evals],
        },
        "interconnect": link.as_dict(),
        "baseline": {
            "output_rms": float(ref64.square().mean().sqrt()),
            "output_absmax": float(ref64.abs().max()),
        },
        "results": results,
    }
    progress.phase(f"done in {time.perf_counter() - started:.1f} s")
    return doc
