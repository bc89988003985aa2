"""Episodes: an agent loop written as plain async Python against a small policy handle.

A recipe names an episode function (``rollout.episode = "module:fn"`` or ``"file.py:fn"``)::

    async def episode(policy: Policy, example: Example) -> float | None:
        turn = await policy.generate([{"role": "user", "content": example.prompt}])
        if "calc(" in turn.text:
            turn = await policy.generate([{"role": "tool", "content": run_calc(turn.text)}])
        policy.finish(1.0 if example.answer in turn.text else 0.0)

A rollout worker runs the episodes of its task concurrently (one per response of each prompt
group); their generation requests are batched by the engine. The episode decides when it ends
and what it scored: `Policy.finish`, or the number it returns.

Token in, token out: the policy records a `Trajectory` exactly as the policy produced it. The
ids a turn generated are stored as sampled, with their rollout logprobs and policy version, and
never decoded and encoded again (`Turn.text` is for the episode to read, nothing reads it back).
Everything inserted between turns (the environment's messages, tool results, chat-template glue)
is stored as the ids it was tokenized to once, masked out of the loss. Chat messages are
rendered with the model's chat template (`flowrl.chat_render`); text and token ids go in as
they are.

Imports only the standard library and `flowrl.chat_render`; the engine behind the handle is a
`GenerateFn` the rollout role provides.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from flowrl.chat_render import ChatRenderer, Message
from flowrl.reward_fn import RewardFnError, resolve_reward_fn

__all__ = [
    "INSERTED_VERSION",
    "EpisodeError",
    "EpisodeFn",
    "GenerateFn",
    "Generated",
    "Policy",
    "Trajectory",
    "Turn",
    "resolve_episode_fn",
    "run_episode",
]

#: the policy version recorded for an inserted token (no policy produced it)
INSERTED_VERSION = -1


class EpisodeError(RuntimeError):
    """An episode that broke the handle's rules (its message says which)."""


