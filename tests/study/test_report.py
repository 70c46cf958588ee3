"""The report helpers: strict JSON with infinities, the Pareto frontier, the plain table."""

import json
import math

import pytest

from moewire.study.report import decode_float, pareto, plain_table, to_json


def test_infinities_become_strings_and_read_back():
    doc = {"a": math.inf, "b": [-math.inf, 1.5], "c": {"d": math.nan}, "e": 2}
    text = to_json(doc)
    back = json.loads(text)
    assert back == {"a": "inf", "b": ["-inf", 1.5], "c": {"d": "nan"}, "e": 2}
    assert decode_float(back["a"]) == math.inf and decode_float(back["b"][1]) == 1.5


@pytest.mark.parametrize(
    "points, want",
    [
        ([(1, 5, "a"), (2, 3, "b"), (3, 4, "c"), (4, 1, "d")], ["a", "b", "d"]),
        ([(1, 1, "a"), (2, 2, "b"), (3, 3, "c")], ["a"]),
        ([(3, 1, "c"), (1, 3, "a"), (2, 2, "b")], ["a", "b", "c"]),
        ([(1, 2, "a"), (1, 1, "b"), (2, 1, "c")], ["b"]),
    ],
    ids=["mixed", "one-dominates", "unsorted-all-on-front", "ties"],
)
def test_pareto(points, want):
    assert [tag for _, _, tag in pareto(points)] == want


def test_plain_table_has_one_line_per_pair():
    row = {"dispatch": "bf16", "combine": "fp8", "rel_l2": 0.01, "sqnr_db": 40.0,
           "cosine": 0.99995, "max_abs_err": 0.5, "bytes_per_token": 73728.0,
           "ratio_to_bf16": 0.75}
    base = {**row, "combine": "bf16", "rel_l2": 0.0, "sqnr_db": math.inf, "cosine": 1.0,
            "max_abs_err": 0.0, "bytes_per_token": 98304.0, "ratio_to_bf16": 1.0}
    lines = plain_table({"results": [base, row]}).splitlines()
    assert len(lines) == 4
    assert "inf" in lines[2] and "73,728" in lines[3] and "0.750" in lines[3]
