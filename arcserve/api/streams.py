"""Waiting on the engine's streams for an endpoint: every final output, or every output as it
comes; a gone client, an error or the end of the wait aborts whatever has not finished."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request

from arcserve.api.errors import ClientDisconnected
from arcserve.engine.async_engine import RequestStream
from arcserve.outputs import RequestOutput


async def finals(streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
    """Wait for every stream's final output; abort them all if the client goes away."""
    tasks = [asyncio.ensure_future(s.__anext__()) for s in streams]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=0.1)  # also how soon a gone client is seen
            if not pending:
                return [t.result() for t in tasks]
            if await raw.is_disconnected():
                raise ClientDisconnected
    finally:
        cancel(tasks, streams)


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they come. One stream (the common case) is read
    directly: its deltas then stay in its own queue until read, where those that pile up join
    (async_engine.OutputQueue), and no hand-off task runs per token."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await q.put((i, out))
        except BaseException as e:  # hand errors to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        cancel(tasks, streams)


def cancel(tasks: list[asyncio.Future], streams: list[RequestStream]) -> None:
    """Stop waiting and abort whatever has not finished (a finished stream's close is a no-op)."""
    for t in tasks:
        t.cancel()
    for s in streams:
        s.close()
