"""Fuzzing the monitor over HTTP (`bench/fuzz.py` endpoint ``monitor``): malformed and
hostile requests, and what their answers must be."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
from dataclasses import dataclass
from typing import Final

from bench.fuzz_common import (
    REPLY_WAIT_S,
    VALID_EVERY,
    Figures,
)
from flowrl.controller import Controller

_STATIC_OK: Final = {"index.html", "dashboard.js", "dashboard.css"}


@dataclass
class HttpFindings:
    server_errors: int = 0  # 5xx answers
    auth_bypass: int = 0  # a control request without the token that was not refused
    traversal_leaks: int = 0  # a static path outside the shipped files that answered 200
    host_bypass: int = 0  # a read answered for a Host that is not a loopback name
    bad_event_ids: int = 0  # an /events request with a malformed id not answered 400


class HttpGen:
    """Malformed and hostile HTTP requests against the monitor."""

    def __init__(self, seed: int, host: str, port: int, token: str) -> None:
        self.rng = random.Random(seed)
        self.host = f"{host}:{port}"
        self.token = token

    def request(self) -> tuple[str, bytes]:
        r = self.rng
        kind = r.choice(("random", "method", "headers", "json", "auth", "traversal", "length",
                         "version", "host", "event_id"))
        # Every well-formed part asks the server to close after answering: the answer then
        # ends where the stream does.
        h = f"{self.host}\r\nConnection: close"
        if kind == "random":
            return kind, r.randbytes(r.choice((1, 16, 200, 4000)))
        if kind == "method":
            method = r.choice(("FOO", "get", "DELETE", "PUT", "CONNECT", "TRACE", "G\0ET",
                               "X" * 5000, ""))
            return kind, f"{method} /status HTTP/1.1\r\nHost: {h}\r\n\r\n".encode()
        if kind == "headers":
            if r.random() < 0.5:
                head = f"X-Big: {'a' * r.choice((9000, 70000))}\r\n"
            else:
                head = "".join(f"X-{i}: v\r\n" for i in range(r.choice((200, 2000))))
            return kind, f"GET /status HTTP/1.1\r\nHost: {h}\r\n{head}\r\n".encode()
        if kind == "json":
            body = r.choice((
                b"{", b"[" * 100_000 + b"]" * 100_000, b"[" * 30_000 + b"]" * 30_000,
                b'{"max_staleness": "1"}',
                b'{"max_staleness": 1e999}', b'{"max_staleness": -1}', b"null", b"\xff\xfe",
                b'{"max_staleness": ' + b"9" * 5000 + b"}", b'{"max_staleness": true}',
                b'{"max_staleness": 65}', b'{"max_staleness": NaN}', b"[]", b'"x"',
                json.dumps({"max_staleness": [1]}).encode()))
            path = r.choice(("/staleness", "/staleness", "/pause?x=1"))
            # /pause: control without the token, with a body
            auth = "" if path.startswith("/pause") else f"Authorization: Bearer {self.token}\r\n"
            return kind, (f"POST {path} HTTP/1.1\r\nHost: {h}\r\n{auth}"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                          "\r\n").encode() + body
        if kind == "auth":
            path = r.choice(("/pause", "/resume", "/stop", "/staleness"))
            auth = r.choice(("", "Authorization: Bearer\r\n", "Authorization: Bearer x\r\n",
                             f"Authorization: Basic {self.token}\r\n",
                             f"Authorization: Bearer {self.token[:-1]}\r\n",
                             f"Authorization: Bearer {self.token}x\r\n",
                             f"Authorization: bearer  {self.token[1:]}\r\n",
                             "Authorization: Bearer \u00e9\u00e9\r\n"))
            return kind, (f"POST {path} HTTP/1.1\r\nHost: {h}\r\n{auth}Content-Length: 2\r\n"
                          "\r\n{}").encode("utf-8", "surrogateescape")
        if kind == "traversal":
            path = r.choice((
                "/static/../../pyproject.toml", "/static/%2e%2e/%2e%2e/server.py",
                "/static/..%2f..%2fserver.py", "/static/..%2F__init__.py",
                "/static/%2e%2e%2f%2e%2e%2fetc%2fpasswd", "/static//etc/passwd",
                "/static/index.html%00.py", "/static/....//....//server.py",
                "/static/%252e%252e%252fserver.py", "/static/./index.html/..",
                "/static/..\\..\\server.py", "/../../../etc/passwd", "/static/",
                "/static/dashboard.js/../../server.py"))
            return kind, f"GET {path} HTTP/1.1\r\nHost: {h}\r\n\r\n".encode()
        if kind == "length":
            length = r.choice(("10000000000000", "-1", "abc", "1, 2", "99"))
            return kind, (f"POST /staleness HTTP/1.1\r\nHost: {h}\r\n"
                          f"Authorization: Bearer {self.token}\r\nContent-Length: {length}\r\n"
                          "\r\n{}").encode()
        if kind == "version":
            line = r.choice(("GET /status HTTP/9.9", "GET /status", "GET status HTTP/1.1",
                             "GET /status HTTP/1.1 extra", "GET /st atus HTTP/1.1"))
            return kind, f"{line}\r\nHost: {h}\r\n\r\n".encode()
        if kind == "event_id":
            bad = r.choice(("\u00b2", "\u0663", "\u00e9", "9" * 5000, "1" * 21, "-1", "1e3"))
            if r.random() < 0.5:
                return kind, (f"GET /events HTTP/1.1\r\nHost: {h}\r\nLast-Event-ID: {bad}\r\n"
                              "\r\n").encode()
            return kind, f"GET /events?last_id={bad} HTTP/1.1\r\nHost: {h}\r\n\r\n".encode()
        host = r.choice(("evil.example", "127.0.0.1.evil", "", "[::1", "a" * 300))
        return kind, f"GET /status HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()


async def http_exchange(host: str, port: int, raw: bytes, *, eof: bool = False,
                        ) -> tuple[int | None, bytes]:
    """Send `raw` on a fresh connection (then end it if `eof`: for requests that are
    incomplete on purpose); the answer's status (None when the server closed without one) and
    body."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw)
        try:
            await writer.drain()
            if eof and writer.can_write_eof():
                writer.write_eof()
        except ConnectionError:
            pass
        async with asyncio.timeout(REPLY_WAIT_S):
            try:
                data = await reader.read()
            except ConnectionError:
                data = b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return None, b""
    return int(parts[1]), body


