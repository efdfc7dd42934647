"""The pending state of :class:`genback.batching.batcher.Batcher`: a pending query and its callers
(:class:`Entry`), one event loop's pending batch and dispatch state (:class:`LoopState`), and
failing the callers of entries that cannot be answered.
Guarded by the batcher's lock."""

from __future__ import annotations

import asyncio
import operator
from typing import Hashable

from ..cpython import hold_collections, release

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


class Bulk:
    """One caller's several queries as one pending entry: :meth:`genback.batching.batcher.Batcher.enqueue_many`
    into an empty pending batch (a step asked by one ``batch_next_token_logprobs`` call), without
    an :class:`Entry`, a group member or an answer per query.

    ``queries``: its distinct queries, in the order of their first item; ``index``: each key's
    first item; ``first``: each item's first item of its key (None: no key repeats). Callers
    that ask one of its keys while it is pending join it (``extra``: first item -> their
    futures). ``waiters`` lists the group's future once per item, then the joiners' futures
    (what :func:`live_entries`, :func:`fail_entries` and the batcher's counts of callers read of
    any entry)."""

    __slots__ = ("queries", "index", "first", "group", "extra", "n")

    def __init__(self, items, group):
        index: dict = {}
        self.first = list(map(index.setdefault, map(_key, items), range(len(items))))
        if len(index) == len(items):  # (no key repeats: the items themselves)
            self.first = None
            self.queries = list(map(_query, items))
        else:
            self.queries = [items[i][1] for i in index.values()]
        self.index, self.group, self.extra, self.n = index, group, None, len(items)

    @property
    def waiters(self) -> list:
        out = [self.group.future] * self.n
        if self.extra:
            for _, futures in self.extra.values():
                out.extend(futures)
        return out

    def live(self) -> bool:
        return not all(map(_done, self.waiters))

    def join(self, key, waiter) -> bool:
        """Add ``waiter`` (another caller's future or group member) to this entry's query of
        ``key``; False when it has none."""
        at = self.index.get(key)
        if at is None:
            return False
        if self.extra is None:
            self.extra = {}
        self.extra.setdefault(at, (key, []))[1].append(waiter)
        return True

    def joiners(self) -> list[tuple]:
        """``(key, entry)`` of each query that joiners wait for, as a plain :class:`Entry` (the
        group itself was cancelled)."""
        out, ranks = [], self._ranks()
        for at, (key, futures) in (self.extra or {}).items():
            entry = Entry(self.queries[ranks[at]], futures[0])
            entry.waiters.extend(futures[1:])
            out.append((key, entry))
        return out

    def _ranks(self) -> dict:
        """First item -> position in ``queries``."""
        return dict(zip(self.index.values(), range(len(self.index))))

    def answer(self, results: list, copy) -> None:
        """Answer the group and the joiners from ``results`` (one per query of ``queries``, in
        order; an exception instance fails that query's callers: the group at its first)."""
        group = self.group.future
        failed = [r for r in results if isinstance(r, BaseException)]
        ranks = self._ranks() if self.first is not None or self.extra else None
        if not group.done():
            if failed:
                group.set_exception(failed[0])
            elif self.first is None:
                group.set_result(results)
            else:  # each key's first item gets its result, a repeated one a copy
                out = list(map(results.__getitem__, map(ranks.__getitem__, self.first)))
                if copy is not None:
                    for i, f in enumerate(self.first):
                        if f != i:
                            out[i] = copy(out[i])
                group.set_result(out)
        for at, (_, futures) in (self.extra or {}).items():
            result = results[ranks[at]]
            for f in futures:
                if f.done():
                    continue
                if isinstance(result, BaseException):
                    f.set_exception(result)
                else:
                    f.set_result(result if copy is None else copy(result))


_key, _query = operator.itemgetter(0), operator.itemgetter(1)


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
        self.bulk: Bulk | None = None  # the pending batch's Bulk (its first entry), if any
        self.extra = 0  # its queries beyond one: len(pending) + extra queries are pending

    def size(self) -> int:
        """Distinct queries pending."""
        return len(self.pending) + self.extra

    def add_bulk(self, bulk: "Bulk", expired: bool, now: float, hold: bool) -> None:
        """Open the (empty) pending batch with ``bulk``: its window ``expired`` already (a
        window of 0) or open from ``now``; ``hold``: young collections held while it is pending
        (:mod:`genback.cpython`, trick 4). Under the batcher's lock."""
        self.window_expired, self.opened = expired, now
        if hold and self.gc_hold is None:
            self.gc_hold = hold_collections()
        self.pending[bulk] = self.bulk = bulk
        self.extra = len(bulk.queries) - 1
        self.callers += bulk.n

    def live_queries(self) -> list:
        """The queries of the pending batch that a caller still waits for, oldest first."""
        out = []
        for e in self.pending.values():
            if e.live():
                out.extend(e.queries) if type(e) is Bulk else out.append(e.query)
        return out

    def take_batch(self, max_batch_size: int) -> list:
        """The entries of the batch to dispatch now, taken from the pending batch: all of it,
        or its first entries holding ``max_batch_size`` live queries (dead entries before them
        dropped; a :class:`Bulk` whose caller was cancelled leaves its joiners' queries as
        entries). The window's timer is cancelled when nothing is left. Under the lock."""
        pending, bulk = self.pending, self.bulk
        if bulk is not None:  # (first in pending; taken now, whatever else is)
            self.bulk, self.extra = None, 0
            if bulk.group.future.done():  # the step's caller was cancelled: its joiners' queries
                del pending[bulk]
                pending.update(bulk.joiners())  # (no other entry has their keys: they joined)
        room = max_batch_size
        if len(pending) <= room:  # (mostly: all of it, no key hashed again)
            batch = live_entries(pending.values())
            pending.clear()
        else:  # its first max_batch_size live queries (dead entries before them dropped)
            batch = []
            for key in list(pending):
                entry = pending.pop(key)
                if entry.live():  # (else all of its callers were cancelled: never computed)
                    batch.append(entry)
                    room -= len(entry.queries) if type(entry) is Bulk else 1
                    if room <= 0:
                        break
        if not pending:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            self.window_expired = False
        # else: the rest has waited at least as long as this batch; it goes as soon as it can
        return batch

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
