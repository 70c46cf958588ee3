"""The names ``moewire.megamoe.wrapper`` held before it was split by job.

Kept so that code importing them and models pickled before the split
(``torch.save(model)`` records ``moewire.megamoe.wrapper._rebuild_quant``) keep working.
Each name lives in the module named for its job: ``convert`` (the ``Quant<Cls>`` classes),
``hooks`` (the namespace hooks), ``layout_check`` (the check's state), ``quant_experts``
(the mixin). New code imports from there.
"""

from __future__ import annotations

from moewire.megamoe.convert import _rebuild_quant, convert, is_converted
from moewire.megamoe.hooks import install_proxies
from moewire.megamoe.layout_check import layout_checked, reset_layout_checks
from moewire.megamoe.quant_experts import (
    FUSION_SWITCH,
    QuantExperts,
    amax_rows,
    kernel_rows,
    set_amax_rows,
    set_module_name,
)

__all__ = [
    "FUSION_SWITCH",
    "QuantExperts",
    "_rebuild_quant",
    "amax_rows",
    "convert",
    "install_proxies",
    "is_converted",
    "kernel_rows",
    "layout_checked",
    "reset_layout_checks",
    "set_amax_rows",
    "set_module_name",
]
