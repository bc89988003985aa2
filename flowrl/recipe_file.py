"""Load a recipe file and apply ``--set key=value`` overrides.

A recipe file is Python: it either binds ``recipe = Recipe(...)`` or defines
``def build() -> Recipe``. `load_recipe` runs it (``runpy``; not as ``__main__``), applies the
overrides and re-validates.

Every failure raises `RecipeError`, whose message names the file (and the line, when the error
came from running it), the dotted field path and what is wrong, one problem per line::

    recipes/tiny_cpu.py:7: trainer.lrr: unknown field (did you mean 'lr'?)
    recipes/tiny_cpu.py: steps: must be >= 1 (got 0) (after --set steps=0)

Covered: unknown fields (with a suggestion), wrong types and bounds, missing required fields,
cross-field rules, exceptions raised while running the file, a file that defines no recipe, bad
override syntax and overrides of unknown fields. Values of the monitor token never appear.

An override that switches a section's ``kind`` (``--set data.kind=jsonl`` on a recipe with
``arithmetic`` settings) drops the recipe's settings of the other kinds, saying so in one line;
the section is then the new kind's defaults, the settings every kind shares, and the overrides.

Inputs without a sensible default (a model directory, a data file) are read with `given`::

    model_path = given("model.path", env="FLOWRL_MODEL", what="a local model directory")

which is the ``--set model.path=...`` value, else ``$FLOWRL_MODEL``, else a `RecipeError` naming
the file, the field and both ways to give it, before anything starts.

Imports nothing heavy: pydantic and the standard library (``--help`` stays instant).
"""

from __future__ import annotations

import contextvars
import difflib
import json
import os
import runpy
import traceback
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from flowrl.recipe import Recipe

__all__ = ["RecipeError", "apply_overrides", "given", "load_recipe", "parse_override"]

# Fields whose input values must never be echoed in a message.
_SECRET_FIELDS = frozenset({"monitor.token"})
_RUN_NAME = "__flowrl_recipe__"


class RecipeError(ValueError):
    """A recipe that cannot be used; ``problems`` holds (field path, what is wrong) pairs."""

    def __init__(
        self, file: str, problems: Sequence[tuple[str, str]], *, line: int | None = None,
        note: str = "",
    ) -> None:
        self.file = file
        self.line = line
        self.problems = tuple(problems)
        self.note = note
        where = f"{file}:{line}" if line is not None else file
        suffix = f" ({note})" if note else ""
        lines = [f"{where}: {field}: {msg}{suffix}" if field else f"{where}: {msg}{suffix}"
                 for field, msg in self.problems]
        super().__init__("\n".join(lines))


# ---- loading ------------------------------------------------------------------------------------

# The file being loaded and its overrides, for `given` calls made while the file runs.
_LOADING: contextvars.ContextVar[tuple[str, dict[str, Any]] | None] = contextvars.ContextVar(
    "flowrl_recipe_loading", default=None)


def load_recipe(
    path: str | Path, overrides: Sequence[str] = (), *,
    on_note: Callable[[str], None] | None = None,
) -> Recipe:
    """Run the recipe file at ``path``, apply ``overrides`` (``"a.b=value"``) and return it;
    ``on_note`` as in `apply_overrides`."""
    shown = str(path)
    file = Path(path)
    if not file.is_file():
        raise RecipeError(shown, [("", "no such recipe file")])
    parsed = [parse_override(o, file=shown) for o in overrides]
    token = _LOADING.set((shown, {".".join(k): v for k, v in parsed}))
    try:
        recipe = _run(file, shown)
    finally:
        _LOADING.reset(token)
    return apply_overrides(recipe, parsed, file=shown, on_note=on_note) if parsed else recipe


def given(field: str, *, env: str, what: str = "a value") -> str:
    """A required input of a recipe file: the ``--set <field>=...`` value, else ``$<env>``.

    Call it while the file runs under `load_recipe`; elsewhere only the environment counts.
    Raises `RecipeError` naming the file, ``field`` and both ways to give it when neither is.
    """
    loading = _LOADING.get()
    shown, overrides = loading if loading is not None else ("<recipe>", {})
    if field in overrides:
        return str(overrides[field])
    value = os.environ.get(env, "")
    if value:
        return value
    raise RecipeError(shown, [(field, f"required: {what}; give --set {field}=... or set "
                                      f"the environment variable {env}")])


