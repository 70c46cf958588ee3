"""CUDA graphs on a CUDA GPU: capture after an all-padding warm-up, replay, device-side check."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from moewire.megamoe import layout_check

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def fresh_checks():
    layout_check.reset_layout_checks()
    yield
    layout_check.reset_layout_checks()


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.int16).numpy()


def test_replay_equals_eager_and_no_host_sync_after_the_check(monkeypatch):
    sys.path.insert(0, str(HERE))
    from mm_graph import Captured

    with pytest.warns(UserWarning, match="runs inside the CUDA graph being captured"):
        cap = Captured(patch=monkeypatch.setattr)
    buf = cap.experts.get_symm_buffer()
    assert not layout_check.layout_checked(buf)
    address = cap.y.data_ptr()
    first_eager = True
    for seed in range(1, 5):
        replayed = cap.replay(seed)
        assert cap.y.data_ptr() == address
        if first_eager:
            eager = cap.eager(seed)  # the eager check runs here (one host sync) and passes
            assert layout_check.layout_checked(buf)
            first_eager = False
        else:
            eager = cap.eager(seed, no_sync=True)
        np.testing.assert_array_equal(bits(replayed), bits(eager))
        assert (bits(replayed) != 0).any()


SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {here!r})
    import torch
    from mm_graph import Captured

    cap = Captured()
    cap.replay(1)
    print("clean replay ok", flush=True)
    cap.corrupt.fill_(1.0)
    cap.replay(2)
    print("corrupted replay returned", flush=True)
    """
)


def test_a_corrupted_buffer_fails_the_replay_in_a_subprocess(tmp_path):
    script = tmp_path / "replay.py"
    script.write_text(SCRIPT.format(here=str(HERE)))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert "clean replay ok" in proc.stdout, proc.stderr
    assert "corrupted replay returned" not in proc.stdout
    assert proc.returncode != 0
    assert "device-side assert" in proc.stderr, proc.stderr[-3000:]
    assert "runs inside the CUDA graph being captured" in proc.stderr


@pytest.mark.parametrize(
    "fmt,amax", [("nvfp4", 0.5), ("fp8", 0.5), ("mxfp8", None)], ids=["nvfp4", "fp8", "mxfp8"]
)
@pytest.mark.parametrize("weighted", [False, True], ids=["weighted-rows", "fma-weights"])
@pytest.mark.parametrize("shared_slot", [None, "first", "last"], ids=["none", "first", "last"])
def test_resum_fused_kernel_equals_the_torch_path(fmt, amax, shared_slot, weighted, monkeypatch):
    from moewire import kernels
    from moewire.megamoe.resum import resum
    from moewire.quantizer import WireQuantizer

    if not kernels.available():
        pytest.skip("moewire.kernels unavailable (no Triton)")
    g = torch.Generator(device="cuda").manual_seed(0)
    k, tmax, hidden, t = 4, 48, 256, 40
    rows = torch.randn(
        k + (shared_slot is not None), tmax, hidden, device="cuda", generator=g
    ).bfloat16()
    topk = torch.randint(0, 16, (tmax, k), device="cuda", generator=g)
    topk[torch.rand(tmax, k, device="cuda", generator=g) < 0.3] = -1
    weights = torch.rand(tmax, k, device="cuda", generator=g) if weighted else None
    quantizer = WireQuantizer(fmt, constant_amax=amax).cuda()
    calls = []
    real = kernels.fused_combine
    monkeypatch.setattr(
        kernels, "fused_combine", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    fused = resum(
        rows, topk, t, shared_position=shared_slot, weights=weights, row_quantizer=quantizer
    )
    assert calls == [1]
    monkeypatch.setenv("MOEWIRE_DISABLE_KERNELS", "1")
    plain = resum(
        rows, topk, t, shared_position=shared_slot, weights=weights, row_quantizer=quantizer
    )
    assert calls == [1]
    np.testing.assert_array_equal(bits(fused), bits(plain))
