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

Tools: ``await policy.call_tool(name, **args)`` runs a tool the recipe names
(``rollout.tools``) outside the episode's process and returns a `ToolResult` whose ``text`` is
what to show the policy: the tool's result, or an error observation (``"error: ..."``) when the
tool raised, ran past its timeout, ran out of memory or returned something that is not JSON.
The episode inserts it like any other message (``policy.add(result.text, role="tool")``).

Limits: with ``max_turns`` or ``max_tokens`` (the recipe's ``rollout.max_turns`` and
``rollout.max_episode_tokens``; tokens after the prompt, generated and inserted), a turn
budget is cut to the tokens left, and a ``generate`` or ``add`` beyond a limit raises
`EpisodeLimitReached`. The episode may catch it and still score itself; if it lets it
propagate, or ends without a reward after it, the episode ends there with reward 0. Either
way the trajectory records which limit cut it (``Trajectory.cut``).

Imports only the standard library and `flowrl.chat_render`; the engine behind the handle is a
`GenerateFn` the rollout role provides.
"""

from __future__ import annotations

import collections
import inspect
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from flowrl.chat_render import ChatRenderer, Message
from flowrl.reward_fn import RewardFnError, resolve_reward_fn

__all__ = [
    "INSERTED_VERSION",
    "EndpointAccess",
    "EpisodeError",
    "EpisodeFn",
    "EpisodeLimitReached",
    "GenerateFn",
    "Generated",
    "Policy",
    "ToolCaller",
    "ToolResult",
    "Trajectory",
    "Turn",
    "resolve_episode_fn",
    "run_episode",
]

#: the policy version recorded for an inserted token (no policy produced it)
INSERTED_VERSION = -1


class EpisodeError(RuntimeError):
    """An episode that broke the handle's rules (its message says which)."""


Limit = Literal["turns", "tokens"]


class EpisodeLimitReached(Exception):
    """The episode reached ``rollout.max_turns`` or ``rollout.max_episode_tokens`` (``limit``
    says which): it may still score itself; if it lets this propagate it scores 0."""

    def __init__(self, limit: Limit, message: str) -> None:
        super().__init__(message)
        self.limit: Limit = limit


@dataclass(frozen=True)
class ToolResult:
    """One tool call's outcome. ``text`` is what to show the policy: the tool's result (a
    string as returned, another JSON value as JSON) or, when ``ok`` is false, ``"error: "``
    and ``error``. ``kind`` says why a call failed: ``raised``, ``timeout``, ``memory``,
    ``garbage`` (a result that is not JSON, or too long), ``crashed`` (the sandbox process
    died) or ``unknown`` (no tool of that name)."""

    ok: bool
    text: str
    error: str | None = None
    kind: str | None = None

    @classmethod
    def failed(cls, kind: str, error: str) -> ToolResult:
        return cls(ok=False, text=f"error: {error}", error=error, kind=kind)


class ToolCaller(Protocol):
    """What runs the tools behind a policy handle (`workers.tool_pool.ToolPool.call`)."""

    def __call__(self, name: str, args: dict[str, Any]) -> Awaitable[ToolResult]: ...


