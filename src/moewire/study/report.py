"""What a study leaves behind: the terminal table, ``results.json`` and two PNG plots.

- ``results.json``: the document of :func:`moewire.study.runner.run_study`, with every
  non-finite float written as the string ``"inf"`` / ``"-inf"`` / ``"nan"`` (JSON has no
  infinities; ``bf16 x bf16`` has SQNR ``"inf"``).
- ``error_heatmap.png``: two panels over dispatch (rows) x combine (columns): the SQNR (dB)
  on a fixed colour scale, each cell annotated with its SQNR and relative L2 error, and
  beside it what the pair costs over BF16 (estimated time, else bytes).
- ``frontier.png``: relative L2 error (log) against the estimated dispatch + combine time
  per layer (left) and against bytes on the wire per token (right), one labelled point per
  pair, the Pareto front (:mod:`moewire.study.verdict`: no other pair is cheaper and more
  accurate beyond the noise tolerance) ringed and drawn as a line. A pair
  with zero error (``bf16 x bf16`` on the stand-in kernel) has no place on a log axis: it is
  drawn as a marker on the bottom edge, labelled exact, never at an invented error.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from moewire.study.verdict import front_marks, pareto

if TYPE_CHECKING:
    from moewire.outputs import OutputDir

JSON_NAME = "results.json"
HEATMAP_NAME = "error_heatmap.png"
FRONTIER_NAME = "frontier.png"
#: Both plots are drawn and saved at this resolution (the label placement is in pixels).
_DPI = 120
_COLUMNS = (
    ("dispatch", "dispatch"), ("combine", "combine"), ("front", "front"), ("rel_l2", "rel L2"),
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
    """Write ``results.json`` into ``out`` atomically (``moewire.outputs.write_atomic``)."""
    from moewire.outputs import write_atomic

    return write_atomic(out / JSON_NAME, to_json(doc))


#: The table's short form of :func:`moewire.study.verdict.front_marks`.
_FRONT_CELL = {"time+bytes": "T B", "time": "T", "bytes": "B", "": ""}


def _cell(key: str, value: Any) -> str:
    if key in ("dispatch", "combine"):
        return str(value)
    if key == "front":
        return _FRONT_CELL[value]
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
    first = {**doc["results"][0], "front": ""}
    keys = [k for k, _ in _COLUMNS if k in first]
    if all(r.get("fake_quant_us") is None for r in doc["results"]):
        keys = [k for k in keys if k != "fake_quant_us"]
    return keys


def _row(doc: dict, i: int, marks: list[str]) -> dict:
    return {**doc["results"][i], "front": marks[i]}


def table_rows(doc: dict, keys: tuple[str, ...] | None = None) -> list[list[str]]:
    """The table's cells, one row per pair, in the JSON's order (``keys``: the columns;
    ``front`` is computed, :func:`moewire.study.verdict.front_marks`)."""
    keys = keys or tuple(_keys(doc))
    marks = front_marks(doc)
    return [[_cell(k, _row(doc, i, marks)[k]) for k in keys]
            for i in range(len(doc["results"]))]


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
    widths = {k: max(len(titles[k]), *(len(cell) for cell in column))
              for k, column in zip(keys, zip(*table_rows(doc, tuple(keys)), strict=True),
                                   strict=True)}
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


#: The heatmap's fixed SQNR colour scale (dB): the same colour means the same error in
#: every run. Below the bottom is as dark as the bottom, above the top as light as the top.
SQNR_SCALE_DB = (0.0, 60.0)


def heatmap_costs(doc: dict):
    """``(cost over BF16 [dispatch, combine], what it is)``: the estimated time over BF16
    both ways when the results have it (schema 2), else the bytes over BF16."""
    import numpy as np

    dispatch, combine = _axes(doc)
    by_pair = _lookup(doc)
    key, what = (("time_ratio_to_bf16", "estimated wire time / BF16")
                 if "time_ratio_to_bf16" in doc["results"][0]
                 else ("ratio_to_bf16", "bytes on the wire / BF16"))
    return np.array([[float(by_pair[d, c][key]) for c in combine] for d in dispatch]), what


def plot_heatmap(doc: dict, path: Path | IO[bytes]) -> Path | IO[bytes]:
    """Two panels over dispatch x combine: the SQNR on a fixed scale
    (:data:`SQNR_SCALE_DB`; an exact cell is grey and says so) and, beside it, what the
    pair costs over BF16 (time, else bytes) on a fixed 0-1 scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dispatch, combine = _axes(doc)
    by_pair = _lookup(doc)
    shown = heatmap_values(doc)
    costs, cost_what = heatmap_costs(doc)
    width, height = 1.5 * len(combine) + 2.0, 0.9 * len(dispatch) + 2.6
    # Side by side up to 6 combine formats; more (the default 9) stacked, so the figure
    # stays about as wide as a page.
    stacked = len(combine) > 6
    fig, (ax, cost_ax) = plt.subplots(
        2 if stacked else 1, 1 if stacked else 2, dpi=_DPI,
        figsize=(width, 2 * height) if stacked else (2 * width, height))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.92")
    bottom, top = SQNR_SCALE_DB
    image = ax.imshow(shown, cmap=cmap, vmin=bottom, vmax=top, aspect="auto")
    cost_image = cost_ax.imshow(costs, cmap=matplotlib.colormaps["cividis_r"], vmin=0.0,
                                vmax=1.0, aspect="auto")
    for a in (ax, cost_ax):
        # Rotated: the real kernels' combine names (deepgemm_fp8_combine, ...) are wider
        # than a cell and would run into each other.
        a.set_xticks(range(len(combine)), combine, rotation=30, ha="right",
                     rotation_mode="anchor")
        a.set_yticks(range(len(dispatch)), dispatch)
        a.set_xlabel("combine format")
    ax.set_ylabel("dispatch format")
    mid = (top + bottom) / 2
    for i, d in enumerate(dispatch):
        for j, c in enumerate(combine):
            r = by_pair[d, c]
            exact = shown.mask[i, j]
            text = "exact\n(no error)" if exact else f"{r['sqnr_db']:.1f} dB\n{r['rel_l2']:.1e}"
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    color="black" if exact or shown[i, j] > mid else "white")
            cost_ax.text(j, i, f"{costs[i, j]:.2f}x", ha="center", va="center", fontsize=8,
                         color="white" if costs[i, j] > 0.5 else "black")
    fig.colorbar(image, ax=ax, label=f"SQNR (dB), higher is better; fixed scale "
                 f"{bottom:g}-{top:g}", extend="both")
    fig.colorbar(cost_image, ax=cost_ax, label=f"{cost_what}, lower is cheaper")
    layer = doc["layer"]
    ax.set_title("error: layer-output SQNR (cell: dB / rel. L2)", fontsize=10)
    cost_ax.set_title(f"cost: {cost_what}", fontsize=10)
    fig.suptitle(
        f"{doc['settings']['model']}: E={layer['num_experts']} k={layer['top_k']} "
        f"H={layer['hidden']} mma={layer['mma']}, {doc['routing']['eval_tokens']} eval tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI, format="png")
    plt.close(fig)
    return path


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
    from matplotlib.transforms import blended_transform_factory

    measured, exact = frontier_points(doc, x_key)
    style = point_styles(doc)
    front = pareto(measured)
    on_front = {tag for _, _, tag in front}
    for x, y, tag in measured:
        colour, marker = style[tag]
        ax.scatter(x, y, color=colour, marker=marker, s=40 if tag in on_front else 26,
                   zorder=3, edgecolors="black" if tag in on_front else "none",
                   linewidths=0.8)
    ax.plot([p[0] for p in front], [p[1] for p in front], color="0.4", lw=1, ls="--",
            zorder=2, label="Pareto front (ringed; ties within the noise tolerance merge)")
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
    else:
        errors = [p[1] for p in measured] + [b[0] for b in [budget_rel_l2(doc)] if b]
        lo, hi = min(errors), max(errors)
        ax.set_ylim(lo / 2.5, hi * 2.5)  # room for the labels above and below
        xs = [p[0] for p in measured] + [bf16_x]
        span = (max(xs) - min(xs)) or 1.0
        ax.set_xlim(min(xs) - 0.08 * span, max(xs) + 0.08 * span)
    budget = budget_rel_l2(doc)
    if budget is not None:
        ax.axhline(budget[0], color="tab:red", ls=":", lw=1.2, zorder=1, label=budget[1])
    ax.set_xlabel(xlabel)
    ax.axvline(bf16_x, color="0.7", lw=0.8)
    ax.text(bf16_x, 0.98, "all BF16 ", fontsize=7, color="0.4", ha="right", va="top",
            transform=ax.get_xaxis_transform())
    ax.grid(True, which="both", alpha=0.3)


#: Label offsets tried around a point, in points: 16 directions at growing distances.
_LABEL_RADII = (5, 12, 20, 30, 42, 56, 72, 90, 110)
_LABEL_DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1),
                     (2, 1), (2, -1), (-2, 1), (-2, -1), (1, 2), (1, -2), (-1, 2), (-1, -2))
