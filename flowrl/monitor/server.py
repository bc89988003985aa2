"""The controller's HTTP monitor: status JSON, Prometheus metrics, an event stream, a trace
export, a live dashboard, and a few token-guarded control actions.

Endpoints (all in the controller's own event loop; every handler is O(snapshot), none blocks):

- ``GET /`` — the dashboard (static files shipped in this package; no network access needed);
- ``GET /status`` — exactly the run's `status()` (`flowrl.monitor.view.RunView`) as JSON;
- ``GET /metrics`` — Prometheus text exposition (`flowrl.monitor.metrics`);
- ``GET /events`` — Server-Sent Events, one per controller event, ``id:`` = its ``seq``.
  ``Last-Event-ID`` (or ``?last_id=N``, up to 20 ASCII digits; anything else is a 400) first
  replays the kept events after ``N``. At most ``monitor.max_event_streams`` at once (503
  beyond); all share one subscription to the controller's events (`EventFanout`);
- ``GET /trace[?window=S][&after=US]`` — Chrome trace-event JSON of the kept spans that ended
  (and marks made) in the last ``S`` seconds and after ``US`` (a ``ts`` in microseconds, e.g.
  the previous answer's ``otherData.now_us``, so a poller fetches only what is new);
- ``GET /plan-trace`` — the run's trace so far (`flowrl.run_trace`, JSON lines, as a file
  download) for ``python -m flowrl.plan``; it holds the recipe, so it always requires the
  bearer token, on loopback too;
- ``POST /pause``, ``POST /resume``, ``POST /stop``, ``POST /staleness`` (JSON
  ``{"max_staleness": n}``) — require ``Authorization: Bearer <token>``; 401 without it
  ("a bearer token is required") or with another token ("invalid token").

Security. The token comes from the recipe (``monitor.token``) or is generated at start with
`secrets.token_urlsafe`; it is compared in constant time and never logged, never in `/status`.
On a loopback address the read endpoints are open and requests must name a loopback host (a
DNS-rebinding page cannot read them); any other address refuses to start without a token and
then requires it for every data endpoint (the static dashboard files hold no data). No access
log is written. Control needs a custom header, so a cross-site form cannot trigger it.

Bounds. Connections are capped, timed out and refused cheaply (`ConnectionLimits`, settings in
`MonitorConfig`); `/status` and `/metrics` answers are cached for `SNAPSHOT_TTL_S` unless an
event came since, so a crowd of pollers does not compute them per request.
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
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import SecretStr

from flowrl.events import Mark, Span
from flowrl.monitor.fanout import KEEPALIVE, EventFanout
from flowrl.monitor.limits import BoundedSite, ConnectionLimits
from flowrl.monitor.metrics import CONTENT_TYPE, ControllerMetrics
from flowrl.monitor.trace import chrome_trace, recent_marks, recent_spans
from flowrl.run_trace import trace_lines
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
#: how long a `/status` or `/metrics` answer is reused while no event came (pollers share it).
SNAPSHOT_TTL_S = 0.25
#: the longest event id taken (a 64-bit sequence number has 20 digits).
MAX_ID_DIGITS = 20
#: request line and header limits, stated here rather than left to the aiohttp version.
MAX_LINE = 8190
MAX_HEADERS = 64

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


class _Snapshot:
    """An answer body reused for `SNAPSHOT_TTL_S` while the controller emitted no event."""

    def __init__(self, run: RunView, render: Callable[[], bytes]) -> None:
        self._run = run
        self._render = render
        self._body = b""
        self._key = -1
        self._at = -math.inf

    def get(self) -> bytes:
        recent = self._run.events.recent
        key = recent[-1]["seq"] if recent else 0
        now = time.monotonic()
        if key != self._key or now - self._at > SNAPSHOT_TTL_S:
            self._body, self._key, self._at = self._render(), key, now
        return self._body


def _sse_chunk(event: dict[str, Any]) -> bytes:
    return f"id: {event['seq']}\nevent: {event['kind']}\ndata: {dumps(event)}\n\n".encode()


class MonitorServer:
    """One run's HTTP monitor; ``await start()`` returns its URL, ``aclose()`` stops it."""

    def __init__(self, run: RunView, config: MonitorConfig) -> None:
        self._run = run
        self.config = config
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
        self._status_body = _Snapshot(run, lambda: dumps(run.status()).encode())
        self._metrics_body = _Snapshot(run, self._metrics.render)
        self._runner: web.AppRunner | None = None
        self._closing = asyncio.Event()
        #: the listener's connection accounting; None until started.
        self.limits: ConnectionLimits | None = None
        self._fanout: EventFanout | None = None
        self._fanout_task: asyncio.Task[None] | None = None
        #: open `/events` streams.
        self.streams = 0
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
        app.router.add_get("/plan-trace", self._plan_trace)
        app.router.add_post("/pause", self._control(lambda _: self._run.pause()))
        app.router.add_post("/resume", self._control(lambda _: self._run.resume()))
        app.router.add_post("/stop", self._control(lambda _: self._run.stop()))
        app.router.add_post("/staleness", self._staleness)
        cfg = self.config
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_S,
            logger=_http_log, keepalive_timeout=cfg.header_timeout_s, max_line_size=MAX_LINE,
            max_field_size=MAX_LINE, max_headers=MAX_HEADERS)
        await self._runner.setup()
        assert self._runner.server is not None
        self.limits = ConnectionLimits(
            self._runner.server, max_connections=cfg.max_connections,
            header_timeout_s=cfg.header_timeout_s, stall_timeout_s=cfg.stall_timeout_s)
        # The kernel queues at most this many connections not yet accepted (none holds a
        # file descriptor of this process).
        backlog = min(cfg.max_connections, 128)
        try:
            await BoundedSite(self._runner, self.limits, self.host, self.port,
                              backlog=backlog).start()
        except OSError as exc:
            await self._runner.cleanup()
            self._runner = None
            raise BindRefused(f"monitor cannot listen on {self.host}:{self.port}: {exc}") from exc
        self._fanout = EventFanout(self._run.events, _sse_chunk, keepalive_s=KEEPALIVE_S)
        self._fanout_task = asyncio.create_task(self._fanout.run(), name="monitor-events")
        port = int(self._runner.addresses[0][1])
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}/"
        return self.url

    async def aclose(self) -> None:
        self._closing.set()
        if self._fanout_task is not None:  # event streams end at once instead of holding on
            self._fanout_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._fanout_task
            self._fanout_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> MonitorServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- access --------------------------------------------------------------------------------

    def _bearer(self, request: web.Request) -> bool | None:
        """Whether the request's bearer token is this monitor's; None when it names none."""
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return None
        return hmac.compare_digest(given.strip().encode(),
                                   self.token.get_secret_value().encode())

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.loopback and not is_loopback(request.url.host or ""):
            raise web.HTTPMisdirectedRequest(text="this monitor answers loopback host names only")
        read = request.method in ("GET", "HEAD")
        public = request.path == "/" or request.path.startswith("/static/")
        # The run's trace carries its recipe: only a token holder may take it away.
        open_read = read and self.loopback and request.path != "/plan-trace"
        if not (public or open_read):
            bearer = self._bearer(request)
            if bearer is None:
                raise web.HTTPUnauthorized(
                    headers={"WWW-Authenticate": 'Bearer realm="flowrl"'},
                    text="a bearer token is required")
            if not bearer:  # RFC 6750's error code, so a client can tell the two apart
                raise web.HTTPUnauthorized(
                    headers={"WWW-Authenticate": 'Bearer realm="flowrl", error="invalid_token"'},
                    text="invalid token")
        conn = ConnectionLimits.of(request)
        if conn is None:  # the client is gone already
            raise web.HTTPBadRequest(text="the connection is closed")
        conn.request_started()  # off the header deadline while it is served
        try:
            return await handler(request)
        finally:
            conn.request_ended()

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
        return web.Response(body=self._status_body.get(), content_type="application/json",
                            headers=_NO_STORE)

    async def _metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics_body.get(),
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
        marks = recent_marks(bus.marks, since)
        roles = self._run.roles()
        workers = self._run.worker_roles()
        other = {"now_us": round((now - bus.t0) * 1e6, 1), "window_s": window,
                 "run_id": self._run.run_id}
        body = await asyncio.to_thread(_render_trace, spans, bus.t0, roles, workers, other,
                                       marks)
        return web.Response(text=body, content_type="application/json", headers=_NO_STORE)

    async def _plan_trace(self, request: web.Request) -> web.Response:
        head, records = self._run.plan_trace()  # a snapshot in the loop; encoded in a thread
        body = await asyncio.to_thread(lambda: "".join(trace_lines(head, records)))
        name = f"flowrl-{self._run.run_id}.trace.jsonl"
        return web.Response(text=body, content_type="application/x-ndjson", headers={
            **_NO_STORE, "Content-Disposition": f'attachment; filename="{name}"'})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        last_id = _event_id(request.query.get("last_id"), "last_id")
        header = _event_id(request.headers.get("Last-Event-ID"), "Last-Event-ID")
        if header is not None:
            last_id = header
        fanout = self._fanout
        if fanout is None or self._closing.is_set():
            raise web.HTTPServiceUnavailable(text="the monitor is closing")
        if self.streams >= self.config.max_event_streams:
            raise web.HTTPServiceUnavailable(
                headers={"Retry-After": "5"},
                text=f"too many event streams open (monitor.max_event_streams = "
                     f"{self.config.max_event_streams}); retry later")
        self.streams += 1
        try:
            resp = web.StreamResponse(headers={
                "Content-Type": "text/event-stream", "Cache-Control": "no-store",
                "X-Accel-Buffering": "no"})
            await resp.prepare(request)
            pos = fanout.start(last_id)
            keepalives = fanout.keepalives
            while True:
                got = fanout.read(pos)
                if got is None:  # closing, or this client fell a whole ring behind
                    break
                data, pos = got
                if not data and fanout.keepalives != keepalives:
                    data = KEEPALIVE
                if data:
                    keepalives = fanout.keepalives
                    await resp.write(data)
                else:
                    await fanout.changed()
        except ConnectionResetError:
            pass  # the client went away; nothing to tell anyone
        finally:
            self.streams -= 1
        return resp

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
            async with asyncio.timeout(self.config.header_timeout_s):
                body = await request.json()
        except TimeoutError:
            raise web.HTTPRequestTimeout(text="the request body came too slowly") from None
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
                  workers: list[tuple[str, str]], other: dict[str, Any],
                  marks: list[Mark]) -> str:
    trace = chrome_trace(spans, t0=t0, roles=roles, workers=workers, marks=marks)
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


def _event_id(raw: str | None, name: str) -> int | None:
    """An event id from the client: None when absent or empty, else 1 to `MAX_ID_DIGITS` ASCII
    digits (``str.isdigit`` also takes other scripts' digits and superscripts)."""
    if not raw:
        return None
    if not (len(raw) <= MAX_ID_DIGITS and raw.isascii() and raw.isdigit()):
        raise web.HTTPBadRequest(
            text=f"{name} must be an event id: at most {MAX_ID_DIGITS} digits 0-9")
    return int(raw)
