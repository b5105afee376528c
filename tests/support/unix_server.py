"""A small asyncio server on a unix socket for unit tests that stand in for an engine.

``serving`` runs ``handler`` for every connection and, when the test is done, closes the
listener and every connection, then cancels and awaits the handlers still running. A
handler left pending when the test's event loop closes is collected later, during another
test, and its "Event loop is closed" becomes that test's unraisable-exception failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def serving(path: Path, handler: Handler) -> AsyncIterator[asyncio.Server]:
    """``handler`` answers each connection to ``path``; the writer is closed after it."""
    handlers: set[asyncio.Task[None]] = set()
    writers: set[asyncio.StreamWriter] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        writers.add(writer)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_unix_server(serve, path=str(path))
    try:
        yield server
    finally:
        server.close()
        for writer in writers:
            writer.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()
