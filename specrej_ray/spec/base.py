"""What every spec section shares: the error type and strict validation."""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationInfo,
    field_validator,
)


class SpecError(Exception):
    """A user error in a job spec; str() is one or more lines, each naming file and key."""


def _mentions(tp: Any, kinds: tuple[type, ...]) -> bool:
    """Whether an annotation (through unions and lists) takes one of `kinds`."""
    if tp in kinds:
        return True
    if get_origin(tp) in (Union, types.UnionType, list):
        return any(_mentions(arg, kinds) for arg in get_args(tp))
    return False


def _has_bool(value: Any) -> bool:
    return isinstance(value, bool) or (
        isinstance(value, list) and any(isinstance(v, bool) for v in value)
    )


def fits(value: Any, kinds: tuple[type, ...]) -> bool:
    """Does `value` have one of `kinds`, strictly as YAML gives it (a bool is no int; an int
    is a float, as in pydantic's strict mode)?"""
    for t in kinds:
        if t is bool and isinstance(value, bool):
            return True
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t is float and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if t in (str, type(None)) and isinstance(value, t):
            return True
    return False


class _Strict(BaseModel):
    # allow_inf_nan=False: `.inf`/`.nan` (or "inf") is never a meaningful setting here.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # Pydantic's lax mode reads `n: true` as 1; a boolean is only taken by bool fields.
        field = cls.model_fields.get(info.field_name or "")
        if (field is not None and _has_bool(v) and _mentions(field.annotation, (int, float))
                and not _mentions(field.annotation, (bool,))):
            raise ValueError("expected a number, not true/false")
        return v
