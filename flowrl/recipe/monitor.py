"""The ``monitor`` section: the controller's HTTP monitor and who may reach it."""

from __future__ import annotations

import ipaddress
from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator

from flowrl.recipe.section import _rule, _Section

_MIN_TOKEN_CHARS = 16


class MonitorConfig(_Section):
    """The controller's HTTP monitor (status, metrics, dashboard)."""

    host: str = Field(default="127.0.0.1", min_length=1)
    """Bind address; anything but loopback requires a `token`."""
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    """TCP port; None picks a free one (printed at start)."""
    token: SecretStr | None = None
    """Bearer token (16+ characters) for control actions and for any access off loopback.
    Never printed."""
    max_connections: int = Field(default=64, ge=2, le=10_000)
    """Open connections at most. When full, a new one takes the place of the longest-idle
    connection (no request under way: idle keep-alive or headers still coming); if every
    connection is serving a request, the new one is answered 503 and closed."""
    max_event_streams: int = Field(default=8, ge=1, le=1000)
    """Concurrent ``/events`` streams at most (each costs the controller's loop a write per
    event); one more is answered 503. Fewer than `max_connections`."""
    header_timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    """A connection closes unless it completes a request within this long of opening or of
    its previous answer (slow or unfinished headers, idle keep-alive, a slow request body)."""
    stall_timeout_s: float = Field(default=30.0, gt=0.0, le=3600.0)
    """An answer (an event stream, a large trace) whose client stops reading is dropped after
    this long without progress instead of buffered."""

    @field_validator("token")
    @classmethod
    def _strong_token(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < _MIN_TOKEN_CHARS:
            raise ValueError(f"must be at least {_MIN_TOKEN_CHARS} characters long")
        return v

    @model_validator(mode="after")
    def _remote_needs_token(self) -> MonitorConfig:
        if not _is_loopback(self.host) and self.token is None:
            raise _rule("token", f"required when the monitor binds to {self.host!r} "
                        "(not loopback)")
        if self.max_event_streams >= self.max_connections:
            raise _rule("max_event_streams", f"must be fewer than max_connections "
                        f"({self.max_connections}): event streams would leave no connection "
                        "for /status")
        return self


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
