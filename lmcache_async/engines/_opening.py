"""``Engine.open(...)``: build an engine without blocking the caller's event loop.

An engine's constructor allocates its pools and starts its manager's loop thread (tens of
milliseconds, more on a first touch of memory): called from a coroutine, that time is taken from
every other task of the loop. :class:`EngineOpening` runs the constructor on a worker thread
instead, and is what ``LMCacheEngine.open`` and ``ECCacheEngine.open`` return: await it for the
engine, or use it as ``async with`` (the engine is closed on exit). A cancelled open leaves
nothing running: an engine built after the caller gave up is closed on a thread of its own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["EngineOpening"]


class _Closable(Protocol):
    def close(self) -> None: ...

    async def aclose(self) -> None: ...


E = TypeVar("E", bound=_Closable)


class EngineOpening(Generic[E]):
    """An engine being opened; single use (see the module docstring). ``build`` is the engine's
    constructor with its arguments bound; its errors (``TypeError``/``ValueError`` for bad
    arguments) are raised by the ``await``."""

    def __init__(self, build: Callable[[], E]) -> None:
        self._build = build
        self._engine: E | None = None

    async def _open(self) -> E:
        fut = asyncio.get_running_loop().run_in_executor(None, self._build)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(_close_built)
            raise

    def __await__(self) -> Generator[Any, None, E]:
        return self._open().__await__()

    async def __aenter__(self) -> E:
        self._engine = await self._open()
        return self._engine

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._engine is not None:
            await self._engine.aclose()


def _close_built(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        engine = fut.result()
        threading.Thread(target=engine.close, name="lmcache-async-abort-open", daemon=True).start()
