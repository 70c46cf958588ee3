"""What a study leaves behind: the terminal table, ``results.json`` and two PNG plots.

- ``results.json``: the document of :func:`moewire.study.runner.run_study`, with every
  non-finite float written as the string ``"inf"`` / ``"-inf"`` / ``"nan"`` (JSON has no
  infinities; ``bf16 x bf16`` has SQNR ``"inf"``).
- ``error_heatmap.png``: SQNR (dB) over dispatch (rows) x combine (columns), each cell
  annotated with its SQNR and relative L2 error.
- ``frontier.png``: relative L2 error (log) against the estimated dispatch + combine time
  per layer (left) and against bytes on the wire per token (right), one point per pair, the
  Pareto frontier (no other pair is both cheaper and more accurate) drawn as a line. A pair
  with zero error (``bf16 x bf16`` on the stand-in kernel) has no place on a log axis: it is
  drawn as a marker on the bottom edge, labelled exact, never at an invented error.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

JSON_NAME = "results.json"
HEATMAP_NAME = "error_heatmap.png"
FRONTIER_NAME = "frontier.png"
_COLUMNS = (
    ("dispatch", "dispatch"), ("combine", "combine"), ("rel_l2", "rel L2"),
    ("sqnr_db", "SQNR dB"), ("cosine", "cosine"), ("max_abs_err", "max |err|"),
    ("bytes_per_token", "bytes/token"), ("ratio_to_bf16", "vs BF16"),
    ("dispatch_us", "disp us"), ("combine_us", "comb us"), ("comm_us", "comm us"),
    ("saved_us", "saved us"), ("time_ratio_to_bf16", "time/BF16"), ("fake_quant_us", "QDQ us"),
)


def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def decode_float(value: float | str) -> float:
    """A metric read back from ``results.json`` (``"inf"`` -> ``math.inf``)."""
    return float(value)


def to_json(doc: dict) -> str:
    """``doc`` as strict JSON (non-finite floats as strings), indented, sorted keys."""
    return json.dumps(_encode(doc), indent=2, sort_keys=True, allow_nan=False) + "\n"


def write_json(doc: dict, out: Path) -> Path:
    path = out / JSON_NAME
    path.write_text(to_json(doc))
    return path


def _cell(key: str, value: Any) -> str:
    if key in ("dispatch", "combine"):
        return str(value)
    if key == "sqnr_db":
        return "inf" if value == math.inf else f"{value:.2f}"
    if key == "cosine":
        return f"{value:.6f}"
    if key == "bytes_per_token":
        return f"{value:,.0f}"
    if key in ("ratio_to_bf16", "time_ratio_to_bf16"):
        return f"{value:.3f}"
    if key in ("dispatch_us", "combine_us", "comm_us", "saved_us"):
        return f"{value:.1f}"
    if key == "fake_quant_us":
        return "-" if value is None else f"{value:.1f}"
    return f"{value:.3e}"


#: Columns the terminal table leaves out first when it is too narrow (all are in the JSON).
_DROP_ORDER = ("cosine", "dispatch_us", "combine_us", "max_abs_err", "saved_us",
               "ratio_to_bf16", "fake_quant_us", "bytes_per_token", "sqnr_db")


def _keys(doc: dict) -> list[str]:
    """Every column of this document: the time columns only where the results have them
    (a results.json of schema 1 has none), the QDQ column only where it was measured."""
    first = doc["results"][0]
    keys = [k for k, _ in _COLUMNS if k in first]
    if all(r.get("fake_quant_us") is None for r in doc["results"]):
        keys = [k for k in keys if k != "fake_quant_us"]
    return keys


def table_rows(doc: dict, keys: tuple[str, ...] | None = None) -> list[list[str]]:
    """The table's cells, one row per pair, in the JSON's order (``keys``: the columns)."""
    keys = keys or tuple(_keys(doc))
    return [[_cell(k, r[k]) for k in keys] for r in doc["results"]]


def table_columns(doc: dict, width: int | None, overhead: int = 2) -> tuple[str, ...]:
    """The column keys that fit in ``width`` characters (``None``: all of them).

    Each column takes its widest cell plus ``overhead`` (2 spaces for the plain table, 3
    for rich's borders and padding). Columns of :data:`_DROP_ORDER` go first, in order;
    dispatch, combine, rel L2 and the estimated time (comm us, time/BF16) always stay.
    """
    keys = _keys(doc)
    if width is None:
        return tuple(keys)
    titles = dict(_COLUMNS)
    widths = {k: max(len(titles[k]), *(len(_cell(k, r[k])) for r in doc["results"]))
              for k in keys}
    for drop in (None, *_DROP_ORDER):
        if drop is not None and drop in keys:
            keys.remove(drop)
        if sum(widths[k] + overhead for k in keys) + 1 <= width:
            break
    return tuple(keys)


def _left_out(doc: dict, keys: tuple[str, ...]) -> str:
    titles = dict(_COLUMNS)
    gone = [titles[k] for k in _keys(doc) if k not in keys]
    if not gone:
        return ""
    return (f"(left out to fit the terminal: {', '.join(gone)}; all columns are in "
            "results.json)")


def headline(doc: dict) -> str:
    """One line that says what was measured."""
    layer, s, routing = doc["layer"], doc["settings"], doc["routing"]
    return (
        f"moewire study: model {s['model']} ({layer['preset']['description']}); "
        f"E={layer['num_experts']} k={layer['top_k']} H={layer['hidden']} "
        f"I={layer['intermediate']} shared I={layer['shared_intermediate']} "
        f"mma={layer['mma']}; weights {layer['weights']}; "
        f"{routing['eval_tokens']} eval tokens, {routing['calib_tokens']} calibration "
        f"tokens, {s['ranks']} rank(s), seed {s['seed']}"
    )


def time_note(doc: dict, width: int = 100) -> str:
    """What the time columns assume and leave out, one paragraph wrapped to ``width``."""
    link, ep = doc["interconnect"], doc["routing"]["ep"]
    return textwrap.fill(
        f"time estimate: {link['name']} ({link['description']}; {link['source']}), EP "
        f"{ep['ep_size']}, {ep['tokens_per_rank']} tokens per rank per layer, "
        f"{100 * ep['remote_fraction']:.1f}% of copies leave their rank and the busiest rank "
        f"moves {ep['bottleneck']:.2f}x the mean (measured on this routing). Wire time only: "
        "it leaves out overlap with compute, congestion, the format's cast (QDQ us, measured "
        "on CUDA) and per-token metadata (docs/study.md).", width)


def plain_table(doc: dict, width: int | None = None) -> str:
    """The results as fixed-width text (for logs and non-TTY output).

    Args:
        doc: the results document.
        width: the characters available (a terminal's columns); columns are left out to
            fit (:func:`table_columns`) and a last line names them. ``None``: every column.
    """
    keys = table_columns(doc, width)
    titles = dict(_COLUMNS)
    header = [titles[k] for k in keys]
    rows = table_rows(doc, keys)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    note = _left_out(doc, keys)
    if note:
        lines += textwrap.wrap(note, width) if width else [note]
    return "\n".join(lines)


def rich_table(doc: dict, width: int | None = None):
    """The results as a ``rich.table.Table``; the baseline row and column are dimmed.

    ``width``: the console's width; columns are left out to fit, named in the caption.
    """
    from rich.table import Table

    keys = table_columns(doc, width, overhead=3)
    titles = dict(_COLUMNS)
    table = Table(title="dispatch x combine: layer output vs the unquantized layer",
                  caption=_left_out(doc, keys) or None)
    for key in keys:
        table.add_column(titles[key], no_wrap=True,
                         justify="left" if key in ("dispatch", "combine") else "right")
    for result, row in zip(doc["results"], table_rows(doc, keys), strict=True):
        baseline = result["dispatch"] == "bf16" and result["combine"] == "bf16"
        table.add_row(*row, style="dim" if baseline else None)
    return table


def _axes(doc: dict) -> tuple[list[str], list[str]]:
    return list(doc["settings"]["dispatch"]), list(doc["settings"]["combine"])


def _lookup(doc: dict) -> dict[tuple[str, str], dict]:
    return {(r["dispatch"], r["combine"]): r for r in doc["results"]}


def heatmap_values(doc: dict):
    """SQNR (dB) ``[dispatch, combine]`` as a numpy masked array; exact pairs (infinite
    SQNR, zero error) are masked: no colour of the scale, which is for measured errors."""
    import numpy as np

    dispatch, combine = _axes(doc)
    by_pair = _lookup(doc)
    sqnr = np.array([[decode_float(by_pair[d, c]["sqnr_db"]) for c in combine]
                     for d in dispatch], float)
    return np.ma.masked_where(~np.isfinite(sqnr), sqnr)


def plot_heatmap(doc: dict, path: Path) -> Path:
    """SQNR heatmap over dispatch x combine; an exact cell is grey and says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dispatch, combine = _axes(doc)
    by_pair = _lookup(doc)
    shown = heatmap_values(doc)
    measured = shown.compressed()
    top = float(measured.max()) if measured.size else 1.0
    bottom = float(measured.min()) if measured.size else 0.0
    fig, ax = plt.subplots(figsize=(1.6 * len(combine) + 2.5, 0.9 * len(dispatch) + 2.0))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.92")
    image = ax.imshow(shown, cmap=cmap, vmin=bottom, vmax=top, aspect="auto")
    ax.set_xticks(range(len(combine)), combine)
    ax.set_yticks(range(len(dispatch)), dispatch)
    ax.set_xlabel("combine format")
    ax.set_ylabel("dispatch format")
    mid = (top + bottom) / 2
    for i, d in enumerate(dispatch):
        for j, c in enumerate(combine):
            r = by_pair[d, c]
            exact = shown.mask[i, j]
            text = "exact\n(no error)" if exact else f"{r['sqnr_db']:.1f} dB\n{r['rel_l2']:.1e}"
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    color="black" if exact or shown[i, j] > mid else "white")
    fig.colorbar(image, ax=ax, label="SQNR (dB), higher is better")
    layer = doc["layer"]
    ax.set_title(
        f"{doc['settings']['model']}: layer-output SQNR (cell: dB / rel. L2)\n"
        f"E={layer['num_experts']} k={layer['top_k']} H={layer['hidden']} "
        f"mma={layer['mma']}, {doc['routing']['eval_tokens']} eval tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def pareto(points: list[tuple[float, float, Any]]) -> list[tuple[float, float, Any]]:
    """The points no other point beats on both cost (x) and error (y), sorted by cost.

    A point is kept when its error is strictly lower than every cheaper-or-equal point's.
    """
    front, best = [], math.inf
    for x, y, tag in sorted(points, key=lambda p: (p[0], p[1])):
        if y < best:
            front.append((x, y, tag))
            best = y
    return front


def frontier_points(doc: dict, x_key: str) -> tuple[list[tuple[float, float, str]],
                                                     list[tuple[float, str]]]:
    """The frontier plot's data: ``(measured, exact)``.

    ``measured``: ``(x, rel_l2, "dispatch/combine")`` of every pair with a non-zero error;
    ``exact``: ``(x, "dispatch/combine")`` of the pairs with zero error, which a log axis
    cannot show at any height (they are drawn on the bottom edge, labelled exact).
    """
    measured, exact = [], []
    for r in doc["results"]:
        tag = f"{r['dispatch']}/{r['combine']}"
        if r["rel_l2"] > 0:
            measured.append((float(r[x_key]), float(r["rel_l2"]), tag))
        else:
            exact.append((float(r[x_key]), tag))
    return measured, exact


def _frontier_panel(ax, doc: dict, x_key: str, xlabel: str, bf16_x: float) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory

    dispatch_axis = list(doc["settings"]["dispatch"])
    cmap = plt.get_cmap("tab10")
    measured, exact = frontier_points(doc, x_key)
    colour = {f"{r['dispatch']}/{r['combine']}": cmap(dispatch_axis.index(r["dispatch"]) % 10)
              for r in doc["results"]}
    for x, y, tag in measured:
        ax.scatter(x, y, color=colour[tag], s=28, zorder=3)
    front = pareto(measured)
    ax.plot([p[0] for p in front], [p[1] for p in front], color="0.4", lw=1, ls="--",
            zorder=2, label="Pareto frontier (measured pairs)")
    for x, y, tag in front:
        ax.annotate(tag, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    # Exact pairs: on the bottom edge (axes coordinates), not at an error they do not have.
    edge = blended_transform_factory(ax.transData, ax.transAxes)
    for x, tag in exact:
        ax.scatter([x], [0.0], transform=edge, marker="*", s=120, color="black",
                   clip_on=False, zorder=4, label=f"{tag}: exact (zero error)")
        ax.annotate(f"{tag}: exact", (x, 0.0), xycoords=edge, textcoords="offset points",
                    xytext=(-3, 12), ha="right", va="bottom", rotation=90, fontsize=7)
    ax.set_yscale("log")
    if not measured:  # only exact pairs (e.g. --dispatch bf16 --combine bf16)
        ax.set_ylim(1e-4, 1.0)
        ax.text(0.5, 0.5, "no quantized pair: no error to plot", ha="center",
                transform=ax.transAxes, fontsize=9, color="0.4")
    ax.set_xlabel(xlabel)
    ax.axvline(bf16_x, color="0.7", lw=0.8)
    ax.text(bf16_x, 0.98, "all BF16 ", fontsize=7, color="0.4", ha="right", va="top",
            transform=ax.get_xaxis_transform())
    ax.grid(True, which="both", alpha=0.3)


def frontier_figure(doc: dict):
    """The frontier as a matplotlib figure: error against estimated time (left) and
    against bytes per token (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    has_time = "comm_us" in results[0]
    fig, axes = plt.subplots(1, 2 if has_time else 1, figsize=(14 if has_time else 8.5, 5.5),
                             squeeze=False)
    bytes_ax = axes[0][-1]
    bf16_bytes = next(r["bytes_per_token"] / r["ratio_to_bf16"] for r in results)
    _frontier_panel(bytes_ax, doc, "bytes_per_token",
                    "bytes on the wire per token (dispatch + combine, top-k copies)", bf16_bytes)
    bytes_ax.set_title("error vs wire bytes", fontsize=10)
    axes[0][0].set_ylabel("relative L2 error of the layer output")
    if has_time:
        link, ep = doc["interconnect"], doc["routing"]["ep"]
        _frontier_panel(axes[0][0], doc, "comm_us",
                        f"estimated dispatch + combine time per layer (us), {link['name']}, "
                        f"EP {ep['ep_size']}, {ep['tokens_per_rank']} tokens/rank",
                        results[0]["bf16_comm_us"])
        axes[0][0].set_title("error vs estimated wire time (no overlap with compute, no "
                             "congestion: docs/study.md)", fontsize=10)
    dispatch_axis = list(doc["settings"]["dispatch"])
    cmap = plt.get_cmap("tab10")
    for i, d in enumerate(dispatch_axis):
        axes[0][0].scatter([], [], color=cmap(i % 10), s=28, label=f"dispatch {d}")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"{doc['settings']['model']}: what each dispatch/combine pair costs in error "
                 "and buys on the wire", fontsize=11)
    fig.tight_layout()
    return fig


def plot_frontier(doc: dict, path: Path) -> Path:
    """Write :func:`frontier_figure` to ``path``."""
    import matplotlib.pyplot as plt

    fig = frontier_figure(doc)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_all(doc: dict, out: Path) -> dict[str, Path]:
    """Write ``results.json`` and both plots into ``out`` (created); returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    return {
        "json": write_json(doc, out),
        "heatmap": plot_heatmap(doc, out / HEATMAP_NAME),
        "frontier": plot_frontier(doc, out / FRONTIER_NAME),
    }
