"""What ``moewire eval`` prints and draws: the table and ``kl.png``.

``kl.png``: mean KL to the BF16 wire (log scale) against bytes per routed token (left) and
against the estimated wire time of one layer (right), one labelled point per run. The
baseline's KL is 0, which a log axis cannot show: it is a labelled star on the bottom edge
at its own bytes and time, never drawn at an invented KL. The budget, when given, is a
dashed horizontal line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["kl_figure", "plot", "plot_png", "table"]

_COLUMNS = (("ppl", 12), ("KL mean", 11), ("KL p99", 11), ("top-1", 8), ("bytes/tok", 11),
            ("wire us", 9))


def _task_columns(report: dict[str, Any]) -> list[tuple[str, str]]:
    """``(task, metric)`` of every score of the first run, in lm-eval's order."""
    first = report["pairs"][0].get("tasks") or {}
    return [(task, metric) for task, metrics in first.items() for metric in metrics]


def _score(result: dict[str, Any], task: str, metric: str) -> str:
    score = result.get("tasks", {}).get(task, {}).get(metric)
    if score is None:
        return "-"
    stderr = score["stderr"]
    return f"{score['value']:.4f}" + ("" if stderr is None else f"±{stderr:.4f}")


def table(report: dict[str, Any]) -> str:
    """The results as a plain-text table: one row per run, the baseline first; with tasks,
    a column per task metric, ``value±stderr`` (lm-eval's standard error)."""
    tasks = _task_columns(report)
    name_width = max(24, *(len(r["name"]) + 2 for r in report["pairs"]))
    titles = [f"{t}/{m}" for t, m in tasks]
    widths = [max(len(t), 15) + 2 for t in titles]
    head = f"{'run':<{name_width}}" + "".join(f"{h:>{w}}" for h, w in _COLUMNS)
    head += "".join(f"{t:>{w}}" for t, w in zip(titles, widths, strict=True))
    rows = [head]
    for r in report["pairs"]:
        row = (f"{r['name']:<{name_width}}{r['perplexity']:>12.4f}{r['kl_mean']:>11.3e}"
               f"{r['kl_p99']:>11.3e}{r['top1_agreement']:>8.4f}"
               f"{r['bytes_per_token']:>11.0f}{r['wire_us']:>9.1f}")
        row += "".join(f"{_score(r, t, m):>{w}}" for (t, m), w in zip(tasks, widths,
                                                                       strict=True))
        rows.append(row)
    return "\n".join(rows)


def plot_png(report: dict[str, Any]) -> bytes:
    """``kl.png`` (:func:`kl_figure`) as PNG bytes."""
    import io

    import matplotlib.pyplot as plt

    fig = kl_figure(report)
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png")
    finally:
        plt.close(fig)
    return buffer.getvalue()


def plot(report: dict[str, Any], path: Path) -> Path:
    """Write ``kl.png`` (:func:`kl_figure`) to ``path``, atomically
    (:func:`moewire.outputs.write_atomic`)."""
    from moewire.outputs import write_atomic

    return write_atomic(path, plot_png(report))


def kl_figure(report: dict[str, Any]):
    """The KL plot (module docstring) as a matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory

    results = report["pairs"]
    budget = report.get("budget", {}).get("kl")
    measured = [r for r in results if r["kl_mean"] > 0]
    exact = [r for r in results if r["kl_mean"] <= 0]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110)
    for ax, key, label in ((axes[0], "bytes_per_token", "bytes per routed token "
                            "(dispatch + combine, mean over layers)"),
                           (axes[1], "wire_us", "estimated dispatch + combine time per layer "
                            f"(us), {report['interconnect']}, EP {report['time_ep_size']}")):
        for r in measured:
            ax.scatter(r[key], r["kl_mean"], s=30, zorder=3)
            ax.annotate(r["name"], (r[key], r["kl_mean"]), textcoords="offset points",
                        xytext=(5, 5), fontsize=8)
        edge = blended_transform_factory(ax.transData, ax.transAxes)
        for r in exact:
            ax.scatter([r[key]], [0.0], transform=edge, marker="*", s=140, color="black",
                       clip_on=False, zorder=4)
            ax.annotate(f"{r['name']}: KL 0 (the reference)", (r[key], 0.0), xycoords=edge,
                        textcoords="offset points", xytext=(-9, 4), ha="right",
                        va="bottom", fontsize=8)
        ax.set_yscale("log")
        kls = [r["kl_mean"] for r in measured] + ([budget] if budget else [])
        if kls:
            ax.set_ylim(min(kls) / 3, max(kls) * 3)
        else:
            ax.set_ylim(1e-6, 1.0)
            ax.text(0.5, 0.5, "no quantized run: no KL to plot", ha="center",
                    transform=ax.transAxes, fontsize=9, color="0.4")
        if budget:
            ax.axhline(budget, color="tab:red", ls="--", lw=1,
                       label=f"budget: mean KL {budget:g}")
            ax.legend(fontsize=8, loc="upper right")
        xs = [r[key] for r in results]
        span = (max(xs) - min(xs)) or 1.0
        ax.set_xlim(min(xs) - 0.1 * span, max(xs) + 0.25 * span)
        ax.set_xlabel(label, fontsize=9)
        ax.set_ylabel("mean KL to the BF16 wire")
        ax.grid(True, which="both", alpha=0.3)
    ranks = report.get("ranks", 1)
    fig.suptitle(f"{Path(report['checkpoint']).name}: {report['tokens']} tokens, kernel "
                 f"{report['kernel']} ({report['mma_type']})"
                 + (f", {ranks} ranks" if ranks > 1 else ""), fontsize=10)
    fig.tight_layout()
    return fig
