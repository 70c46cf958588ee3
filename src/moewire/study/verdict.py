"""The budget-and-verdict rule of ``moewire study`` and ``moewire eval``: the Pareto front with
a noise tolerance, and the cheapest pair within an error budget (:func:`cheapest_within`,
the one rule both commands apply; eval passes its own cost and error, and no cost tolerance).

Cost is either the estimated dispatch + combine time (``comm_us``) or the bytes on the wire
per token (``bytes_per_token``); error is the relative L2 error of the layer output
(``rel_l2``). Two numbers closer than the noise tolerance are a tie:

- costs ``a`` and ``b`` tie when ``|a - b| <= COST_RTOL * max(a, b)``. The time model's
  bandwidths are fitted to DeepEP's published figures with residuals of a few percent
  (:mod:`moewire.study.comm`), so a time difference of 1% (0.007 us of 119 us, say) is no
  evidence that one pair is faster; bytes are exact, but the same tolerance keeps
  ``fp8`` (8 bits) and ``mxfp8`` (8.25 bits, 3% more) apart;
- errors ``a`` and ``b`` tie when ``|a - b| <= ERROR_RTOL * max(a, b)``: the error is
  measured on a few hundred held-out tokens, and a different seed moves it by a few
  percent.

A pair *dominates* another when it is no worse on both (better or tied) and strictly
better, beyond the tolerance, on at least one. The front is every pair no other pair
dominates. A tie on both axes keeps both pairs on the front (neither dominates).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

#: Relative tolerance under which two costs (us or bytes) count as equal.
COST_RTOL = 0.01
#: Relative tolerance under which two relative L2 errors count as equal.
ERROR_RTOL = 0.02
#: The cost axes: result key -> what the verdict calls it.
COSTS = {"comm_us": "estimated time", "bytes_per_token": "bytes"}
#: The result key of each cost over BF16 both ways.
_RATIO = {"comm_us": "time_ratio_to_bf16", "bytes_per_token": "ratio_to_bf16"}
#: The error metrics a budget can bound: result key -> how the verdict writes the bound.
#: SQNR is a lower bound (more is better); the others are upper bounds.
BUDGET_KINDS = {"rel_l2": "rel L2 <= {:g}", "sqnr_db": "SQNR >= {:g} dB",
                "kl_mean": "KL mean <= {:g}"}

Result = TypeVar("Result")


def _read(result: Any, key: str) -> float:
    """``result[key]`` of a study result (a dict), or ``result.key`` of an eval run
    (``moewire.eval.runner.PairResult``)."""
    return float(result[key] if isinstance(result, Mapping) else getattr(result, key))


def _tied(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def _no_worse(a: float, b: float, rtol: float) -> bool:
    return a <= b or _tied(a, b, rtol)


def _better(a: float, b: float, rtol: float) -> bool:
    return a < b and not _tied(a, b, rtol)


def dominates(p: tuple[float, float], q: tuple[float, float],
              cost_rtol: float = COST_RTOL, error_rtol: float = ERROR_RTOL) -> bool:
    """Whether ``p = (cost, error)`` dominates ``q`` under the tolerances."""
    return (_no_worse(p[0], q[0], cost_rtol) and _no_worse(p[1], q[1], error_rtol)
            and (_better(p[0], q[0], cost_rtol) or _better(p[1], q[1], error_rtol)))


def pareto(points: list[tuple[float, float, Any]], cost_rtol: float = COST_RTOL,
           error_rtol: float = ERROR_RTOL) -> list[tuple[float, float, Any]]:
    """The ``(cost, error, tag)`` points no other point dominates, sorted by cost, then
    error (ties within the tolerances count as equal, module docstring)."""
    front = [p for p in points
             if not any(dominates(q[:2], p[:2], cost_rtol, error_rtol) for q in points)]
    return sorted(front, key=lambda p: (p[0], p[1]))


def front_marks(doc: dict) -> list[str]:
    """Per result, on which front it lies: ``"time"``, ``"bytes"``, ``"time+bytes"`` or
    ``""``. A document without time columns has only the bytes front."""
    results = doc["results"]
    axes = [k for k in COSTS if k in results[0]]
    on: dict[str, set[int]] = {}
    for key in axes:
        points = [(float(r[key]), float(r["rel_l2"]), i) for i, r in enumerate(results)]
        on[key] = {i for _, _, i in pareto(points)}
    names = {"comm_us": "time", "bytes_per_token": "bytes"}
    return ["+".join(names[k] for k in axes if i in on[k]) for i in range(len(results))]


@dataclass(frozen=True)
class Budget:
    """An error budget: ``rel_l2 <= value`` (``kind="rel_l2"``), ``SQNR >= value`` dB
    (``kind="sqnr_db"``) or mean KL ``<= value`` (``kind="kl_mean"``, eval's budget)."""

    kind: str
    value: float

    def __post_init__(self) -> None:
        if self.kind not in BUDGET_KINDS:
            raise ValueError(f"Budget: kind {self.kind!r} is not one of "
                             f"{', '.join(BUDGET_KINDS)}; pick the error metric to bound")

    def admits(self, result: Any) -> bool:
        """Whether ``result`` (a dict or an object with the metric) is within the budget;
        a value on the bound is within."""
        if self.kind == "sqnr_db":
            return _read(result, "sqnr_db") >= self.value
        return _read(result, self.kind) <= self.value

    def describe(self) -> str:
        return BUDGET_KINDS[self.kind].format(self.value)


def cheapest_within(results: Iterable[Result], budget: Budget, cost: str, error: str = "rel_l2",
                    cost_rtol: float = COST_RTOL) -> Result | None:
    """The cheapest result within ``budget``: the rule of both verdicts.

    Of the results the budget admits, those whose ``cost`` ties the lowest within
    ``cost_rtol`` (module docstring) go to the lowest ``error``, then the lowest cost; among
    equals the first wins.

    Args:
        results: dicts (the study's results) or objects with the fields (eval's runs).
        budget: the error budget.
        cost: the cost field (``comm_us``, ``bytes_per_token``).
        error: the error field that breaks cost ties.
        cost_rtol: the cost tolerance; ``0.0`` compares costs exactly (eval: its bytes are
            exact, and its verdict names the fewest).

    Returns:
        The result, or ``None`` when the budget admits none.
    """
    inside = [r for r in results if budget.admits(r)]
    if not inside:
        return None
    low = min(_read(r, cost) for r in inside)
    tied = [r for r in inside if _tied(_read(r, cost), low, cost_rtol)]
    return min(tied, key=lambda r: (_read(r, error), _read(r, cost)))


def cheapest(doc: dict, budget: Budget, key: str) -> dict | None:
    """The result of ``doc`` within ``budget`` with the lowest ``key``; costs tied within
    :data:`COST_RTOL` go to the lower error. ``None`` when no pair is within it."""
    return cheapest_within(doc["results"], budget, key)


def verdict(doc: dict, budget: Budget) -> dict:
    """The answer to the budget, JSON-ready: ``budget`` and, per cost axis of the document
    (``comm_us``, ``bytes_per_token``), the cheapest pair within it or ``None``."""
    out: dict[str, Any] = {"budget": {"kind": budget.kind, "value": budget.value}}
    for key in COSTS:
        if key not in doc["results"][0]:
            continue
        best = cheapest(doc, budget, key)
        out[key] = None if best is None else {
            "dispatch": best["dispatch"], "combine": best["combine"],
            "rel_l2": best["rel_l2"], key: best[key], _RATIO[key]: best[_RATIO[key]],
            # The other pairs within the budget whose cost ties the cheapest's (COST_RTOL):
            # the tie rule, not the cost, chose between them and ``best``.
            "tied": [{"dispatch": r["dispatch"], "combine": r["combine"],
                      "rel_l2": r["rel_l2"], key: r[key]}
                     for r in doc["results"] if r is not best and budget.admits(r)
                     and _tied(float(r[key]), float(best[key]), COST_RTOL)],
        }
    return out


def _pair_text(key: str, best: dict) -> str:
    amount = (f"{float(best[key]):.1f} us" if key == "comm_us"
              else f"{float(best[key]):,.0f} bytes/token")
    return (f"dispatch {best['dispatch']} x combine {best['combine']}: {amount} "
            f"({float(best[_RATIO[key]]):.2f}x BF16), rel L2 {float(best['rel_l2']):.2e}")


def front_note() -> str:
    """What the table's ``front`` column means."""
    return (f"front: T = on the Pareto front of error vs estimated time, B = of error vs bytes "
            f"(no other pair is cheaper and more accurate; costs within {100 * COST_RTOL:g}% "
            f"and errors within {100 * ERROR_RTOL:g}% count as ties)")


def judge(doc: dict, budget: Budget | None) -> dict:
    """``doc`` with ``doc["verdict"]`` set for ``budget`` (removed for ``None``); returns it."""
    doc.pop("verdict", None)
    if budget is not None:
        doc["verdict"] = verdict(doc, budget)
    return doc


def verdict_lines(doc: dict) -> list[str]:
    """The front's legend and the verdict of ``doc["verdict"]``, as terminal lines."""
    lines = [front_note()]
    v = doc.get("verdict")
    if not v:
        return lines
    budget = Budget(v["budget"]["kind"], float(v["budget"]["value"]))
    lines.append(f"verdict for {budget.describe()}:")
    for key, name in COSTS.items():
        if key not in v:
            continue
        best = v[key]
        if best is None:
            lines.append(f"  cheapest by {name}: no pair is within the budget; loosen it")
        elif best["dispatch"] == best["combine"] == "bf16":
            lines.append(f"  cheapest by {name}: BF16 both ways (no quantized pair is within "
                         "the budget)")
        else:
            lines.append(f"  cheapest by {name}: {_pair_text(key, best)}")
            tied = list(best.get("tied", ()))
            if tied:
                shown = ", ".join(f"{o['dispatch']} x {o['combine']} (rel L2 "
                                  f"{float(o['rel_l2']):.2e})" for o in tied[:3])
                more = f" and {len(tied) - 3} more" if len(tied) > 3 else ""
                lines.append(
                    f"    tied within {100 * COST_RTOL:g}% by {name} with {shown}{more}, "
                    "also within budget; the lowest rel L2 decided")
    return lines
