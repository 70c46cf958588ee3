"""One device call: the real-kernel tier (tests/real_kernel and the transformers
integration's real-kernel tests), a full-size study, the overhead benchmark; tables last.

Run from the project root on a Hopper GPU with DeepGEMM's SM90 package on PYTHONPATH
(``bash .real-kernel/run.sh scripts/real_kernel/device_run.py``). Writes to ``$OUT``:
``tier.log`` and ``tier.xml`` (pytest), ``study.log`` and ``study_results.json`` (``moewire
study --kernel deepgemm-sm90 --model v4-flash``), ``overhead.log``, ``overhead.json`` and
``profile.json`` (the per-launch profile, and the old sequential timing beside).
Arguments: the seconds allowed to the tier, the study and the benchmark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/out"))
ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], log: Path, timeout: int) -> int:
    start = time.time()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"[{log.name}] rc={rc} in {time.time() - start:.0f}s", flush=True)
    return rc


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tier_s, study_s, bench_s = (int(a) for a in (sys.argv[1:] + ["220", "90", "150"])[:3])
    env_py = [sys.executable]
    _run(env_py + ["-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                   "-m", "real_kernel", "tests/real_kernel", "tests/hf_transformers", "-rA",
                   "--timeout", "200",
                   "-o", "junit_family=legacy",
                   f"--junitxml={OUT / 'tier.xml'}"], OUT / "tier.log", tier_s)
    _run(env_py + ["-m", "moewire.cli", "study", "--kernel", "deepgemm-sm90", "--device", "cuda",
                   "--model", "v4-flash", "--tokens", "512", "--out", "/tmp/study"],
         OUT / "study.log", study_s)
    if Path("/tmp/study/results.json").exists():
        (OUT / "study_results.json").write_text(Path("/tmp/study/results.json").read_text())
    if bench_s:
        _run(env_py + ["benchmarks/real_kernel_overhead.py", "--out", str(OUT / "overhead.json"),
                       "--profile", str(OUT / "profile.json"), "--sequential"],
             OUT / "overhead.log", bench_s)
    print("\n== tier ==")
    lines = (OUT / "tier.log").read_text().splitlines()
    passed = [ln for ln in lines if ln.startswith("PASSED")]
    print(f"{len(passed)} PASSED lines (tier.log lists them)")
    print("\n".join(ln for ln in lines if ln.startswith(("FAILED", "ERROR", "SKIPPED"))))
    print(lines[-1] if lines else "(no tier output)")
    if (OUT / "tier.xml").exists():
        for case in ET.parse(OUT / "tier.xml").iter("testcase"):
            for prop in case.iter("property"):
                print(f"  {case.get('name')}: {prop.get('name')} = {prop.get('value')}")
    print("\n== study --kernel deepgemm-sm90 --model v4-flash ==")
    print("\n".join((OUT / "study.log").read_text().splitlines()[-24:]))
    print("\n== overhead (V4-Flash layer, us per forward) ==")
    if not bench_s:
        print("(not run this time)")
    elif (OUT / "overhead.json").exists():
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from _bench import print_table
        from real_kernel_overhead import COLUMNS
        print_table(json.loads((OUT / "overhead.json").read_text())["rows"], COLUMNS)
    else:
        print("\n".join((OUT / "overhead.log").read_text().splitlines()[-30:]))


if __name__ == "__main__":
    main()