def _run(file: Path, shown: str) -> Recipe:
    try:
        ns = runpy.run_path(str(file), run_name=_RUN_NAME)
        if "build" in ns and "recipe" in ns:
            raise RecipeError(shown, [("", "defines both `recipe` and `build()`; keep one")])
        if "build" in ns:
            build = ns["build"]
            if not callable(build):
                raise RecipeError(shown, [("", f"`build` is a {type(build).__name__}, "
                                                "expected a function returning a Recipe")])
            value = build()
            what = "build() returned"
        elif "recipe" in ns:
            value = ns["recipe"]
            what = "`recipe` is"
        else:
            raise RecipeError(shown, [("", "defines neither `recipe = Recipe(...)` nor "
                                           "`def build() -> Recipe`")])
    except RecipeError:
        raise
    except ValidationError as e:
        raise _from_validation(e, shown, line=_line_in(e, file)) from e
    except SyntaxError as e:
        raise RecipeError(shown, [("", f"SyntaxError: {e.msg}")], line=e.lineno) from e
    except Exception as e:
        raise RecipeError(shown, [("", f"{type(e).__name__}: {e}")], line=_line_in(e, file)) from e
    if not isinstance(value, Recipe):
        raise RecipeError(shown, [("", f"{what} a {type(value).__name__}, expected "
                                       "flowrl.recipe.Recipe")])
    return value


def _line_in(exc: BaseException, file: Path) -> int | None:
    """The line of the innermost traceback frame that belongs to the recipe file."""
    target = file.resolve()
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        try:
            if Path(frame.filename).resolve() == target:
                line = frame.lineno
        except OSError:
            continue
    return line


# ---- overrides ----------------------------------------------------------------------------------


def parse_override(text: str, *, file: str = "<overrides>") -> tuple[tuple[str, ...], Any]:
    """``"a.b=value"`` → (("a", "b"), value); the value is JSON when it parses, else a string."""
    key, sep, raw = text.partition("=")
    keys = tuple(k.strip() for k in key.split("."))
    if not sep or not all(k.isidentifier() for k in keys):
        raise RecipeError(file, [("", f"--set {text!r}: expected key=value with a dotted "
                                      "field path, e.g. trainer.lr=1e-5")])
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return keys, value


def apply_overrides(
    recipe: Recipe, overrides: Sequence[tuple[tuple[str, ...], Any]], *, file: str = "<recipe>",
    on_note: Callable[[str], None] | None = None,
) -> Recipe:
    """A new recipe with ``overrides`` (from `parse_override`) applied and validated.

    An override of a section's ``kind`` that switches it (``data.kind=jsonl`` on an
    ``arithmetic`` recipe) first drops the recipe's settings of that section's other kinds
    (`_Section.kind_fields`), so the section is the new kind's defaults plus the recipe's
    settings shared by every kind plus the overrides; ``on_note`` is told what was dropped, one
    line per section."""
    # Only fields set explicitly are carried over, so rules that ask "was this given?" (e.g. sim
    # costs with a real engine) judge the recipe as written plus the overrides.
    data = recipe.model_dump(exclude_unset=True)
    for note in _switch_kinds(recipe, data, overrides):
        if on_note is not None:
            on_note(f"{file}: {note}")
    for keys, value in overrides:
        node: dict[str, Any] = data
        for i, k in enumerate(keys[:-1]):
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                where = ".".join(keys[: i + 1])
                raise RecipeError(file, [(".".join(keys), f"{where} is a value, not a section")],
                                  note=f"--set {'.'.join(keys)}")
            node = child
        node[keys[-1]] = value
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        shown = ", ".join(_show(k, v) for k, v in overrides)
        raise _from_validation(e, file, note=f"after --set {shown}") from e


