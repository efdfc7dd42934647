"""``LoopThread``: a private asyncio event loop running on its own daemon thread.

Synchronous callers hand it coroutines (``asyncio.run_coroutine_threadsafe``) and block only
their own thread, so they may sit on a plain thread or inside another running event loop; the
private loop is never blocked by them. :meth:`LoopThread.continuous` runs a lazily consumed
stream of jobs with a bound on how many are in flight and yields their results as they finish.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from typing import Any

__all__ = ["LoopThread", "SessionClosed"]


class SessionClosed(RuntimeError):
    """Raised by a call on a closed session."""


class LoopThread:
    """An event loop on a daemon thread named ``name``; started at construction."""

    def __init__(self, name: str = "genback-session"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()
        self._closed = False
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule ``coro`` on the loop; its ``concurrent.futures.Future`` (cancel it to cancel
        the task).

        Raises:
            SessionClosed: after :meth:`close`.
        """
        if self._closed:
            coro.close()
            raise SessionClosed("the session is closed; build a new one")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine):
        """Run ``coro`` on the loop and block this thread for its result (or exception).

        Raises:
            RuntimeError: called on the loop's own thread (it would wait for itself).
        """
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("a blocking session method was called from the session's own "
                               "loop thread; use the async methods (stream, agenerate) there")
        return self.submit(coro).result()

    def continuous(self, items: Iterable[tuple[Any, Any]], make: Callable[[Any], Coroutine],
                   limit: int) -> Iterator[tuple[Any, Any]]:
        """Yield ``(item_id, result of make(item))`` in completion order.

        ``items`` (``(item_id, item)`` pairs) is consumed lazily, on the caller's thread, keeping
        at most ``limit`` jobs in flight; a job's exception is raised at its turn. Closing the
        iterator early cancels the jobs still in flight.
        """
        done: queue.SimpleQueue = queue.SimpleQueue()
        source = iter(items)
        in_flight: dict[concurrent.futures.Future, Any] = {}
        exhausted = False
        try:
            while True:
                while not exhausted and len(in_flight) < limit:
                    try:
                        item_id, item = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    future = self.submit(make(item))
                    in_flight[future] = item_id
                    future.add_done_callback(done.put)
                if not in_flight:
                    return
                future = done.get()
                yield in_flight.pop(future), future.result()
        finally:  # the caller stopped early or a job raised: drop the remaining work
            for future in in_flight:
                future.cancel()

    async def events(self, start: Callable[[Callable[[Any], None]], Coroutine],
                     finished: Callable[[Any], bool]) -> AsyncIterator[Any]:
        """Run ``start(push)`` on this loop and yield, on the caller's loop, each event it
        ``push``es, until one is ``finished`` or the coroutine ends.

        Leaving the iteration early (``break``) or cancelling its consumer cancels the
        coroutine.

        Raises:
            Exception: the coroutine's error, when it ends without a finished event.
            SessionClosed: the coroutine was cancelled (the session closed).
        """
        caller = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(item):  # (event,), or None once the coroutine ended
            try:
                caller.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the caller's loop is gone: nobody is listening
                pass

        future = self.submit(start(lambda event: put((event,))))
        future.add_done_callback(lambda _: put(None))

        try:
            while True:
                item = await events.get()
                if item is None:  # ended without a finished event: raise why
                    if future.cancelled():
                        raise SessionClosed("the generation was cancelled (session closed)")
                    future.result()
                    return
                yield item[0]
                if finished(item[0]):
                    return
        finally:
            if not future.done():
                future.cancel()

    def close(self, final: Callable[[], Coroutine] | None = None) -> bool:
        """Cancel every task on the loop, await ``final()`` there, then stop and join the
        thread. Returns False when it was already closed (idempotent).

        Raises:
            RuntimeError: called on the loop's own thread.
        """
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        if threading.current_thread() is self.thread:
            raise RuntimeError("close() was called from the session's own loop thread")

        async def shutdown():
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if final is not None:
                await final()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()
        return True