_ALIGN = {1: "left", 2: "left", -1: "right", -2: "right", 0: "center"}
_VALIGN = {1: "bottom", 2: "bottom", -1: "top", -2: "top", 0: "center"}


def _crosses(a: tuple, b: tuple) -> bool:
    """Whether segments ``a`` and ``b`` (``((x, y), (x, y))``) cross (touching ends do not)."""
    def side(p, q, r) -> float:
        return (q[0] - p[0]) * (r[1] - p[1]) - (q[1] - p[1]) * (r[0] - p[0])

    (p1, p2), (q1, q2) = a, b
    return (side(p1, p2, q1) * side(p1, p2, q2) < 0
            and side(q1, q2, p1) * side(q1, q2, p2) < 0)


def _hits_box(segment: tuple, box: tuple) -> bool:
    """Whether ``segment`` passes through the box ``(x0, y0, x1, y1)``."""
    (x0, y0), (x1, y1) = segment
    if any(box[0] < x < box[2] and box[1] < y < box[3] for x, y in segment):
        return True
    corners = ((box[0], box[1]), (box[2], box[1]), (box[2], box[3]), (box[0], box[3]))
    return any(_crosses(segment, (corners[i], corners[(i + 1) % 4])) for i in range(4))


def crossings(box: tuple, leader: tuple, leaders: list[tuple], labels: list[tuple]) -> int:
    """How many times a label ``box`` with its ``leader`` line crosses what is placed: the
    other leader lines it crosses, those running through its box, and the labels its own
    line runs through."""
    return (sum(_crosses(leader, other) for other in leaders)
            + sum(_hits_box(other, box) for other in leaders)
            + sum(_hits_box(leader, other) for other in labels))


