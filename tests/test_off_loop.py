"""api.workflow.off_loop: a blocking context manager entered and left on a worker thread, as `with` would."""

import asyncio
import threading
import time
from contextlib import contextmanager

import pytest

from braid.api.workflow import off_loop


class Recorder:
    def __init__(self, enter_s: float = 0.0):
        self.enter_s, self.events, self.threads = enter_s, [], set()

    @contextmanager
    def cm(self):
        self.threads.add(threading.get_ident())
        time.sleep(self.enter_s)
        self.events.append("enter")
        try:
            yield "value"
        except BaseException as e:
            self.events.append(f"exit {type(e).__name__}")
            raise
        else:
            self.events.append("exit ok")
        finally:
            self.threads.add(threading.get_ident())


def test_entered_and_left_off_the_loop_which_keeps_serving():
    rec = Recorder(enter_s=0.3)

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        async with off_loop(rec.cm()) as value:
            assert value == "value"
        ticker.cancel()
        return ticks

    assert asyncio.run(main()) >= 10  # (the loop ran other work while the entry slept 0.3 s)
    assert rec.events == ["enter", "exit ok"]
    assert threading.get_ident() not in rec.threads


def test_the_blocks_exception_reaches_the_manager_and_the_caller():
    rec = Recorder()

    async def main():
        async with off_loop(rec.cm()):
            raise KeyError("boom")

    with pytest.raises(KeyError):
        asyncio.run(main())
    assert rec.events == ["enter", "exit KeyError"]


def test_an_async_generator_closed_mid_block_leaves_it_with_the_close():
    rec = Recorder()

    async def stream():
        async with off_loop(rec.cm()):
            for i in range(10):
                yield i

    async def main():
        gen = stream()
        assert await anext(gen) == 0
        await gen.aclose()

    asyncio.run(main())
    assert rec.events == ["enter", "exit GeneratorExit"]


def test_a_caller_cancelled_while_entering_leaves_it_once_entered():
    rec = Recorder(enter_s=0.3)

    async def main():
        task = asyncio.create_task(_enter_and_wait(rec))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 5
        while len(rec.events) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    asyncio.run(main())
    assert rec.events == ["enter", "exit CancelledError"]


async def _enter_and_wait(rec):
    async with off_loop(rec.cm()):
        await asyncio.sleep(60)
