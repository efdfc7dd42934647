"""The host benchmarks' clocks (``bench_host.py``'s module docstring says what each measures):
the model's forward timed by hooks, Python's cyclic collections, every thread's CPU, and a
measured step's accumulated clocks around one call of :func:`ask`."""

from __future__ import annotations

import asyncio
import gc
import statistics
import threading
import time

import torch


class ForwardTimer:
    """Times the model's ``forward`` with a pre-hook and a hook on the top-level module: wall
    (``perf_counter``) and CPU (``thread_time`` of the thread that runs it), and which threads."""

    def __init__(self, model):
        self.wall = self.cpu = 0.0
        self.calls = 0
        self.threads: set[int] = set()
        self.cpu_by_thread: dict[int, float] = {}  # forward CPU by the thread that ran it
        self._start = threading.local()
        self._handles = [model.register_forward_pre_hook(self._pre),
                         model.register_forward_hook(self._post)]

    def _pre(self, module, args):
        self._start.t = (time.perf_counter(), time.thread_time())

    def _post(self, module, args, output):
        wall, cpu = self._start.t
        self.wall += time.perf_counter() - wall
        cpu = time.thread_time() - cpu
        self.cpu += cpu
        self.calls += 1
        me = threading.get_ident()
        self.threads.add(me)
        self.cpu_by_thread[me] = self.cpu_by_thread.get(me, 0.0) + cpu

    def remove(self):
        for h in self._handles:
            h.remove()


class GcClock:
    """Wall time spent in Python's cyclic garbage collections (``gc.callbacks``), whichever
    thread runs them (a collection holds the interpreter, so they never overlap)."""

    def __init__(self):
        self.total = 0.0
        self.collections = 0
        self._t = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.total += time.perf_counter() - self._t
            self.collections += 1
            self._t = None

    def remove(self):
        gc.callbacks.remove(self._callback)


def _thread_cpu() -> dict[int, float]:
    """CPU seconds of every live thread but the caller's, by ``threading.get_ident()``."""
    out = {}
    me = threading.get_ident()
    for t in threading.enumerate():
        if t.ident is None or t.ident == me:
            continue
        try:
            out[t.ident] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, ValueError, OverflowError):
            pass
    return out


class StepClock:
    """Accumulates the clocks of the measured steps (see the module docstring)."""

    FIELDS = ("wall", "fwd_wall", "fwd_cpu", "fwd_caller", "caller", "worker", "process",
              "forwards", "queries", "steps", "gc")

    def __init__(self, timer: ForwardTimer, lm, gc_clock: GcClock | None = None,
                 api: str = "gather"):
        self.timer, self.lm = timer, lm
        self.gc = gc_clock
        self.api = api
        self.t = dict.fromkeys(self.FIELDS, 0.0)
        self.host_steps: list[float] = []  # each step's host seconds (wall less forward wall)

    async def step(self, contexts):
        timer, lm = self.timer, self.lm
        f0, fw0, fc0 = lm.cache_info()["forwards"], timer.wall, timer.cpu
        me = threading.get_ident()
        fm0 = timer.cpu_by_thread.get(me, 0.0)  # (a step run on the loop's own thread)
        threads0 = _thread_cpu()
        g0 = self.gc.total if self.gc else 0.0
        p0, c0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        rows = await ask(lm, contexts, self.api)
        w1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
        threads1 = _thread_cpu()
        t = self.t
        t["wall"] += w1 - w0
        t["caller"] += c1 - c0
        t["process"] += p1 - p0
        t["fwd_wall"] += timer.wall - fw0
        t["fwd_cpu"] += timer.cpu - fc0
        t["fwd_caller"] += timer.cpu_by_thread.get(me, 0.0) - fm0
        t["worker"] += sum(threads1[i] - threads0.get(i, 0.0) for i in threads1
                           if i in timer.threads)
        t["forwards"] += lm.cache_info()["forwards"] - f0
        t["queries"] += len(contexts)
        t["steps"] += 1
        t["gc"] += (self.gc.total if self.gc else 0.0) - g0
        self.host_steps.append((w1 - w0) - (timer.wall - fw0))
        return as_rows(rows)

    def per_query(self) -> dict:
        t, q = self.t, max(self.t["queries"], 1)
        us = 1e6 / q
        host = t["wall"] - t["fwd_wall"]
        # forwards run on the worker thread, or on the caller's (a batch run inline: see
        # genback.batching.batcher): each thread's CPU outside them
        caller = t["caller"] - t["fwd_caller"]
        worker = t["worker"] - (t["fwd_cpu"] - t["fwd_caller"])
        other = t["process"] - t["caller"] - t["worker"]
        return dict(wall=t["wall"] * us, fwd=t["fwd_wall"] * us, host=host * us,
                    caller=caller * us, worker=worker * us, other=other * us,
                    idle=(host - caller - worker - other) * us,
                    share=host / t["wall"] if t["wall"] else 0.0, gc=t["gc"] * us,
                    fwd_per_step=t["forwards"] / max(t["steps"], 1), queries=int(t["queries"]),
                    host_med=statistics.median(self.host_steps) * 1e3 if self.host_steps
                    else 0.0)


async def ask(lm, contexts, api: str = "gather"):
    """One step's rows: ``gather`` of one ``next_token_logprobs`` per context (what llamppl's
    particles do; ``coroutine``: each wrapped in a coroutine of its own; ``context``: the
    contexts are ``lm.context`` objects, asked alike), or one ``batch_next_token_logprobs``
    call (``batch``, genlm-control's ``PromptedLLM``; ``batch-context`` over ``lm.context``
    objects: its ``[N, V]`` tensor, which :func:`as_rows` unbinds for the trace after the
    step's clocks have stopped)."""
    if api in ("batch", "batch-context"):
        return await lm.batch_next_token_logprobs(contexts)
    if api == "coroutine":
        return await asyncio.gather(*(_awaited(lm.next_token_logprobs(c)) for c in contexts))
    return await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))


def as_rows(rows):
    """A step's rows as the trace reads them: a batch call's ``[N, V]`` tensor unbound into its
    rows (the caller's work, outside the step's clocks: a tensor object a row, ~1.2 µs each
    on this project's CPU, was counted as genback's host time before session 68)."""
    return rows.unbind(0) if isinstance(rows, torch.Tensor) else rows


async def _awaited(awaitable):
    """``--api coroutine``: a query wrapped in a coroutine of its own (a task each in a gather,
    and a second coroutine per query since ``next_token_logprobs`` is a coroutine function
    again, issue 67)."""
    return await awaitable
