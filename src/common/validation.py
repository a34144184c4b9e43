"""A config section's rules and their errors: :class:`Section`, :func:`bounded`, and :func:`describe`, a pydantic
validation error as the one-line problem this framework prints.

Each names the dotted field, the rule it broke (a bounded field's whole rule, from its constraints: pydantic's own
message names one bound only) and the value it got, but a secret's::

    system.compression_ratio: must be in (0, 1], got 1.5
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

from src.common.bounds import BOUND_NAMES, bounds_rule


class Section(BaseModel):
    """A config section: unknown keys are errors (a typo must not fall back to a default), assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def bounded(default: Any, *, why: str | None = None, **constraints: Any) -> Any:
    """``Field(default, **constraints)`` whose error message adds ``why`` after the rule (what the bound
    means, e.g. ``0 = no warm-up``). ``allow_inf_nan=False`` among the constraints: the rule says "a finite
    number" (a lower bound alone lets infinity through). ``why`` rides in ``json_schema_extra``, pydantic's
    place for a field's own data (the JSON schema shows it too)."""
    return Field(default, json_schema_extra={"why": why} if why else None, **constraints)


_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number")
"""pydantic's error types of a broken field constraint (``gt``/``ge``/``lt``/``le``, ``allow_inf_nan=False``)."""


def _field_info(loc: tuple[Any, ...], model: Any) -> FieldInfo | None:
    """The declaration of the field an error's location names in ``model`` (dict keys and list indexes passed over)."""
    info = None
    for part in loc:
        if isinstance(part, str) and isinstance(model, type) and part in getattr(model, "model_fields", {}):
            info = model.model_fields[part]
            inner = [t for t in (info.annotation, *getattr(info.annotation, "__args__", ())) if isinstance(t, type)]
            model = next((t for t in inner if issubclass(t, BaseModel)), None)
    return info


def _bound_rule(loc: tuple[Any, ...], kind: str, model: Any) -> str:
    """The whole rule of a bounded field, from its constraints (pydantic's own error names one bound only)."""
    info = _field_info(loc, model)
    metadata = info.metadata if info is not None else []
    bounds = {name: getattr(m, name) for m in metadata for name in BOUND_NAMES if getattr(m, name, None) is not None}
    finite = any(getattr(m, "allow_inf_nan", None) is False for m in metadata)
    if not bounds or (kind == "finite_number" and not finite):
        return "must be a finite number"
    why = (info.json_schema_extra or {}).get("why") if isinstance(info.json_schema_extra, dict) else None
    return f"must be {bounds_rule(bounds, finite=finite)}" + (f" ({why})" if why else "")


def describe(error: Mapping[str, Any], model: Any, secret_fields: tuple[str, ...] = ()) -> str:
    """One pydantic error of validating ``model`` as one line: the dotted field, the rule it broke, the value (never
    one of ``secret_fields``')."""
    field = ".".join(str(part) for part in error["loc"]) or "config"
    kind = error["type"]
    context = error.get("ctx") or {}
    if kind == "extra_forbidden":
        return f"{field}: unknown key"
    if kind == "missing":
        return f"{field}: required"
    if kind == "value_error":
        rule = str(context.get("error", error["msg"]))
    elif kind in _BOUND_ERRORS:
        rule = _bound_rule(tuple(error["loc"]), kind, model)
    elif kind == "literal_error":
        rule = f"must be one of {context.get('expected', '')}"
    elif kind.startswith("int_"):
        rule = "must be an integer"
    elif kind.startswith("float_"):
        rule = "must be a number"
    elif kind.startswith("bool_"):
        rule = "must be true or false"
    elif kind.startswith("string_"):
        rule = "must be a string"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        rule = "must be a mapping"
    else:
        rule = error["msg"]
    if field in secret_fields:
        return f"{field}: {rule} (value not shown: it is a secret)"
    if not error["loc"] and kind == "value_error":
        return rule  # a rule across sections (Config's own validators): its message names the fields
    return f"{field}: {rule}, got {error.get('input')!r}"


__all__ = ["Section", "bounded", "describe"]
