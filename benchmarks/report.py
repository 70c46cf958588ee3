"""Markdown tables for docs/performance.md from the JSON that gpu_check.py writes.

``python benchmarks/report.py FUSED_DIR [PEERS_DIR]``: fused-kernel times from FUSED_DIR;
the peers' times (eager, torch.compile, ModelOpt) from PEERS_DIR when given (a run with
peers), else from FUSED_DIR. Speed-ups are peer time over the fused time with the check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PEERS = ("eager_us", "compile_us", "modelopt_us")


def _cell(v, spec):
    return "-" if v is None else format(v, spec)


def table(kind: str, fused_dir: Path, peers_dir: Path) -> str:
    fused = json.loads((fused_dir / f"{kind}.json").read_text())
    peers = {(r["model"], r["T"], r["fmt"]): r for r in json.loads(
        (peers_dir / f"{kind}.json").read_text()) if "fmt" in r}
    main = "fused_check_us" if kind == "combine" else "fused_us"
    head = ["model", "T", "k", "H", "fmt", "fused us" + (" (+check)" if kind == "combine" else ""),
            "GB/s", "of copy", "copy us", "eager us", "compile us", "ModelOpt us",
            "x eager", "fused vs compile", "x ModelOpt"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in fused:
        if "fmt" not in r:
            continue
        p = peers.get((r["model"], r["T"], r["fmt"]), {})
        t = r[main]
        cells = [r["model"], r["T"], r.get("k", "-"), r["H"], r["fmt"], _cell(t, ".1f"),
                 _cell(r["bytes"] / t / 1e3, ".0f"), _cell(r["copy_us"] / t, ".2f"),
                 _cell(r["copy_us"], ".1f")]
        cells += [_cell(p.get(k), ".0f") for k in PEERS]
        cells += [_cell(p[k] / t if p.get(k) else None, ".1f") for k in PEERS]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    fused_dir = Path(sys.argv[1])
    peers_dir = Path(sys.argv[2]) if len(sys.argv) > 2 else fused_dir
    for kind in ("combine", "dispatch"):
        print(f"### {kind}\n")
        print(table(kind, fused_dir, peers_dir))
        print()


if __name__ == "__main__":
    main()
