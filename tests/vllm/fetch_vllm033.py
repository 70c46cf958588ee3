"""Fetch the two vLLM 0.33.0 source files the 0.33 tests load (never committed).

``pip download vllm==0.33.0 --no-deps`` then extract
``vllm/model_executor/layers/fused_moe/{deep_gemm_mega_moe,prepare_megamoe}.py`` into DEST.
Usage: python tests/vllm/fetch_vllm033.py DEST
"""

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FILES = ("deep_gemm_mega_moe.py", "prepare_megamoe.py")
INNER = "vllm/model_executor/layers/fused_moe/"


def main(dest: Path) -> None:
    if all((dest / name).is_file() for name in FILES):
        return
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "vllm==0.33.0",
             "-d", tmp],
            check=True,
        )
        (wheel,) = Path(tmp).glob("vllm-0.33.0-*.whl")
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as archive:
            for name in FILES:
                (dest / name).write_bytes(archive.read(INNER + name))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
