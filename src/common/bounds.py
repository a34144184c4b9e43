"""Numeric bounds in pydantic's words (``gt``, ``ge``, ``lt``, ``le``): whether a value keeps them, and the
rule an error message states for them.

One vocabulary for the two places that declare bounds: the config's field constraints
(:mod:`src.config`) and the controller's settings (:mod:`src.adaptive.settings`, which the config's
``system.controller_*`` fields are built from), so both state a broken bound in the same words.
"""

from __future__ import annotations

import operator
from typing import Mapping

BOUND_NAMES = ("gt", "ge", "lt", "le")
_KEEPS = {"gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le}
_SYMBOLS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def within(value: float, bounds: Mapping[str, float]) -> bool:
    """Whether ``value`` keeps every bound (NaN keeps none)."""
    return all(_KEEPS[name](value, bound) for name, bound in bounds.items())


def bounds_rule(bounds: Mapping[str, float], *, finite: bool = False) -> str:
    """The rule after "must be": ``{"gt": 0, "le": 1}`` -> ``in (0, 1]``, ``{"ge": 0}`` -> ``>= 0``
    (``a finite number >= 0`` with ``finite``: a one-sided bound alone lets infinity through)."""
    low = ("(", bounds["gt"]) if "gt" in bounds else ("[", bounds["ge"]) if "ge" in bounds else None
    high = (")", bounds["lt"]) if "lt" in bounds else ("]", bounds["le"]) if "le" in bounds else None
    if low and high:
        return f"in {low[0]}{low[1]:g}, {high[1]:g}{high[0]}"
    name = next(name for name in BOUND_NAMES if name in bounds)
    return f"{'a finite number ' if finite else ''}{_SYMBOLS[name]} {bounds[name]:g}"