def _anchor(box: tuple, px: float, py: float) -> tuple[float, float]:
    """The point of ``box`` nearest to ``(px, py)``: where a leader line meets the label."""
    return min(max(px, box[0]), box[2]), min(max(py, box[1]), box[3])


def place_labels(fig, ax, points: list[tuple[float, float, str]],
                 front: list[tuple[float, float, str]]) -> None:
    """Label each ``(x, y, tag)`` point of ``front`` (bold), with a leader line to its
    point, so that no two labels, or a label and any marker of ``points``, overlap and no
    leader line crosses another or runs through a label: each label tries offsets at
    growing distances in 16 directions and takes the first free one inside the axes (else
    the one without overlap with the fewest crossings). Call after the figure's layout is
    final (display coordinates)."""
    renderer = fig.canvas.get_renderer()
    area = ax.get_window_extent(renderer)
    pad = 4.0  # marker half-width in pixels
    taken = []
    for x, y, _ in points:
        px, py = ax.transData.transform((x, y))
        taken.append((px - pad, py - pad, px + pad, py + pad))
    labels: list[tuple] = [tuple(t.get_window_extent(renderer).extents) for t in ax.texts]
    taken += labels
    if ax.get_legend() is not None:
        taken.append(tuple(ax.get_legend().get_window_extent(renderer).extents))
    leaders: list[tuple] = []

    def overlap(box) -> float:
        total = 0.0
        for b in taken:
            w = min(box[2], b[2]) - max(box[0], b[0])
            h = min(box[3], b[3]) - max(box[1], b[1])
            total += max(w, 0.0) * max(h, 0.0)
        return total

    # Top to bottom, left to right: crowded low-error clusters get the later, freer slots.
    for x, y, tag in sorted(front, key=lambda p: (-p[1], p[0])):
        px, py = ax.transData.transform((x, y))
        ann = ax.annotate(tag, (x, y), textcoords="offset points", xytext=(5, 5),
                          fontsize=7, fontweight="bold")
        best = None
        for radius in _LABEL_RADII:
            for dx, dy in _LABEL_DIRECTIONS:
                ann.set_position((dx * radius, dy * radius))
                ann.set_horizontalalignment(_ALIGN[dx])
                ann.set_verticalalignment(_VALIGN[dy])
                box = tuple(ann.get_window_extent(renderer).extents)
                leader = ((px, py), _anchor(box, px, py))
                inside = (box[0] >= area.x0 and box[2] <= area.x1 and box[1] >= area.y0
                          and box[3] <= area.y1)
                score = (not inside, overlap(box) > 0, crossings(box, leader, leaders, labels),
                         overlap(box))
                if best is None or score < best[0]:
                    best = (score, radius, dx, dy, box, leader)
                if score == (False, False, 0, 0.0):
                    break
            if best[0] == (False, False, 0, 0.0):
                break
        _, radius, dx, dy, box, leader = best
        ann.remove()
        # Every label gets a leader line to its own point: in a cluster, nearness alone
        # would let a reader take a label for its neighbour's.
        ax.annotate(tag, (x, y), textcoords="offset points", xytext=(dx * radius, dy * radius),
                    ha=_ALIGN[dx], va=_VALIGN[dy], fontsize=7, zorder=5, fontweight="bold",
                    arrowprops=dict(arrowstyle="-", lw=0.6, color="0.45", shrinkA=0,
                                    shrinkB=2))
        taken.append(box)
        labels.append(box)
        leaders.append(leader)