@dataclass(frozen=True)
class Generated:
    """What the engine returns for one generation request."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: Literal["stop", "length"]


class GenerateFn(Protocol):
    """The engine behind a policy handle: sample a continuation of ``context``.

    ``stream_key`` keys the sampling stream (the same key and weights sample the same tokens,
    whatever else shares the engine's batch); ``max_new_tokens`` and ``stop`` override the
    recipe's for this request when given."""

    def __call__(self, context: Sequence[int], *, stream_key: int,
                 max_new_tokens: int | None, stop: tuple[str, ...] | None
                 ) -> Awaitable[Generated]: ...


@dataclass(frozen=True)
class Turn:
    """One generation of the policy.

    ``token_ids`` are the ids as sampled (ending with the stop token when it stopped);
    ``text`` their decoded text without special tokens, for the episode to read."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...]
    finish_reason: Literal["stop", "length"]
    version: int


@dataclass
class Trajectory:
    """An episode as stored for training; the lists after ``prompt_ids`` are aligned per token.

    ``response_ids`` is everything after the prompt: generated turns and inserted tokens, in
    order. ``loss_mask`` is True exactly on generated tokens; ``logprobs`` holds their rollout
    logprobs (0 on inserted tokens); ``versions`` the policy version that generated each token
    (`INSERTED_VERSION` on inserted ones). ``turn_ends[k]`` is the offset in ``response_ids``
    just past turn k's last token; ``turn_rewards`` (optional) one reward per turn."""

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    reward: float | None = None
    turn_rewards: list[float] | None = None

    @property
    def turns(self) -> int:
        return len(self.turn_ends)

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def context(self) -> list[int]:
        """Every id so far: what the policy sees next."""
        return [*self.prompt_ids, *self.response_ids]


def _reward(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EpisodeError(f"{what} must be a number, got {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out):
        raise EpisodeError(f"{what} must be finite, got {out}")
    return out


class Policy:
    """The handle an episode drives: generate, insert, finish. One per episode.

    Before the first turn, what the episode adds is the prompt; after it, it is inserted (in
    the context, out of the loss)."""

    def __init__(
        self, generate: GenerateFn, tokenizer: Any, *, stream_seed: int,
        max_context: int | None = None,
    ) -> None:
        self._generate = generate
        self.tokenizer = tokenizer
        self._chat = ChatRenderer(tokenizer)
        self._seed = stream_seed
        self._max_context = max_context
        self.trajectory = Trajectory()
        #: the decoded last token of the last generated turn ("" when cut at its length), or
        #: None when the trajectory does not end with a turn: what chat glue is owed
        self._after_turn: str | None = None
        self._busy = False
        self.finished = False

    # -- what the episode calls ------------------------------------------------------------

    async def generate(
        self, messages: Sequence[Message] | None = None, *,
        token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
        stop: Sequence[str] | None = None,
    ) -> Turn:
        """Append ``messages`` (chat messages, rendered with the chat template and followed by
        the assistant's generation prompt) or ``token_ids`` (as they are), if given, and
        sample the policy's next turn from the whole trajectory.

        ``max_new_tokens`` and ``stop`` override the recipe's for this turn. The sampling
        temperature is the recipe's: the trainer scores tokens at that temperature."""
        if messages is not None and token_ids is not None:
            raise EpisodeError("give messages or token_ids, not both")
        self._check_open()
        if self._busy:
            raise EpisodeError("one generate at a time per episode: await the previous turn")
        if messages is not None:
            self._add_ids(self._render(messages, generation_prompt=True))
        elif token_ids is not None:
            self._add_ids([int(t) for t in token_ids])
        t = self.trajectory
        if not t.prompt_ids:
            raise EpisodeError("nothing to generate from: give messages or token_ids first")
        budget = max_new_tokens
        if self._max_context is not None:
            room = self._max_context - len(t.prompt_ids) - len(t.response_ids)
            if room < 1:
                raise EpisodeError(f"the trajectory fills the model's {self._max_context} "
                                   "positions: no room to generate")
            budget = room if budget is None else min(budget, room)
        self._busy = True
        try:
            out = await self._generate(
                t.context, stream_key=_turn_key(self._seed, t.turns), max_new_tokens=budget,
                stop=None if stop is None else tuple(stop))
        finally:
            self._busy = False
        n = len(out.token_ids)
        if not n or len(out.logprobs) != n or len(out.versions) != n:
            raise EpisodeError(f"the engine returned {n} tokens, {len(out.logprobs)} logprobs "
                               f"and {len(out.versions)} versions")
        t.response_ids.extend(out.token_ids)
        t.loss_mask.extend([True] * n)
        t.logprobs.extend(out.logprobs)
        t.versions.extend(out.versions)
        t.turn_ends.append(len(t.response_ids))
        last = self.tokenizer.decode([out.token_ids[-1]], skip_special_tokens=False)
        self._after_turn = last if out.finish_reason == "stop" else ""
        return Turn(
            token_ids=tuple(out.token_ids),
            text=self.tokenizer.decode(out.token_ids, skip_special_tokens=True),
            logprobs=tuple(out.logprobs), finish_reason=out.finish_reason,
            version=out.versions[-1])

    def add(self, content: str | Sequence[int], *, role: str | None = None) -> list[int]:
        """Insert without generating: text (tokenized as it is), token ids (as they are), or
        with ``role`` a chat message (rendered with the chat template, no generation prompt).
        Returns the inserted ids."""
        self._check_open()
        if role is not None:
            if not isinstance(content, str):
                raise EpisodeError("a chat message (role=...) takes text content")
            ids = self._render([{"role": role, "content": content}], generation_prompt=False)
        elif isinstance(content, str):
            ids = self._chat.encode(content)
        else:
            ids = [int(x) for x in content]
        self._add_ids(ids)
        return ids

    def finish(self, reward: float, *, per_turn: Sequence[float] | None = None) -> None:
        """End the episode with its ``reward``; ``per_turn``: one reward per generated turn
        (for estimators that credit turns; group-relative ones compare ``reward``)."""
        self._check_open()
        t = self.trajectory
        t.reward = _reward(reward, "the episode's reward")
        if per_turn is not None:
            values = [_reward(r, "a turn's reward") for r in per_turn]
            if len(values) != t.turns:
                raise EpisodeError(f"{len(values)} per-turn rewards for {t.turns} turns")
            t.turn_rewards = values
        self.finished = True

    @property
    def token_ids(self) -> list[int]:
        """The whole trajectory so far: prompt, turns and insertions."""
        return self.trajectory.context

    @property
    def turns(self) -> int:
        return self.trajectory.turns

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.finished:
            raise EpisodeError("the episode has finished")

    def _render(self, messages: Sequence[Message], *, generation_prompt: bool) -> list[int]:
        if not self.trajectory.prompt_ids:
            return self._chat.prompt(messages, generation_prompt=generation_prompt)
        return self._chat.continuation(messages, after_turn_text=self._after_turn,
                                       generation_prompt=generation_prompt)

    def _add_ids(self, ids: list[int]) -> None:
        t = self.trajectory
        if not t.turn_ends:  # before the first turn: the prompt
            t.prompt_ids.extend(ids)
        else:
            t.response_ids.extend(ids)
            t.loss_mask.extend([False] * len(ids))
            t.logprobs.extend([0.0] * len(ids))
            t.versions.extend([INSERTED_VERSION] * len(ids))
        if ids:
            self._after_turn = None


def _turn_key(seed: int, turn: int) -> int:
    # splitmix64 step: each turn of an episode samples from its own stream.
    x = (seed + 0x9E3779B97F4A7C15 * (turn + 1)) & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


EpisodeFn = Callable[..., Awaitable[Any]]
"""``async def episode(policy, example) -> float | None``."""


async def run_episode(fn: EpisodeFn, policy: Policy, example: Any) -> Trajectory:
    """Run one episode to its end; its trajectory, with its reward.

    The reward is what the episode passed to `Policy.finish`, else the number it returned.
    An episode that ends with neither, without a generated turn, or that raises, raises
    (`EpisodeError` for a broken rule; the episode's own exception otherwise)."""
    returned = await fn(policy, example)
    t = policy.trajectory
    if not t.turns:
        raise EpisodeError("the episode ended without generating a turn")
    if t.reward is None:
        if returned is None:
            raise EpisodeError("the episode ended without a reward: call policy.finish(reward) "
                               "or return a number")
        policy.finish(_reward(returned, "the episode's return value"))
    elif returned is not None and _reward(returned, "the episode's return value") != t.reward:
        raise EpisodeError(f"the episode returned {returned!r} after finishing with reward "
                           f"{t.reward}")
    return t


def resolve_episode_fn(ref: str) -> EpisodeFn:
    """The coroutine function named by ``"module:fn"`` or ``"path/file.py:fn"``, checked to
    take ``(policy, example)``; `RewardFnError` says what is wrong."""
    fn = resolve_reward_fn(ref, what="episode function")
    if not inspect.iscoroutinefunction(fn):
        raise RewardFnError(f"episode function {ref!r} is not an async function (async def)")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as e:
        raise RewardFnError(f"episode function {ref!r} cannot be called as fn(policy, example):"
                            f" {e}") from None
    except ValueError:  # no signature to check
        pass
    return fn
