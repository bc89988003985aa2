"""An OpenAI-compatible endpoint per rollout worker, so that agent code written for the ``openai``
client trains unchanged.

With ``rollout.endpoint = true`` the episode rollout role serves ``POST .../v1/chat/completions``
and ``POST .../v1/completions`` on loopback (an ephemeral port). Each episode gets its own base
URL (``http://127.0.0.1:PORT/episodes/ID/v1``) and a random API key valid for that episode alone
and only while it runs (`flowrl.episode.Policy.openai_client`). Every completion served under it
goes through the episode's `flowrl.episode.Policy`, so it is recorded into the trajectory token
in, token out, as a direct ``policy.generate`` would record it.

The OpenAI API is stateless: a client sends the whole conversation each time. A trajectory is
not: earlier turns are never tokenized again. So a request must *continue* what the episode
recorded: its messages (chat) or its prompt text or token ids (completions) must start with the
ones recorded so far, and only the rest is rendered and appended. A request whose history
differs is refused (400): its tokens could not be the ones trained on. The content returned is
the decoded text of exactly the tokens the policy generated (a stop string it generated
included), so that the history a client sends back matches.

Sampling is the recipe's: ``temperature`` and ``top_p`` must equal the recipe's or be omitted
(the trainer scores the tokens at the recipe's temperature, so tokens sampled otherwise would be
trained with wrong logprobs); one choice (``n = 1``), no streaming. ``max_tokens``
(``max_completion_tokens``) and ``stop`` apply to the request.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from flowrl.episode import EndpointAccess, EpisodeError, Policy, Turn

__all__ = ["OpenAIEndpoint"]

#: the largest request body taken (a long conversation fits; a flood does not).
MAX_BODY = 4 << 20

# Request fields: the ones served, and the ones taken but ignored (they change nothing here).
_COMMON = {"model", "max_tokens", "stop", "temperature", "top_p", "n", "stream", "user",
           "metadata", "store"}
_CHAT = _COMMON | {"messages", "max_completion_tokens"}
_COMPLETIONS = _COMMON | {"prompt"}


class _Refused(Exception):
    """A request answered with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass
class _Episode:
    policy: Policy
    key: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: what this endpoint last served: None, chat or completions (an episode uses one)
    api: Literal["chat", "completions"] | None = None
    #: the chat conversation as recorded: the requests' messages and the replies
    messages: list[dict[str, str]] = field(default_factory=list)
    #: the text of the trajectory as completions served it; None once ids were given instead
    text: str | None = ""
    #: the trajectory's length after this endpoint's last request (a change beside the
    #: endpoint shows as a difference)
    tokens: int = 0