def budget_rel_l2(doc: dict) -> tuple[float, str] | None:
    """The verdict's budget as a relative L2 error and its legend text, or ``None``
    (an SQNR budget of ``D`` dB is the error ``10^(-D/20)``)."""
    verdict = doc.get("verdict")
    if not verdict:
        return None
    kind, value = verdict["budget"]["kind"], float(verdict["budget"]["value"])
    if kind == "rel_l2":
        return value, f"budget: rel L2 {value:g}"
    return 10 ** (-value / 20), f"budget: SQNR {value:g} dB (rel L2 {10 ** (-value / 20):.3g})"


#: The frontier's marker of each combine format, in the order of the combine axis (``*``
#: is the exact pair's).
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "p", "h", "d", "8", "H")


def point_styles(doc: dict) -> dict[str, tuple[Any, str]]:
    """``"dispatch/combine"`` -> ``(colour, marker)``: the colour tells the dispatch format,
    the marker the combine format (both in the figure's legend)."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    dispatch_axis = list(doc["settings"]["dispatch"])
    combine_axis = list(doc["settings"]["combine"])
    return {f"{r['dispatch']}/{r['combine']}": (
        cmap(dispatch_axis.index(r["dispatch"]) % 10),
        _MARKERS[combine_axis.index(r["combine"]) % len(_MARKERS)]) for r in doc["results"]}


def frontier_figure(doc: dict):
    """The frontier as a matplotlib figure: error against estimated time (left) and
    against bytes per token (right). Every pair is a marker whose colour is its dispatch
    format and whose shape is its combine format (the legend below the panels); the pairs
    on the Pareto front are ringed and labelled, each label placed where it overlaps no
    other label, marker or line and its leader line crosses no other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    has_time = "comm_us" in results[0]
    fig, axes = plt.subplots(1, 2 if has_time else 1, figsize=(14 if has_time else 8.5, 7),
                             squeeze=False, dpi=_DPI)
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
    from matplotlib.lines import Line2D

    # One legend below the panels, where it covers no point: what the lines and the exact
    # marker are, then the dispatch colours, then the combine markers.
    handles, labels = axes[0][0].get_legend_handles_labels()
    cmap = plt.get_cmap("tab10")
    for i, d in enumerate(doc["settings"]["dispatch"]):
        handles.append(Line2D([], [], ls="", marker="o", color=cmap(i % 10)))
        labels.append(f"dispatch {d}")
    for i, c in enumerate(doc["settings"]["combine"]):
        handles.append(Line2D([], [], ls="", marker=_MARKERS[i % len(_MARKERS)], color="0.35"))
        labels.append(f"combine {c}")
    rows = math.ceil(len(handles) / 6)
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=7, frameon=False)
    fig.suptitle(f"{doc['settings']['model']}: what each dispatch/combine pair costs in error "
                 "and buys on the wire (colour: dispatch, marker: combine; the Pareto front "
                 "labelled)", fontsize=11)
    fig.tight_layout(rect=(0, 0.035 * rows + 0.01, 1, 1))
    panels = [(axes[0][-1], "bytes_per_token")] + ([(axes[0][0], "comm_us")] if has_time else [])
    for ax, x_key in panels:
        measured, _ = frontier_points(doc, x_key)
        front = pareto(measured)
        place_labels(fig, ax, measured, front)
    return fig


def plot_frontier(doc: dict, path: Path | IO[bytes]) -> Path | IO[bytes]:
    """Write :func:`frontier_figure` to ``path``."""
    import matplotlib.pyplot as plt

    fig = frontier_figure(doc)
    fig.savefig(path, dpi=_DPI, format="png")
    plt.close(fig)
    return path


#: Every file a study writes into ``--out`` (``moewire.outputs.prepare_output_dir``'s
#: ``files``: what counts as an earlier run's in a directory without a manifest).
FILES = (JSON_NAME, HEATMAP_NAME, FRONTIER_NAME)


def write_all(doc: dict, out: Path, run: OutputDir | None = None) -> dict[str, Path]:
    """Write ``results.json`` and both plots into ``out`` (created), each atomically (a
    reader or an interrupted run never sees part of a file), through ``run`` when given (the
    ``moewire.outputs.OutputDir`` of ``out``: its manifest lists each file before it is
    written and is flagged complete after the last); returns the paths."""
    import io

    from moewire.outputs import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    write = run.write if run is not None else (lambda name, data: write_atomic(out / name, data))
    paths = {"json": write(JSON_NAME, to_json(doc))}
    for key, name, plot in (("heatmap", HEATMAP_NAME, plot_heatmap),
                            ("frontier", FRONTIER_NAME, plot_frontier)):
        png = io.BytesIO()
        plot(doc, png)
        paths[key] = write(name, png.getvalue())
    if run is not None:
        run.complete()
    return paths
