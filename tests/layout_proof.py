"""What a test of a fused shared expert on ordinary rows can say about the layout check."""

from __future__ import annotations

from typing import Any

from moewire.megamoe import layout_check


def slots_proven(symm_buffer: Any) -> bool:
    """The layout check passed and ruled out every other stored slot of the shared row: the
    buffer is marked checked, or the only reading left open is the shared row at the other
    end of the sum. Ordinary rows sum exactly in FP32 in any order, so they cannot show that
    one (the check keeps checking later batches until one does);
    ``tests/megamoe/test_megamoe_shared_order.py`` proves the order on rows that show it."""
    if layout_check.layout_checked(symm_buffer):
        return True
    readings = layout_check.unproven_readings(symm_buffer)
    return bool(readings) and all(r.startswith("shared row added ") for r in readings)