async def fuzz_monitor(ctl: Controller, count: int, seed: int, figures: Figures,
                       findings: HttpFindings) -> None:
    import aiohttp

    assert ctl.monitor is not None
    assert ctl.monitor_token is not None
    url = ctl.monitor_url or ""
    host, port = "127.0.0.1", int(url.rstrip("/").rsplit(":", 1)[1])
    token = ctl.monitor_token.get_secret_value()
    gen = HttpGen(seed, host, port, token)
    statics = {name: ctl.monitor._static[name][0] for name in _STATIC_OK}
    auth = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as http:
        for i in range(count):
            kind, raw = gen.request()
            status, body = await http_exchange(host, port, raw,
                                               eof=kind in ("random", "length"))
            figures.messages += 1
            if status is not None and status >= 500:
                findings.server_errors += 1
                print(f"monitor answered {status} to {raw[:120]!r}", file=sys.stderr)
            if kind == "auth" and status != 401:
                findings.auth_bypass += 1
                print(f"control without the token got {status}: {raw[:120]!r}", file=sys.stderr)
            loopback_host = b"Host: [::1\r" in raw or b"Host: \r" in raw
            if kind == "host" and status == 200 and not loopback_host:
                findings.host_bypass += 1
                print(f"non-loopback Host answered: {raw[:120]!r}", file=sys.stderr)
            if kind == "event_id" and status != 400:
                findings.bad_event_ids += 1
                print(f"bad event id answered {status}: {raw[:120]!r}", file=sys.stderr)
            if kind == "traversal" and status == 200 and body not in statics.values():
                findings.traversal_leaks += 1
                print(f"traversal answered 200: {raw[:120]!r}", file=sys.stderr)
            if i % VALID_EVERY == VALID_EVERY - 1:
                figures.valid_requests += 2
                async with http.get(url + "status") as resp:
                    ok = resp.status == 200 and (await resp.json())["run_id"] == ctl.run_id
                figures.valid_requests_failed += not ok
                keep = {"max_staleness": ctl.gate.max_staleness}
                async with http.post(url + "staleness", json=keep, headers=auth) as resp:
                    figures.valid_requests_failed += resp.status != 200