@dataclass(frozen=True)
class EndpointAccess:
    """Where an episode's OpenAI-compatible endpoint listens (``rollout.endpoint``): its base
    URL and the API key that opens this episode alone, while it runs."""

    base_url: str
    api_key: str = field(repr=False)


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
    #: the limit that ended the episode, if one did
    cut: Limit | None = None

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
    the context, out of the loss). ``tools`` runs `call_tool`; ``max_turns`` and
    ``max_tokens`` are the episode's limits (see the module docstring); ``max_new_tokens`` is
    a turn's budget unless the turn gives its own (the recipe's ``rollout.max_new_tokens``).
    """

    def __init__(
        self, generate: GenerateFn, tokenizer: Any, *, stream_seed: int,
        max_context: int | None = None, tools: ToolCaller | None = None,
        max_turns: int | None = None, max_tokens: int | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        self._generate = generate
        self._max_new_tokens = max_new_tokens
        self.tokenizer = tokenizer
        self._chat = ChatRenderer(tokenizer)
        self._seed = stream_seed
        self._max_context = max_context
        self._tools = tools
        self._max_turns = max_turns
        self._max_tokens = max_tokens
        #: tool calls made, and the failed ones by `ToolResult.kind`
        self.tool_calls = 0
        self.tool_errors: collections.Counter[str] = collections.Counter()
        self.trajectory = Trajectory()
        #: the decoded last token of the last generated turn ("" when cut at its length), or
        #: None when the trajectory does not end with a turn: what chat glue is owed
        self._after_turn: str | None = None
        self._busy = False
        self.finished = False
        #: the episode's OpenAI-compatible endpoint (``rollout.endpoint``); None without one
        self.endpoint: EndpointAccess | None = None

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
        if self._max_turns is not None and self.trajectory.turns >= self._max_turns:
            self._cut("turns", f"the episode reached rollout.max_turns = {self._max_turns}")
        if messages is not None:
            self._add_ids(self._render(messages, generation_prompt=True))
        elif token_ids is not None:
            self._add_ids([int(t) for t in token_ids])
        t = self.trajectory
        if not t.prompt_ids:
            raise EpisodeError("nothing to generate from: give messages or token_ids first")
        budget = self._max_new_tokens if max_new_tokens is None else max_new_tokens
        if self._max_context is not None:
            room = self._max_context - len(t.prompt_ids) - len(t.response_ids)
            if room < 1:
                raise EpisodeError(f"the trajectory fills the model's {self._max_context} "
                                   "positions: no room to generate")
            budget = room if budget is None else min(budget, room)
        if self._max_tokens is not None:
            left = self._max_tokens - len(t.response_ids)
            if left < 1:
                self._cut("tokens", "the episode reached rollout.max_episode_tokens = "
                          f"{self._max_tokens}")
            budget = left if budget is None else min(budget, left)
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

    async def call_tool(self, name: str, /, **args: Any) -> ToolResult:
        """Run the tool ``name`` with keyword ``args`` (strings, numbers, booleans, None, and
        lists and dicts of them) in the run's tool sandboxes. A tool that fails gives a failed
        `ToolResult` (counted, never raised); insert its ``text`` for the policy to see."""
        self._check_open()
        if self._tools is None:
            raise EpisodeError("this run has no tools: name them in the recipe's rollout.tools")
        result = await self._tools(name, args)
        self.tool_calls += 1
        if not result.ok:
            self.tool_errors[result.kind or "raised"] += 1
        return result

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

    def openai_client(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` client of this episode's endpoint: every completion it
        asks for is a turn of this episode (``rollout.endpoint = true``; the ``openai``
        package). It does not retry: a retried request would be a turn of its own."""
        access = self._endpoint()
        try:
            import openai
        except ImportError:
            raise EpisodeError("policy.openai_client() needs the openai package "
                               "(pip install openai)") from None
        return openai.AsyncOpenAI(**{"max_retries": 0, **kwargs, "base_url": access.base_url,
                                     "api_key": access.api_key})

    @property
    def openai_base_url(self) -> str:
        """The base URL of this episode's OpenAI-compatible endpoint (``rollout.endpoint``)."""
        return self._endpoint().base_url

    @property
    def api_key(self) -> str:
        """The API key of this episode's endpoint, valid while the episode runs."""
        return self._endpoint().api_key

    @property
    def token_ids(self) -> list[int]:
        """The whole trajectory so far: prompt, turns and insertions."""
        return self.trajectory.context

    @property
    def turns(self) -> int:
        return self.trajectory.turns

    # -- internals ---------------------------------------------------------------------------

    def _endpoint(self) -> EndpointAccess:
        if self.endpoint is None:
            raise EpisodeError("this episode has no OpenAI-compatible endpoint: set "
                               "rollout.endpoint = true in the recipe")
        return self.endpoint

    def _check_open(self) -> None:
        if self.finished:
            raise EpisodeError("the episode has finished")

    def _render(self, messages: Sequence[Message], *, generation_prompt: bool) -> list[int]:
        if not self.trajectory.prompt_ids:
            return self._chat.prompt(messages, generation_prompt=generation_prompt)
        return self._chat.continuation(messages, after_turn_text=self._after_turn,
                                       generation_prompt=generation_prompt)

    def _cut(self, limit: Limit, message: str) -> None:
        if self.trajectory.cut is None:
            self.trajectory.cut = limit
        raise EpisodeLimitReached(limit, message)

    def _add_ids(self, ids: list[int]) -> None:
        t = self.trajectory
        if not t.turn_ends:  # before the first turn: the prompt
            t.prompt_ids.extend(ids)
        else:
            if self._max_tokens is not None and len(t.response_ids) + len(ids) > self._max_tokens:
                self._cut("tokens", f"inserting {len(ids)} tokens would exceed "
                          f"rollout.max_episode_tokens = {self._max_tokens}")
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

    The reward is what the episode passed to `Policy.finish`, else the number it returned;
    0 for an episode cut by a limit (`EpisodeLimitReached`) that gives neither. An episode that
    ends with neither otherwise, without a generated turn, or that raises, raises
    (`EpisodeError` for a broken rule; the episode's own exception otherwise)."""
    try:
        returned = await fn(policy, example)
    except EpisodeLimitReached:
        if policy.trajectory.cut is None:  # not this policy's limit: the episode's own error
            raise
        returned = None
    t = policy.trajectory
    if not t.turns:
        raise EpisodeError("the episode ended without generating a turn")
    if t.reward is None and returned is None and t.cut is not None:
        policy.finish(0.0)
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