class OpenAIEndpoint:
    """The loopback server of one rollout worker; `open` an episode to serve it."""

    def __init__(self, *, temperature: float, top_p: float = 1.0,
                 model: str = "policy", host: str = "127.0.0.1") -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.model = model
        self.host = host
        self.url = ""  # "http://host:port", once started
        self._episodes: dict[str, _Episode] = {}
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self._starting = asyncio.Lock()  # tasks run concurrently: one of them starts it

    async def start(self) -> str:
        """Listen (once: later calls return the URL)."""
        async with self._starting:
            if not self.url:
                await self._listen()
        return self.url

    async def _listen(self) -> None:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/episodes/{episode}/v1/chat/completions",
                            self._handler(self._chat))
        app.router.add_post("/episodes/{episode}/v1/completions",
                            self._handler(self._completions))
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.host, 0).start()
        except OSError:
            await self._runner.cleanup()
            self._runner = None
            raise
        self.url = f"http://{self.host}:{int(self._runner.addresses[0][1])}"

    async def aclose(self) -> None:
        self._episodes.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.url = ""

    def open(self, policy: Policy) -> EndpointAccess:
        """Serve ``policy``'s episode: its base URL and API key (until `close`)."""
        if not self.url:
            raise RuntimeError("the endpoint is not started")
        episode = f"{next(self._ids)}-{secrets.token_hex(4)}"
        key = secrets.token_urlsafe(32)
        self._episodes[episode] = _Episode(policy, key)
        return EndpointAccess(base_url=f"{self.url}/episodes/{episode}/v1", api_key=key)

    def close(self, access: EndpointAccess) -> None:
        """Stop serving an episode: its key is refused from now on."""
        episode = access.base_url.rstrip("/").split("/")[-2]
        self._episodes.pop(episode, None)

    # -- requests ------------------------------------------------------------------------------

    def _handler(
        self, serve: Callable[[_Episode, dict[str, Any]], Awaitable[dict[str, Any]]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            try:
                episode = self._authorized(request)
                try:
                    body = await request.json()
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise _Refused(400, "the request body is not JSON") from None
                if not isinstance(body, dict):
                    raise _Refused(400, "the request body must be a JSON object")
                return web.json_response(await serve(episode, body))
            except _Refused as e:
                kind = {401: "authentication_error"}.get(e.status, "invalid_request_error")
                return web.json_response({"error": {"message": str(e), "type": kind,
                                                    "param": e.param, "code": None}},
                                         status=e.status)
            except (EpisodeError, ValueError) as e:  # the episode's rules, the chat template
                return web.json_response({"error": {"message": str(e),
                                                    "type": "invalid_request_error",
                                                    "param": None, "code": None}}, status=400)

        return handle

    def _authorized(self, request: web.Request) -> _Episode:
        episode = self._episodes.get(request.match_info["episode"])
        header = request.headers.get("Authorization", "")
        given = header[len("Bearer "):] if header.startswith("Bearer ") else ""
        # One answer for an unknown (or finished) episode and a wrong key: a key opens its own
        # episode and nothing else.
        if episode is None or not hmac.compare_digest(given.encode(), episode.key.encode()):
            raise _Refused(401, "unknown episode or wrong API key: each episode has its own "
                                "base URL and key, valid while it runs")
        return episode

    def _sampling(self, body: Mapping[str, Any], allowed: set[str]
                  ) -> tuple[int | None, tuple[str, ...] | None]:
        """Checks what a request may not change; its ``max_tokens`` and ``stop``."""
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise _Refused(400, f"unsupported parameter(s) {', '.join(unknown)}: the endpoint "
                                "serves one sampled choice as the policy generates it",
                           unknown[0])
        if body.get("stream"):
            raise _Refused(400, "stream=true is not supported: ask for the whole completion "
                                "(stream=false)", "stream")
        if body.get("n", 1) != 1:
            raise _Refused(400, "n must be 1: an episode is one trajectory (the run samples "
                                "several episodes per prompt: algorithm.group_size)", "n")
        for name, want in (("temperature", self.temperature), ("top_p", self.top_p)):
            got = body.get(name)
            if got is not None and got != want:
                raise _Refused(400, f"{name} must be the recipe's rollout.{name} ({want}) or "
                                    f"omitted, got {got}: the trainer scores the tokens at the "
                                    f"recipe's sampling settings, so tokens sampled otherwise "
                                    f"would train on wrong logprobs", name)
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise _Refused(400, f"max_tokens must be a positive integer, got {limit!r}",
                           "max_tokens")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list)
                                     and all(isinstance(s, str) and s for s in stop)):
            raise _Refused(400, "stop must be a string or a list of non-empty strings", "stop")
        return limit, None if stop is None else tuple(stop)

    def _continues(self, episode: _Episode, api: Literal["chat", "completions"]) -> None:
        if episode.api not in (None, api):
            raise _Refused(400, f"this episode was served through the {episode.api} API: one "
                                "episode uses one of chat and completions")
        if len(episode.policy.token_ids) != episode.tokens:
            raise _Refused(400, "the episode's trajectory changed beside this endpoint "
                                "(policy.add or policy.generate): the endpoint cannot tell "
                                "which history it continues" + (
                                    "; give the prompt as token ids" if api == "completions"
                                    else ""))

    def _reply(self, kind: str, episode: _Episode, before: int, turn: Turn,
               choice: dict[str, Any]) -> dict[str, Any]:
        episode.tokens = len(episode.policy.token_ids)
        prompt, done = before, len(turn.token_ids)
        return {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-"
                  f"{secrets.token_hex(12)}",
            "object": kind, "created": int(time.time()), "model": self.model,
            "choices": [{"index": 0, **choice, "finish_reason": turn.finish_reason,
                         "logprobs": None}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": done,
                      "total_tokens": prompt + done},
        }

    async def _chat(self, episode: _Episode, body: dict[str, Any]) -> dict[str, Any]:
        limit, stop = self._sampling(body, _CHAT)
        messages = _messages(body.get("messages"))
        async with episode.lock:
            self._continues(episode, "chat")
            recorded = episode.messages
            for i, (got, want) in enumerate(zip(messages, recorded, strict=False)):
                if got != want:
                    raise _Refused(400, f"messages[{i}] differs from what this episode "
                                        f"recorded ({_show(want)}, got {_show(got)}): the "
                                        "history must be the one served, since earlier turns "
                                        "are never tokenized again", "messages")
            if len(messages) < len(recorded):
                raise _Refused(400, f"{len(messages)} messages, but this episode recorded "
                                    f"{len(recorded)}: send the whole conversation", "messages")
            new = messages[len(recorded):]
            if not new:
                raise _Refused(400, "no new message: the request repeats the conversation "
                                    "recorded so far", "messages")
            policy = episode.policy
            turn = await policy.generate(new, max_new_tokens=limit, stop=stop)
            episode.api = "chat"
            episode.messages = [*messages, {"role": "assistant", "content": turn.text}]
            before = len(policy.token_ids) - len(turn.token_ids)
            return self._reply("chat.completion", episode, before, turn,
                               {"message": {"role": "assistant", "content": turn.text}})

    async def _completions(self, episode: _Episode, body: dict[str, Any]) -> dict[str, Any]:
        limit, stop = self._sampling(body, _COMPLETIONS)
        prompt = _prompt(body.get("prompt"))
        async with episode.lock:
            policy = episode.policy
            if isinstance(prompt, str):
                self._continues(episode, "completions")
                recorded = episode.text
                if recorded is None:
                    raise _Refused(400, "this episode's prompts were token ids: keep giving "
                                        "token ids", "prompt")
                if not prompt.startswith(recorded):
                    at = next((i for i, (a, b) in enumerate(zip(prompt, recorded, strict=False))
                               if a != b), min(len(prompt), len(recorded)))
                    raise _Refused(400, f"the prompt differs from this episode's text at "
                                        f"character {at}: a prompt must continue the text "
                                        "served so far (earlier turns are never tokenized "
                                        "again)", "prompt")
                policy.add(prompt[len(recorded):])
                turn = await policy.generate(max_new_tokens=limit, stop=stop)
                episode.text = prompt + turn.text
            else:
                if episode.api == "chat":
                    self._continues(episode, "completions")
                context = policy.token_ids
                if prompt[:len(context)] != context:
                    at = next((i for i, (a, b) in enumerate(zip(prompt, context, strict=False))
                               if a != b), min(len(prompt), len(context)))
                    raise _Refused(400, f"the prompt's token ids differ from this episode's "
                                        f"trajectory at position {at}: a prompt must continue "
                                        "the trajectory", "prompt")
                turn = await policy.generate(token_ids=prompt[len(context):] or None,
                                             max_new_tokens=limit, stop=stop)
                episode.text = None
            episode.api = "completions"
            before = len(policy.token_ids) - len(turn.token_ids)
            return self._reply("text_completion", episode, before, turn, {"text": turn.text})


def _messages(value: object) -> list[dict[str, str]]:
    """A request's chat messages as ``{"role", "content"}`` with text content."""
    if not isinstance(value, list) or not value:
        raise _Refused(400, "messages must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise _Refused(400, f"messages[{i}] must be an object with a role", "messages")
        if msg.get("tool_calls") or msg.get("function_call"):
            raise _Refused(400, f"messages[{i}] has tool calls, which the endpoint does not "
                                "serve: write tool calls and results as message text",
                           "messages")
        content = msg.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise _Refused(400, f"messages[{i}]: only text content parts are served",
                               "messages")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _Refused(400, f"messages[{i}].content must be text", "messages")
        out.append({"role": msg["role"], "content": content})
    return out


def _prompt(value: object) -> str | list[int]:
    """A completion request's one prompt: text or token ids."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        return value
    if (isinstance(value, list) and value
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
        return list(value)
    raise _Refused(400, "prompt must be one string or one non-empty list of token ids",
                   "prompt")


def _show(message: Sequence[Any] | Mapping[str, Any]) -> str:
    text = json.dumps(message)
    return text if len(text) <= 80 else text[:77] + "..."
