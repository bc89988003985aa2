"""The ``data`` section: where prompts (and the answers rewards check) come from."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from flowrl.recipe.section import _PathText, _rule, _Section


class ArithmeticConfig(_Section):
    """The built-in synthetic task: prompts such as ``"12+7="`` whose exact answer is ``"19"``."""

    max_operand: int = Field(default=20, ge=1, le=10**9)
    """Operands are drawn uniformly from ``0..max_operand``."""
    count: int = Field(default=4096, ge=1, le=10**8)
    """Number of distinct prompts in the dataset."""
    seed: int = Field(default=0, ge=0)
    """Seed of the prompt generator."""


def _importable(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules (set to None)
        return False


_FILE_FIELDS = frozenset({"path", "prompt_key", "answer_key", "prompt_template"})
"""The settings of the file kinds (``jsonl``, ``parquet``)."""


class DataConfig(_Section):
    """Where prompts (and the answers the reward function checks) come from."""

    kind_fields: ClassVar[Mapping[str, frozenset[str]]] = {
        "arithmetic": frozenset({"arithmetic"}), "jsonl": _FILE_FIELDS, "parquet": _FILE_FIELDS}

    kind: Literal["arithmetic", "jsonl", "parquet"] = "arithmetic"
    """``arithmetic`` (built in, synthetic), or a ``jsonl`` / ``parquet`` file of rows."""
    path: _PathText | None = None
    """The data file; required for ``jsonl`` and ``parquet``, not allowed for ``arithmetic``."""
    prompt_key: str = Field(default="prompt", min_length=1)
    """Column holding the prompt text."""
    answer_key: str = Field(default="answer", min_length=1)
    """Column passed to the reward function as its ``answer`` keyword."""
    prompt_template: str = "{prompt}"
    """Text around each prompt of a ``jsonl`` / ``parquet`` file; ``{prompt}`` (required) is
    replaced by the row's prompt, other braces are kept as written."""
    max_prompt_tokens: int = Field(default=256, ge=1, le=1 << 20)
    """Prompts longer than this (in tokens) are dropped from the dataset."""
    chat_template: bool = False
    """Give each prompt to the model through its tokenizer's chat template (a user message,
    then the assistant's cue: ``apply_chat_template(..., add_generation_prompt=True)``); the
    model's tokenizer must have a template. ``max_prompt_tokens`` counts the template's tokens
    too."""
    system_prompt: str | None = Field(default=None, min_length=1)
    """A system message before each prompt; needs ``chat_template``."""
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    """Settings of the ``arithmetic`` task."""

    @model_validator(mode="after")
    def _kind_matches(self) -> DataConfig:
        if self.kind == "arithmetic":
            if self.path is not None:
                raise _rule("path", "not used by kind 'arithmetic'; set kind='jsonl' or 'parquet'")
        else:
            if self.path is None:
                raise _rule("path", f"required when kind is {self.kind!r}")
            if "arithmetic" in self.model_fields_set:
                raise _rule("arithmetic", f"settings given but kind is {self.kind!r}")
        if "{prompt}" not in self.prompt_template:
            raise _rule("prompt_template", "must contain {prompt} (where the prompt goes)")
        if self.kind == "arithmetic" and "prompt_template" in self.model_fields_set:
            raise _rule("prompt_template", "not used by kind 'arithmetic'")
        if self.system_prompt is not None and not self.chat_template:
            raise _rule("system_prompt", "needs chat_template = true (the system message is "
                        "part of the chat template's input)")
        if self.kind == "parquet" and not _importable("pyarrow"):
            raise _rule("kind", "'parquet' needs pyarrow: pip install 'flowrl[parquet]'")
        return self
