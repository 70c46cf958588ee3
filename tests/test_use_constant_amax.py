"""ModelOpt's ``use_constant_amax`` in a quantizer cfg: amax pinned to 448 (FP8 E4M3 max)."""

import pytest

from moewire.quantizer import WireQuantizer
from moewire.quantizer.config import USE_CONSTANT_AMAX, CfgError, parse_cfg


@pytest.mark.parametrize(
    ("cfg", "fmt"),
    [
        ({"num_bits": (4, 3), "use_constant_amax": True}, "fp8"),
        ({"format": "nvfp4", "use_constant_amax": True}, "nvfp4"),
    ],
    ids=["fp8", "nvfp4"],
)
def test_use_constant_amax_pins_448(cfg, fmt):
    spec = parse_cfg(cfg)
    assert (spec.fmt, spec.constant_amax) == (fmt, USE_CONSTANT_AMAX) == (fmt, 448.0)
    q = WireQuantizer.from_cfg(cfg)
    assert q.has_amax and float(q.amax) == 448.0 and q.amax_source == "constant"


def test_use_constant_amax_false_changes_nothing():
    assert parse_cfg({"num_bits": (4, 3), "use_constant_amax": False}).constant_amax is None


@pytest.mark.parametrize(
    ("cfg", "key", "match"),
    [
        ({"num_bits": (4, 3), "use_constant_amax": True, "constant_amax": 10.0},
         ("use_constant_amax",), "mutually exclusive"),
        ({"format": "mxfp8", "use_constant_amax": True}, ("use_constant_amax",),
         "has no global amax"),
        ({"num_bits": (4, 3), "use_constant_amax": "yes"}, ("use_constant_amax",),
         "true or false"),
    ],
    ids=["with-constant-amax", "block-scaled-format", "not-a-bool"],
)
def test_use_constant_amax_refusals(cfg, key, match):
    with pytest.raises(CfgError, match=match) as err:
        parse_cfg(cfg)
    assert err.value.key == key
