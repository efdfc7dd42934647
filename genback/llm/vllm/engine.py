"""``EngineLoop``: vLLM's ``AsyncLLM`` on a private event-loop thread, and its in-flight requests.

``AsyncLLM`` binds to the event loop it runs on (its output handler is a task of that loop), while
genback's callers use several loops in turn (``asyncio.run`` after ``asyncio.run``), threads, and
sync calls. So the engine lives on one loop owned by the model, on its own daemon thread; callers
hand it coroutines with ``asyncio.run_coroutine_threadsafe`` and await the result on their own
loop (:meth:`EngineLoop.run`) or block their own thread (:meth:`EngineLoop.call`).

Every request is a task on that loop. Identical queries in flight share one request
(:meth:`EngineLoop.join`); when every caller of a request has been cancelled, its task is
cancelled and ``AsyncLLM.generate`` aborts it in the engine (``abort(request_id)``), before or
during compute. Everything that touches the registry runs on the loop thread, so it needs no lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from typing import Any, Awaitable, Callable, Hashable

from ...batching.batcher import BatcherClosed


class _Shared:
    __slots__ = ("task", "callers", "reason", "tag")

    def __init__(self, task: asyncio.Task, tag: Hashable = None):
        self.task = task
        self.callers = 0
        # set when reset/close cancels it: a message (the callers get BatcherClosed) or the
        # exception to give them (a removed LoRA adapter: ValueError)
        self.reason = None
        self.tag = tag  # the adapter key of its request (None: the base model)


class EngineLoop:
    """Build ``AsyncLLM.from_engine_args(engine_args)`` on a new loop thread and serve it.

    Raises:
        whatever building the engine raised (the thread is stopped again).
    """

    def __init__(self, engine_args, name: str = "genback-vllm-engine"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()
        self._inflight: dict[Hashable, _Shared] = {}
        self._ids = itertools.count()
        self.closed = False
        self.requests = 0  # engine requests started
        self.cancelled = 0  # requests cancelled (every caller left, reset, close): aborted in vLLM
        self.engine = None
        before = _children()
        try:
            self.engine = self.call(self._build(engine_args))
        except BaseException:
            self._stop()
            _reap([p for p in _children().values() if p.pid not in before], timeout=30)
            raise
        # the engine's processes (engine core, workers), so that close can see them gone
        self.processes = [p for pid, p in _children().items() if pid not in before]

    @staticmethod
    async def _build(engine_args):
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(engine_args)  # on this loop: its output handler too

    # -- handing work to the loop -----------------------------------------------------------------

    def submit(self, coro) -> concurrent.futures.Future:
        if self.closed:
            coro.close()
            raise BatcherClosed("the model was closed (aclose); no more queries are served")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro) -> Any:
        """Await ``coro`` (run on the engine loop) from any other loop; cancelling the caller
        cancels it."""
        return await asyncio.wrap_future(self.submit(coro))

    def call(self, coro) -> Any:
        """Run ``coro`` on the engine loop and block this thread for its result.

        Raises:
            RuntimeError: called on the engine loop's own thread.
        """
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("a blocking AsyncVirtualLM call was made on its engine thread")
        return self.submit(coro).result()

    # -- requests (these run on the engine loop) ---------------------------------------------------

    async def join(self, key: Hashable, make: Callable[[], Awaitable], tag: Hashable = None
                   ) -> Any:
        """The result of the in-flight task ``key``, started as ``make()`` if there is none;
        ``tag`` (an adapter key) lets :meth:`cancel_tagged` find it.

        Raises:
            asyncio.CancelledError: this caller was cancelled (the task is cancelled, and its
                vLLM request aborted, once no caller is left).
            BatcherClosed: :meth:`reset` or :meth:`close` cancelled the task.
            ValueError: :meth:`cancel_tagged` cancelled it (its adapter was removed).
        """
        entry = self._inflight.get(key)
        if entry is None or entry.task.done() or entry.reason is not None:
            entry = self._inflight[key] = _Shared(asyncio.ensure_future(make()), tag)
            entry.task.add_done_callback(lambda t, k=key: self._forget(k, t))
        entry.callers += 1
        try:
            return await asyncio.shield(entry.task)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling() or entry.reason is None:
                raise  # this caller was cancelled
            if isinstance(entry.reason, BaseException):
                raise type(entry.reason)(*entry.reason.args) from None
            raise BatcherClosed(entry.reason) from None
        finally:
            entry.callers -= 1
            if entry.callers == 0 and not entry.task.done():
                self.cancelled += 1
                entry.task.cancel()  # nobody waits for it: abort the request

    @property
    def in_flight(self) -> int:
        """Requests in flight now (shared ones counted once)."""
        return len(self._inflight)

    def _forget(self, key: Hashable, task: asyncio.Task) -> None:
        entry = self._inflight.get(key)
        if entry is not None and entry.task is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: a failure nobody awaited is not logged as lost

    async def generate(self, prompt_ids, params, on_output: Callable | None = None,
                       lora_request=None):
        """One vLLM request to its end: the last ``RequestOutput`` (``on_output`` sees each),
        under ``lora_request`` (a ``vllm.lora.request.LoRARequest``, or None: the base model).

        Raises:
            RuntimeError: the engine failed this request (the message names vLLM and the cause).
        """
        from vllm.inputs import TokensPrompt

        request_id = f"genback-{next(self._ids)}"
        self.requests += 1
        last = None
        try:
            async for out in self.engine.generate(
                    TokensPrompt(prompt_token_ids=list(prompt_ids)), params, request_id,
                    lora_request=lora_request):
                if on_output is not None:
                    on_output(out)
                last = out
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise self.error(exc) from exc
        if last is None:
            raise RuntimeError(f"the vLLM engine ended request {request_id} without an output")
        return last

    def error(self, exc: BaseException) -> RuntimeError:
        """A ``RuntimeError`` naming vLLM and the cause of ``exc``."""
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        if isinstance(exc, EngineDeadError) or (self.engine is not None and self.engine.errored):
            return RuntimeError(
                "the vLLM engine failed: its engine process died or stopped (EngineDeadError); "
                "this model cannot serve more queries: close it and build a new one")
        cause = exc.__cause__ if isinstance(exc, EngineGenerateError) and exc.__cause__ else exc
        return RuntimeError(f"the vLLM engine failed on this request: "
                            f"{type(cause).__name__}: {cause}")

    async def _cancel_all(self, reason, tag: Hashable = None, tagged: bool = False) -> int:
        callers = 0
        for entry in list(self._inflight.values()):
            if not entry.task.done() and (not tagged or entry.tag == tag):
                entry.reason = reason
                callers += entry.callers
                self.cancelled += 1
                entry.task.cancel()
        return callers

    def reset(self, reason: str) -> int:
        """Cancel (abort) every in-flight request; their callers get ``BatcherClosed(reason)``.
        Returns how many callers were waiting. Safe from any thread but the loop's own."""
        if self.closed:
            return 0
        return self.call(self._cancel_all(reason))

    def cancel_tagged(self, tag: Hashable, error: BaseException) -> int:
        """Cancel (abort) the in-flight requests joined with ``tag``; their callers get a new
        exception like ``error``. Returns how many callers were waiting."""
        if self.closed:
            return 0
        return self.call(self._cancel_all(error, tag, tagged=True))

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Abort every request, shut the engine down (its processes exit), stop the thread.
        Idempotent."""
        if self.closed:
            return
        try:
            self.call(self._cancel_all("the model was closed (aclose) while this query ran"))
            self.call(self._shutdown())
        finally:
            self.closed = True
            self._stop()
            _reap(self.processes, timeout=30)

    async def _shutdown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def _children() -> dict:
    """This process's descendants by pid, without multiprocessing's helper processes (the
    resource tracker serves the whole interpreter)."""
    import psutil  # a vLLM dependency

    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if not any("resource_tracker" in part or "forkserver" in part for part in p.cmdline()):
                out[p.pid] = p
        except psutil.Error:  # already gone
            pass
    return out


def _reap(processes, timeout: float) -> None:
    """Wait up to ``timeout`` s for the engine's processes to exit after its shutdown, then kill
    the ones left (vLLM's workers exit on their own once the engine core is gone)."""
    import psutil

    def running(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout
    while any(map(running, processes)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in filter(running, processes):
        try:
            p.kill()
        except psutil.Error:
            pass
