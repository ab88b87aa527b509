"""`LoopMailbox`: the engine loop thread's deliveries to an asyncio event loop, one wake-up per
burst (engine_ext/engine/outputs.py)."""
from __future__ import annotations

import asyncio
import threading

from engine_ext.engine.outputs import AsyncSink, LoopMailbox


def test_a_burst_posted_from_another_thread_wakes_the_loop_once_and_keeps_order():
    loop = asyncio.new_event_loop()
    try:
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))[1]  # count the wake-ups
        box = LoopMailbox.for_loop(loop)
        assert LoopMailbox.for_loop(loop) is box
        got: list = []

        def producer():  # the engine loop thread: 1000 outputs of one step, the event loop busy meanwhile
            for i in range(1000):
                box.post(got.append, i)

        t = threading.Thread(target=producer)
        t.start()
        t.join()
        loop.run_until_complete(asyncio.sleep(0))
        assert got == list(range(1000))
        assert len(wakeups) == 1
        box.post(got.append, "next")  # a later burst: another wake-up
        loop.run_until_complete(asyncio.sleep(0))
        assert got[-1] == "next" and len(wakeups) == 2
    finally:
        loop.close()


def test_async_sinks_of_one_loop_share_its_mailbox_and_receive_their_own_items():
    async def main():
        loop = asyncio.get_running_loop()
        a, b = AsyncSink(loop, lambda out, res: ("a", out)), AsyncSink(loop, lambda out, res: ("b", out))
        assert a._box is b._box
        t = threading.Thread(target=lambda: [a.on_output(1), b.on_output(2), a.on_error(ValueError("x"))])
        t.start()
        t.join()
        assert await a.q.get() == ("a", 1)
        assert await b.q.get() == ("b", 2)
        assert isinstance(await a.q.get(), ValueError)

    asyncio.run(main())


def test_posting_to_a_closed_loop_is_dropped_and_its_mailbox_forgotten():
    old = asyncio.new_event_loop()
    box = LoopMailbox.for_loop(old)
    old.close()
    box.post(print, "nobody listens")  # no error
    new = asyncio.new_event_loop()
    try:
        LoopMailbox.for_loop(new)
        assert old not in LoopMailbox._by_loop
    finally:
        new.close()
