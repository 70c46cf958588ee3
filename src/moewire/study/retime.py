"""Re-apply the time model to a finished sweep: ``moewire study --from results.json``.

The error of a pair depends on the formats, the layer and the tokens, never on the
interconnect or the EP size of the time estimate. So changing ``--interconnect``,
``--ep-size``, ``--ep-tokens``, ``--link-gbps`` or ``--link-latency-us`` needs no new
sweep: the evaluation batches' routing, stored in ``results.json``
(``routing.eval_topk_ids``), is split over the new EP size and every pair's bytes are
turned into time again (:mod:`moewire.study.comm`), in well under a second.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from moewire.study.errors import StudyArgumentError
from moewire.study.paths import existing_file
from moewire.study.settings import (
    SCHEMA,
    StudyConfig,
    check_comm_flags,
    check_ep_experts,
    ep_size,
)

#: The flags ``--from`` may change (the time estimate's): StudyConfig field names.
TIME_FIELDS = ("interconnect", "ep_size", "ep_tokens", "link_gbps", "link_latency_us")
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _decode(pairs: list[tuple[str, Any]]) -> dict:
    return {k: _NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in pairs}


def read_results(path: str | Path) -> dict:
    """A ``results.json`` written by ``moewire study``, with ``"inf"`` / ``"nan"`` read
    back as floats.

    Raises:
        StudyArgumentError: (``--from``) the file is missing, not JSON, not a study's
            results, or lacks the stored routing (written by an older moewire).
    """
    path = existing_file(path, "--from", "the results.json a finished `moewire study` wrote")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_decode)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StudyArgumentError("--from", f"{path} is not JSON ({exc}); pass the "
                                 "results.json of a study") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise StudyArgumentError(
            "--from", f"{path} has schema {found!r}, and --from reads {SCHEMA!r}; run the "
            "sweep again with this moewire (without --from)"
        )
    if "eval_topk_ids" not in doc.get("routing", {}):
        raise StudyArgumentError(
            "--from", f"{path} holds no routing (routing.eval_topk_ids), which the time "
            "model needs; it was written by an older moewire: run the sweep again"
        )
    return doc


def retime(doc: dict, **changes: Any) -> dict:
    """``doc`` with the time model re-applied under ``changes`` (keys of
    :data:`TIME_FIELDS`; ``None`` values keep the recorded setting, except ``ep_size``,
    ``ep_tokens``, ``link_gbps`` and ``link_latency_us``, whose ``None`` means the default).

    Returns:
        A new document: ``settings``, ``interconnect``, ``routing.ep`` and every result's
        time columns replaced; errors and bytes unchanged.

    Raises:
        StudyArgumentError: a flag the sweep's shapes refuse (the EP size must split the
            expert and token counts, as for a fresh sweep).
    """
    import torch

    from moewire.study import comm

    unknown = sorted(set(changes) - set(TIME_FIELDS))
    if unknown:
        raise ValueError(f"retime: {unknown} are not time-estimate settings ({TIME_FIELDS})")
    names = {f.name for f in fields(StudyConfig)}
    recorded = {k: v for k, v in doc["settings"].items() if k in names}
    for key in ("dispatch", "combine"):
        recorded[key] = tuple(recorded[key])
    cfg = replace(StudyConfig(**recorded), **changes)
    num_experts = int(doc["layer"]["num_experts"])
    check_comm_flags(cfg)
    if cfg.ep_size is not None:  # a --weights sweep: the layer's expert count
        check_ep_experts(cfg.ep_size, num_experts)
    link = comm.custom_interconnect(comm.INTERCONNECTS[cfg.interconnect], cfg.link_gbps,
                                    cfg.link_latency_us)
    ids = [torch.tensor(batch, dtype=torch.int64) for batch in doc["routing"]["eval_topk_ids"]]
    traffic = comm.measure_traffic(ids, num_experts, ep_size(cfg, num_experts),
                                   cfg.ep_tokens or cfg.tokens_per_rank)
    hidden = int(doc["layer"]["hidden"])
    results = [{**r, **comm.comm_time(link, traffic, r["dispatch"], r["combine"],
                                      hidden).as_dict()} for r in doc["results"]]
    return {**doc, "settings": cfg.as_dict(), "interconnect": link.as_dict(),
            "routing": {**doc["routing"], "ep": traffic.as_dict()}, "results": results}
