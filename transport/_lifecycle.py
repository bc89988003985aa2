"""Start/close plumbing shared by the transport's servers and clients (private)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Self

__all__ = ["Closeable", "Service", "cancel_and_wait"]


class Closeable:
    """`async with` closes the object on exit."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class Service(Closeable):
    """`async with` also starts the object on entry."""

    async def start(self) -> str:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel `tasks` and wait until each has finished; their outcomes are discarded."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
