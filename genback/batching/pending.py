"""The pending state of :class:`genback.batching.batcher.Batcher`: a pending query and its callers
(:class:`Entry`), one event loop's pending batch and dispatch state (:class:`LoopState`), and
failing the callers of entries that cannot be answered.
Guarded by the batcher's lock."""

from __future__ import annotations

import asyncio
import operator
from typing import Hashable

from ..cpython import release

_done = operator.methodcaller("done")  # (a future's or a group member's done(), C-level map)


class Entry:
    """A pending query and its callers (``waiters``)."""

    __slots__ = ("query", "waiters")

    def __init__(self, query, waiter):
        self.query = query
        # each caller's future, or a member of a caller's QueryGroup (answers as a future does)
        self.waiters = [waiter]

    def live(self) -> bool:
        """Whether a caller still waits for it (:func:`live_entries`'s test, for one entry)."""
        return not all(map(_done, self.waiters))


def live_entries(entries) -> list[Entry]:
    """The entries of ``entries`` that a caller still waits for (:meth:`Entry.live` of each,
    without a Python frame per entry: a batch's callers are mostly C-level futures)."""
    return [e for e in entries if not all(map(_done, e.waiters))]


class LoopState:
    """Pending batch and dispatch state of one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: dict[Hashable, Entry] = {}
        self.timer: asyncio.TimerHandle | None = None  # the window's end (Batcher._arm)
        self.opened = 0.0  # loop.time() when the pending batch's first query joined
        self.window_expired = False
        self.busy = False
        self.callers = 0  # callers of the pending batch (a query asked twice counts twice)
        self.sizes = (0, 0)  # callers of the last two batches dispatched (0: none yet)
        self.check_queued = False  # a _check_cohort is queued on the loop
        # the pending batch's hold on young collections (genback.cpython.CollectionHold)
        self.gc_hold = None

    def take_hold(self):
        """The pending batch's hold on young collections, handed over (None: none)."""
        hold, self.gc_hold = self.gc_hold, None
        return hold

    def cohort_in(self) -> bool:
        """Whether the pending batch has as many callers as the larger of the last two had."""
        target = max(self.sizes)
        return target > 0 and self.callers >= target


def fail_entries(entries: list[Entry], exc: BaseException) -> None:
    """Fail every caller of ``entries`` that still waits with ``exc`` (on the loop's thread)."""
    for entry in entries:
        for f in entry.waiters:
            if not f.done():
                f.set_exception(exc)


def fail_threadsafe(loop: asyncio.AbstractEventLoop, futures: list, exc: BaseException) -> None:
    """Fail ``futures`` of ``loop`` that are not done with ``exc``, from any thread (at once on
    ``loop``'s own thread, else through ``call_soon_threadsafe``; nothing once it is closed)."""

    def fail():
        for f in futures:
            if not f.done():
                f.set_exception(exc)

    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fail()
    elif not loop.is_closed():
        loop.call_soon_threadsafe(fail)


def release_closed_holds(states) -> None:
    """Release the holds on young collections of pending batches whose loop closed with them
    (their callers cancelled at its shutdown: never dispatched)."""
    for state in states:
        if state.loop.is_closed():
            release(state.take_hold())
