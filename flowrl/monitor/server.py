"""The controller's HTTP monitor: status JSON, Prometheus metrics, an event stream, a trace
export, a live dashboard, and a few token-guarded control actions.

Endpoints (all in the controller's own event loop; every handler is O(snapshot), none blocks):

- ``GET /`` — the dashboard (static files shipped in this package; no network access needed);
- ``GET /status`` — exactly the run's `status()` (`flowrl.monitor.view.RunView`) as JSON;
- ``GET /metrics`` — Prometheus text exposition (`flowrl.monitor.metrics`);
- ``GET /events`` — Server-Sent Events, one per controller event, ``id:`` = its ``seq``.
  ``Last-Event-ID`` (or ``?last_id=N``) first replays the kept events after ``N``;
- ``GET /trace[?window=S][&after=US]`` — Chrome trace-event JSON of the kept spans that ended
  in the last ``S`` seconds and after ``US`` (a ``ts`` in microseconds, e.g. the previous
  answer's ``otherData.now_us``, so a poller fetches only what is new);
- ``POST /pause``, ``POST /resume``, ``POST /stop``, ``POST /staleness`` (JSON
  ``{"max_staleness": n}``) — require ``Authorization: Bearer <token>``; 401 without it.

Security. The token comes from the recipe (``monitor.token``) or is generated at start with
`secrets.token_urlsafe`; it is compared in constant time and never logged, never in `/status`.
On a loopback address the read endpoints are open and requests must name a loopback host (a
DNS-rebinding page cannot read them); any other address refuses to start without a token and
then requires it for every data endpoint (the static dashboard files hold no data). No access
log is written. Control needs a custom header, so a cross-site form cannot trigger it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.resources
import ipaddress
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import SecretStr

from flowrl.events import Span
from flowrl.monitor.metrics import CONTENT_TYPE, ControllerMetrics
from flowrl.monitor.trace import chrome_trace, recent_spans
from transport.errors import BindRefused

if TYPE_CHECKING:
    from flowrl.monitor.view import RunView
    from flowrl.recipe import MonitorConfig

__all__ = ["MAX_STALENESS", "MonitorServer", "dumps"]

log = structlog.get_logger("flowrl.monitor")

#: largest staleness budget `POST /staleness` accepts (the recipe's own bound).
MAX_STALENESS = 64
#: an idle event stream sends a comment this often, so proxies keep it and a gone client is
#: noticed (the write fails).
KEEPALIVE_S = 15.0
#: request bodies are tiny JSON objects; anything larger is refused before it is read.
MAX_BODY = 64 << 10
#: a handler still running at close (a slow client) is cancelled after this long.
SHUTDOWN_S = 2.0

_STATIC = {"index.html": "text/html", "dashboard.js": "text/javascript",
           "dashboard.css": "text/css"}
_NO_STORE = {"Cache-Control": "no-store"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _ClientFaults(logging.Filter):
    """Drops aiohttp's tracebacks for requests that fail before any handler ran (malformed
    HTTP, a client that hung up): anyone who can connect could flood the log with them. They
    are answered with a 4xx as before; errors of the handlers themselves are still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, HttpProcessingError | ConnectionError)


