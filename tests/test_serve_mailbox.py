"""How the engine thread's events reach the event loop: paced text, urgent firsts and ends."""

import asyncio
import threading

from edgerun.serve.app import _Mailbox, _Sink
from edgerun.serve.scheduler import Delta, Done, Usage

NEVER = 3600.0  # a pace no test outlives: anything that arrives was not waiting for the timer


def from_engine(post, *events) -> None:
    """Post from another thread, as the engine does."""
    t = threading.Thread(target=lambda: [post(e) for e in events])
    t.start()
    t.join()


async def arrived(queue: asyncio.Queue, n: int) -> list:
    return [await asyncio.wait_for(queue.get(), 10) for _ in range(n)]


async def test_paced_events_wait_for_the_timer_and_an_urgent_one_brings_them():
    box, queue = _Mailbox(asyncio.get_running_loop(), pace=NEVER), asyncio.Queue()
    from_engine(lambda e: box.post(queue, e), "first")
    assert await arrived(queue, 1) == ["first"]
    from_engine(lambda e: box.post(queue, e, urgent=False), "a", "b")
    await asyncio.sleep(0.05)  # the loop turns; the timer is an hour away
    assert queue.empty()
    from_engine(lambda e: box.post(queue, e), "end")
    assert await arrived(queue, 3) == ["a", "b", "end"]


async def test_the_timer_hands_out_what_was_posted_and_a_quiet_mailbox_wakes_at_once():
    box, queue = _Mailbox(asyncio.get_running_loop(), pace=0.01), asyncio.Queue()
    from_engine(lambda e: box.post(queue, e), "first")
    from_engine(lambda e: box.post(queue, e, urgent=False), "a", "b")
    assert await arrived(queue, 3) == ["first", "a", "b"]  # the timer delivered a and b
    await asyncio.sleep(0.1)  # the next tick finds nothing: the mailbox is idle
    box.pace = NEVER
    from_engine(lambda e: box.post(queue, e, urgent=False), "late")
    assert await arrived(queue, 1) == ["late"]  # no timer was due: the post woke the loop


async def test_a_replys_first_text_and_its_end_are_urgent_the_text_between_paced():
    box, queue = _Mailbox(asyncio.get_running_loop(), pace=NEVER), asyncio.Queue()
    sink = _Sink(box, queue)
    from_engine(sink, Delta("one"))
    assert await arrived(queue, 1) == [Delta("one")]
    from_engine(sink, Delta(" two"), Delta(" three"))
    await asyncio.sleep(0.05)
    assert queue.empty()
    done = Done("stop", Usage(3, 3, 0))
    from_engine(sink, done)
    assert await arrived(queue, 3) == [Delta(" two"), Delta(" three"), done]
