"""A prompt's text as the token ids a policy is given: plain, or through the tokenizer's chat
template (``data.chat_template``) with an optional system message (``data.system_prompt``).

With the chat template, a prompt becomes the messages ``[system?, user]`` and the ids are
exactly ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``: the ids a
chat model expects, ending with its cue for the assistant's turn. The rollout role and
``bench/task_accuracy.py`` both encode prompts here, so an offline evaluation sees what training
saw. A tokenizer without a template is refused (`NoChatTemplate`) naming the recipe field and
the file the template would be in.

Pure: the tokenizer is any object with the transformers tokenizer interface (nothing imported).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["NoChatTemplate", "check_chat_template", "encode_prompt", "prompt_messages"]


class NoChatTemplate(ValueError):
    """``data.chat_template`` is on but the tokenizer has no chat template."""

    field = "data.chat_template"

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(f"{self.field}: {detail}")


def check_chat_template(tokenizer: Any) -> None:
    """Raise `NoChatTemplate` when ``tokenizer`` has no chat template."""
    if getattr(tokenizer, "chat_template", None):
        return
    where = getattr(tokenizer, "name_or_path", "") or "the model directory"
    config = Path(where) / "tokenizer_config.json"
    raise NoChatTemplate(
        f"the tokenizer of {where} has no chat template (no "
        f"'chat_template' in {config}, no chat_template.jinja beside it); set "
        "data.chat_template = false, or use a model whose tokenizer has one")


def prompt_messages(text: str, system_prompt: str | None) -> list[dict[str, str]]:
    """The chat messages of one prompt: the system message (when given), then the user's."""
    user = {"role": "user", "content": text}
    return [user] if system_prompt is None else [{"role": "system", "content": system_prompt},
                                                 user]


def encode_prompt(tokenizer: Any, text: str, *, chat_template: bool = False,
                  system_prompt: str | None = None) -> list[int]:
    """The token ids of the prompt ``text`` (see the module docstring)."""
    if not chat_template:
        return [int(t) for t in tokenizer(text).input_ids]
    check_chat_template(tokenizer)
    ids = tokenizer.apply_chat_template(prompt_messages(text, system_prompt),
                                        add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):  # transformers >= 5: an encoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]
