"""What every recipe section shares: a frozen pydantic model that forbids unknown keys,
the error a cross-field rule raises, and paths kept as text."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError


def _fspath(v: Any) -> Any:
    return os.fspath(v) if isinstance(v, os.PathLike) else v


_PathText = Annotated[str, BeforeValidator(_fspath)]
"""A filesystem path kept as text (``"tiny"`` is not a path); accepts `pathlib.Path`."""


def _non_empty_stops(v: tuple[str, ...]) -> tuple[str, ...]:
    if any(not s for s in v):
        raise ValueError("stop strings must be non-empty")
    return v


_StopStrings = Annotated[tuple[str, ...], AfterValidator(_non_empty_stops)]
"""Strings that end a generation; an empty one would end it at once."""


def _rule(field: str, message: str) -> PydanticCustomError:
    """A cross-field rule violation; ``ctx["field"]`` is the field path below the model."""
    return PydanticCustomError(
        "recipe_rule", "{field}: {message}", {"field": field, "message": message}
    )


class _Section(BaseModel):
    # hide_input_in_errors: a rejected monitor token must not appear in an error message, and
    # nested sections are reported with the outer model's setting, so every section hides input.
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_default=True,
        hide_input_in_errors=True,
        use_attribute_docstrings=True,
        coerce_numbers_to_str=True,
    )

    #: A section with a ``kind``: the fields only some kinds use, by kind. ``--set
    #: <section>.kind=...`` that switches the kind drops the recipe's fields of the other kinds
    #: (`flowrl.recipe_file.apply_overrides`).
    kind_fields: ClassVar[Mapping[str, frozenset[str]]] = {}