_http_log = logging.getLogger("flowrl.monitor.http")
_http_log.addFilter(_ClientFaults())


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities as None: JSON has no such numbers, browsers reject them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Strict JSON (no NaN); unknown objects become their ``str``."""
    try:
        return json.dumps(obj, allow_nan=False, default=str, separators=(",", ":"))
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, default=str, separators=(",", ":"))


class MonitorServer:
    """One run's HTTP monitor; ``await start()`` returns its URL, ``aclose()`` stops it."""

    def __init__(self, run: RunView, config: MonitorConfig) -> None:
        self._run = run
        self.host = config.host
        self.port = config.port or 0
        self.loopback = is_loopback(self.host)
        if not self.loopback and config.token is None:
            raise BindRefused(f"the monitor binds {self.host!r} (not loopback) and so needs a "
                              "token (monitor.token)")
        #: whether the token was made here (the launcher then shows it: nobody else knows it).
        self.token_generated = config.token is None
        self.token: SecretStr = config.token or SecretStr(secrets.token_urlsafe(24))
        self.url = ""
        self._metrics = ControllerMetrics(run)
        self._runner: web.AppRunner | None = None
        self._closing = asyncio.Event()
        self._static = {
            name: (importlib.resources.files("flowrl.monitor").joinpath("static", name)
                   .read_bytes(), ctype)
            for name, ctype in _STATIC.items()}

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> str:
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY)
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._static_file)
        app.router.add_get("/status", self._status)
        app.router.add_get("/metrics", self._metrics_text)
        app.router.add_get("/events", self._events)
        app.router.add_get("/trace", self._trace)
        app.router.add_post("/pause", self._control(lambda _: self._run.pause()))
        app.router.add_post("/resume", self._control(lambda _: self._run.resume()))
        app.router.add_post("/stop", self._control(lambda _: self._run.stop()))
        app.router.add_post("/staleness", self._staleness)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=SHUTDOWN_S, logger=_http_log)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.host, self.port).start()
        except OSError as exc:
            await self._runner.cleanup()
            self._runner = None
            raise BindRefused(f"monitor cannot listen on {self.host}:{self.port}: {exc}") from exc
        port = int(self._runner.addresses[0][1])
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}/"
        return self.url

    async def aclose(self) -> None:
        self._closing.set()  # event streams end at once instead of holding the shutdown
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> MonitorServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- access --------------------------------------------------------------------------------

    def authorized(self, request: web.Request) -> bool:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            return False
        return hmac.compare_digest(given.strip().encode(),
                                   self.token.get_secret_value().encode())

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.loopback and not is_loopback(request.url.host or ""):
            raise web.HTTPMisdirectedRequest(text="this monitor answers loopback host names only")
        read = request.method in ("GET", "HEAD")
        public = request.path == "/" or request.path.startswith("/static/")
        if not (public or (read and self.loopback) or self.authorized(request)):
            raise web.HTTPUnauthorized(headers={"WWW-Authenticate": 'Bearer realm="flowrl"'},
                                       text="a bearer token is required")
        return await handler(request)

    # ---- read endpoints ------------------------------------------------------------------------

    async def _index(self, request: web.Request) -> web.Response:
        body, ctype = self._static["index.html"]
        return web.Response(body=body, content_type=ctype, headers=_NO_STORE)

    async def _static_file(self, request: web.Request) -> web.Response:
        found = self._static.get(request.match_info["name"])
        if found is None:
            raise web.HTTPNotFound()
        return web.Response(body=found[0], content_type=found[1], headers=_NO_STORE)

    async def _status(self, request: web.Request) -> web.Response:
        return web.Response(text=dumps(self._run.status()), content_type="application/json",
                            headers=_NO_STORE)

    async def _metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(),
                            headers={"Content-Type": CONTENT_TYPE, **_NO_STORE})

    async def _trace(self, request: web.Request) -> web.Response:
        window = _float_param(request, "window")
        after = _float_param(request, "after")
        bus = self._run.events
        now = time.time()
        cutoffs = [now - max(0.0, window)] if window is not None else []
        if after is not None:
            cutoffs.append(bus.t0 + after / 1e6)
        since = max(cutoffs, default=None)
        # Snapshot in the loop (O(spans returned)); the JSON, ~10 us a span, is built in a
        # thread so a full export of every kept span does not stall the controller.
        spans = recent_spans(bus.spans, since)
        roles = self._run.roles()
        workers = self._run.worker_roles()
        other = {"now_us": round((now - bus.t0) * 1e6, 1), "window_s": window,
                 "run_id": self._run.run_id}
        body = await asyncio.to_thread(_render_trace, spans, bus.t0, roles, workers, other)
        return web.Response(text=body, content_type="application/json", headers=_NO_STORE)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        last_id = _int_param(request, "last_id")
        header = request.headers.get("Last-Event-ID", "")
        if header.isdigit():
            last_id = int(header)
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-store",
            "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        try:
            async with contextlib.aclosing(self._stream(last_id)) as stream:
                async for event in stream:
                    chunk = (": keepalive\n\n" if event is None
                             else f"id: {event['seq']}\nevent: {event['kind']}\n"
                                  f"data: {dumps(event)}\n\n")
                    await resp.write(chunk.encode())
        except ConnectionResetError:
            pass  # the client went away; nothing to tell anyone
        return resp

    async def _stream(self, last_id: int | None) -> AsyncGenerator[dict[str, Any] | None, None]:
        """Replayed then live events in ``seq`` order, None for a keepalive; ends at close."""
        bus = self._run.events
        # Without a last id the stream starts now: after the newest event kept so far.
        sent = last_id if last_id is not None else bus.recent[-1]["seq"] if bus.recent else 0
        # subscribe() is an async generator; it must be closed to drop its queue at once.
        live = cast(AsyncGenerator[dict[str, Any], None], bus.subscribe())
        nxt: asyncio.Future[dict[str, Any]] = asyncio.ensure_future(anext(live))
        closing: asyncio.Future[Any] = asyncio.ensure_future(self._closing.wait())
        try:
            # One turn of the loop runs the subscription up to its queue wait: from then on it
            # receives every event, so replaying `recent` now leaves no gap (and the queue's
            # copies of replayed events are skipped below).
            await asyncio.sleep(0)
            for event in [e for e in bus.recent if e["seq"] > sent]:
                sent = event["seq"]
                yield event
            while not self._closing.is_set():
                waiting: set[asyncio.Future[Any]] = {nxt, closing}
                done, _ = await asyncio.wait(waiting, timeout=KEEPALIVE_S,
                                             return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    if closing not in done:
                        yield None
                    continue
                event = nxt.result()
                nxt = asyncio.ensure_future(anext(live))
                if event["seq"] > sent:  # already replayed otherwise
                    sent = event["seq"]
                    yield event
        finally:
            for fut in (nxt, closing):
                fut.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nxt
            with contextlib.suppress(asyncio.CancelledError):
                await closing
            await live.aclose()

    # ---- control -------------------------------------------------------------------------------

    def _control(self, action: Callable[[web.Request], None]) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            action(request)
            log.info("monitor control", action=request.path.lstrip("/"), peer=request.remote)
            return self._control_reply()

        return handler

    def _control_reply(self) -> web.Response:
        run = self._run
        return web.json_response({"ok": True, "paused": run.paused, "version": run.version,
                                  "max_staleness": run.max_staleness})

    async def _staleness(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # RecursionError: JSON nested too deep
            raise web.HTTPBadRequest(text="the body must be JSON: {\"max_staleness\": n}") from None
        n = body.get("max_staleness") if isinstance(body, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_STALENESS:
            raise web.HTTPBadRequest(
                text=f"max_staleness must be an integer in [0, {MAX_STALENESS}]")
        self._run.set_max_staleness(n)
        log.info("monitor control", action="staleness", max_staleness=n, peer=request.remote)
        return self._control_reply()


def _render_trace(spans: list[Span], t0: float, roles: list[str],
                  workers: list[tuple[str, str]], other: dict[str, Any]) -> str:
    trace = chrome_trace(spans, t0=t0, roles=roles, workers=workers)
    trace["otherData"] = other
    return dumps(trace)


def _float_param(request: web.Request, name: str) -> float | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be a number") from None
    if not math.isfinite(value):
        raise web.HTTPBadRequest(text=f"{name} must be finite")
    return value


def _int_param(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return None
    if not raw.isdigit():
        raise web.HTTPBadRequest(text=f"{name} must be a non-negative integer")
    return int(raw)