def _switch_kinds(
    recipe: Recipe, data: dict[str, Any], overrides: Sequence[tuple[tuple[str, ...], Any]],
) -> list[str]:
    """Drop from ``data`` (the recipe's set fields) the settings of the kinds a ``kind``
    override switches away from; one note per switched section."""
    notes = []
    for keys, value in overrides:
        if keys[-1] != "kind" or len(keys) < 2:
            continue
        section: Any = recipe
        for k in keys[:-1]:
            section = getattr(section, k, None)
        old_kind = getattr(section, "kind", None)
        if not isinstance(section, BaseModel) or old_kind is None or old_kind == value:
            continue
        node: Any = data
        for k in keys[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        by_kind: Mapping[str, frozenset[str]] = getattr(section, "kind_fields", {})
        keep = by_kind.get(str(value), frozenset())
        dropped = sorted(f for fields in by_kind.values() for f in fields
                         if f in node and f not in keep)
        for f in dropped:
            del node[f]
        if dropped:
            where = ".".join(keys[:-1])
            notes.append(f"--set {'.'.join(keys)}={value}: {where} switches from kind "
                         f"{old_kind!r}, dropping the recipe's "
                         f"{', '.join(f'{where}.{f}' for f in dropped)}")
    return notes


def _show(keys: tuple[str, ...], value: Any) -> str:
    path = ".".join(keys)
    if path in _SECRET_FIELDS:
        return f"{path}=***"
    return f"{path}={value if isinstance(value, str) else json.dumps(value)}"


# ---- turning a ValidationError into field paths ------------------------------------------------


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _submodel(arg)
            if found is not None:
                return found
    return None


def _section_paths() -> dict[str, tuple[type[BaseModel], tuple[str, ...]]]:
    """Model class name → (class, its field path inside a Recipe); a class found at several
    paths (`TinyModelConfig`: the policy's and the reward model's) gets none, so an error in
    one built on its own names its field, and the line, rather than a guess."""
    out: dict[str, tuple[type[BaseModel], tuple[str, ...]]] = {}

    def walk(cls: type[BaseModel], path: tuple[str, ...]) -> None:
        seen = out.setdefault(cls.__name__, (cls, path))
        if seen[1] != path:
            out[cls.__name__] = (cls, ())
        for name, info in cls.model_fields.items():
            sub = _submodel(info.annotation)
            if sub is not None:
                walk(sub, (*path, name))

    walk(Recipe, ())
    return out


def _resolve_loc(
    root: type[BaseModel] | None, prefix: tuple[str, ...], loc: tuple[int | str, ...],
) -> tuple[tuple[str, ...], type[BaseModel] | None]:
    """Field path of ``loc`` with union-member tags dropped, and the model owning its last part."""
    parts = list(prefix)
    cls = root
    owner: type[BaseModel] | None = root
    for p in loc:
        if isinstance(p, int):
            parts.append(str(p))
        elif cls is not None:
            owner = cls
            parts.append(p)
            info = cls.model_fields.get(p)
            cls = _submodel(info.annotation) if info is not None else None
        elif root is None:
            parts.append(p)
        # else: a tag naming a union member (e.g. "str", "callable"): not a field.
    return tuple(parts), owner


def _from_validation(
    e: ValidationError, file: str, *, line: int | None = None, note: str = "",
) -> RecipeError:
    sections = _section_paths()
    root, prefix = sections.get(e.title, (None, ()))
    merged: dict[str, list[str]] = {}
    for err in e.errors(include_url=False):
        path, owner = _resolve_loc(root, prefix, tuple(err["loc"]))
        kind = err["type"]
        ctx = err.get("ctx") or {}
        field = ".".join(path)
        if kind == "recipe_rule":
            field = ".".join((*path, str(ctx["field"])))
            msg = str(ctx["message"])
        elif kind == "extra_forbidden":
            msg = "unknown field"
            if owner is not None and path:
                close = difflib.get_close_matches(path[-1], list(owner.model_fields), n=1)
                if close:
                    msg += f" (did you mean {close[0]!r}?)"
        elif kind == "missing":
            msg = "required field missing"
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
            msg = msg[:1].lower() + msg[1:]
            if "input" in err and field not in _SECRET_FIELDS and kind != "value_error":
                msg += f" (got {_short(err['input'])})"
        merged.setdefault(field or "recipe", []).append(msg)
    problems = [(f, "; or ".join(dict.fromkeys(msgs))) for f, msgs in merged.items()]
    return RecipeError(file, problems, line=line, note=note)


def _short(value: Any) -> str:
    text = "a mapping" if isinstance(value, Mapping) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
