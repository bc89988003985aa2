"""Chat messages as token ids that continue a trajectory, without re-tokenizing what came before.

A multi-turn episode's context is one token sequence: the prompt, then each turn the policy
generated (its ids, as sampled), then what the environment said, and so on. Rendering the whole
conversation again with the chat template and tokenizing it would re-tokenize generated text,
which may not give back the ids the policy produced (decode-then-encode drift). So only the *new*
messages are rendered: `ChatRenderer.continuation` renders them after a fixed placeholder
conversation and keeps the text the template adds after it, plus whatever the template writes to
close the assistant's message that the policy did not generate itself (``"\\n"`` after an
end-of-turn token, say). Only that text is tokenized.

Works with any Hugging Face tokenizer that has a chat template; a tokenizer without one raises
`ChatTemplateError` naming the fix (pass token ids or plain text instead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ChatRenderer", "ChatTemplateError", "Message"]

Message = Mapping[str, Any]
"""A chat message as templates take it: ``{"role": ..., "content": ...}``."""

_USER = "flowrl-placeholder-user"
_ASSISTANT = "flowrl-placeholder-assistant"
_BASE: tuple[dict[str, str], ...] = (
    {"role": "user", "content": _USER},
    {"role": "assistant", "content": _ASSISTANT},
)


class ChatTemplateError(ValueError):
    """Messages that the tokenizer's chat template cannot render as a continuation."""


class ChatRenderer:
    """Renders chat messages to token ids with ``tokenizer``'s chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._base: str | None = None
        self._closing: str | None = None

    def _render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError(
                "the tokenizer has no chat template: give the episode's text or token ids "
                "(policy.generate(token_ids=...), policy.add(text)) instead of messages")
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=generation_prompt)
        if not isinstance(text, str):
            raise ChatTemplateError(f"the chat template rendered a {type(text).__name__}")
        return text

    def encode(self, text: str) -> list[int]:
        """``text`` as token ids, with no special tokens added around it."""
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False).input_ids]

    def prompt(self, messages: Sequence[Message], *, generation_prompt: bool = True) -> list[int]:
        """The ids of a conversation's start (the episode's prompt)."""
        return self.encode(self._render(messages, generation_prompt))

    def _placeholder(self) -> tuple[str, str]:
        """The placeholder conversation's text and what the template writes after the
        assistant's content (its end-of-turn marker)."""
        if self._base is None or self._closing is None:
            base = self._render(_BASE, False)
            at = base.rfind(_ASSISTANT)
            if at < 0:
                raise ChatTemplateError("the chat template drops the assistant's content")
            self._base, self._closing = base, base[at + len(_ASSISTANT):]
        return self._base, self._closing

    def continuation(
        self, messages: Sequence[Message], *, after_turn_text: str | None,
        generation_prompt: bool,
    ) -> list[int]:
        """The ids of ``messages`` appended to a conversation whose last part is a generated
        turn (``after_turn_text``: the decoded text of the turn's last token, such as the
        end-of-turn token it stopped on; ``""`` for a turn cut at its length limit) or an
        insertion (``None``: nothing of the template's closing is owed)."""
        base, closing = self._placeholder()
        full = self._render([*_BASE, *messages], generation_prompt)
        if not full.startswith(base):
            raise ChatTemplateError("the chat template renders earlier messages differently "
                                    "once more follow; it cannot continue a trajectory")
        glue = ""
        if after_turn_text is not None:
            # The template closes an assistant message with `closing`; the policy may have
            # generated the start of it (its end-of-turn token): only the rest is owed.
            glue = closing
            if after_turn_text and closing.startswith(after_turn_text):
                glue = closing[len(after_turn_text):]
        return self.encode(glue + full[len(base):])
