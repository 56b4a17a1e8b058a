"""Async helpers the deployments share: merging streams, blocking generators on threads, and back."""

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator


async def merge(streams) -> AsyncIterator:
    """Items from several async iterators as they arrive; the first error ends it."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(None)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put(e)
        finally:
            if hasattr(stream, "aclose"):
                await stream.aclose()

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            if hasattr(s, "cancel"):
                s.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # (each pump closes its stream as it ends)


async def in_thread(make: Callable[[], Iterator]) -> AsyncIterator:
    """Iterate a blocking generator on its own thread (all of it on one thread, as Serve does)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    end = object()

    def put(item) -> bool:
        """Hand an item to the consumer; False once it has gone (its loop closed)."""
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
            return True
        except RuntimeError:
            return False

    def run():
        items = None
        try:
            items = make()
            for item in items:
                if stop.is_set() or not put(item):
                    return  # the consumer left: `finally` closes the generator, which ends its engine calls
            put(end)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            put(e)
        finally:
            if hasattr(items, "close"):
                items.close()

    thread = threading.Thread(target=run, daemon=True, name="role")
    thread.start()
    try:
        while (item := await queue.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


async def run_in_thread(fn: Callable[[], object]) -> object:
    """A blocking call on its own thread (not the default executor's few: many may wait on the engine)."""
    results = [item async for item in in_thread(lambda: iter((fn(),)))]
    return results[0]


def iterate_blocking(agen: AsyncIterator) -> Iterator:
    """An async iterator driven from blocking code, on a loop of its own run once per item (tests drive a
    WorkflowDriver this way; the servers run it on their event loops)."""
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(anext(agen))
            except StopAsyncIteration:
                return
    finally:  # (the client left, or it ended): close it, then whatever it left running, then the loop
        loop.run_until_complete(agen.aclose())
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
