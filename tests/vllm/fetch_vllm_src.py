"""Fetch the vLLM source files the released-source tests load (never committed).

For a vLLM VERSION: ``pip download vllm==VERSION --no-deps`` (or a wheel already in
``$MOEWIRE_VLLM_WHEEL_DIR``), then extract ``vllm/model_executor/layers/fused_moe/``
``deep_gemm_mega_moe.py``, ``prepare_megamoe.py`` and, where the release has them,
``eplb_triton.py`` (0.34 moved the EPLB id mapping into the staging kernel) and FlashInfer's
MoE-EP experts (0.34: ``experts/flashinfer_moe_ep.py`` and ``flashinfer_moe_ep.py``) into
DEST, each under its path below ``fused_moe/``.
Usage: python tests/vllm/fetch_vllm_src.py VERSION DEST
"""

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FILES = ("deep_gemm_mega_moe.py", "prepare_megamoe.py")
OPTIONAL = ("eplb_triton.py", "experts/flashinfer_moe_ep.py", "flashinfer_moe_ep.py")
INNER = "vllm/model_executor/layers/fused_moe/"
#: Written last; its name changes when the list of files does, so an older DEST is refilled.
DONE = ".complete-2"


def _wheel(version: str, tmp: str) -> Path:
    local = os.environ.get("MOEWIRE_VLLM_WHEEL_DIR")
    if local:
        found = sorted(Path(local).glob(f"vllm-{version}-*.whl"))
        if found:
            return found[0]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"vllm=={version}",
         "-d", tmp],
        check=True,
    )
    (wheel,) = Path(tmp).glob(f"vllm-{version}-*.whl")
    return wheel


def main(version: str, dest: Path) -> None:
    if (dest / DONE).is_file():
        return
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _wheel(version, tmp)
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            for name in FILES + OPTIONAL:
                if INNER + name in names:
                    (dest / name).parent.mkdir(parents=True, exist_ok=True)
                    (dest / name).write_bytes(archive.read(INNER + name))
                elif name in FILES:
                    raise SystemExit(f"vLLM {version}'s wheel has no {INNER + name}")
    (dest / DONE).write_text(version)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
