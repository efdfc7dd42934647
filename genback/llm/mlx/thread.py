"""The MLX thread: one daemon thread of the process that runs all of genback's MLX work.

MLX keeps state per thread: its streams (an array made on one thread cannot be evaluated on
another), and since mlx 0.32 its cache of compiled functions (``mx.compile``; mlx-lm compiles
e.g. its SwiGLU). A thread's exit destroys that cache from a C++ thread-exit destructor that
takes the GIL to release the Python objects it holds. If the thread exits while the interpreter
shuts down, as a ``ThreadPoolExecutor`` worker does when the process ends or just after
``shutdown()``, the destructor cannot take the GIL, the thread is unwound through a
``noexcept`` frame and the process aborts after its work is done ("terminate called without
an active exception", exit status 134; about one run in ten on Linux with mlx 0.32.4). The MLX
developers' answer is that a thread must clean up its MLX state itself before it ends
(ml-explore/mlx#4327).

This thread never ends: a daemon, idle between calls, so its MLX state lives as long as the
process and no thread exit ever tears it down. Every runner of the process shares it (MLX work of
two models runs one call at a time, in the order submitted). After ``os.fork`` the child starts a
thread of its own on its first call.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_thread: threading.Thread | None = None
_work: queue.SimpleQueue | None = None
_pid: int | None = None


def _run(future: Future, fn: Callable, args: tuple) -> None:
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - the caller re-raises it
            future.set_exception(exc)


def _serve(work: queue.SimpleQueue) -> None:
    while True:
        _run(*work.get())  # nothing of a call is held between calls


def _queue() -> queue.SimpleQueue:
    """The MLX thread's work queue, starting the thread on the first call of this process."""
    global _thread, _work, _pid
    with _lock:
        if _work is None or _pid != os.getpid():
            _work, _pid = queue.SimpleQueue(), os.getpid()
            _thread = threading.Thread(target=_serve, args=(_work,), name="genback-mlx",
                                       daemon=True)
            _thread.start()
        return _work


def on_mlx_thread(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` run on the MLX thread; its result, or its exception raised here.

    Blocks the calling thread until ``fn`` returns. A call made from the MLX thread itself runs
    ``fn`` at once (no deadlock).
    """
    if threading.current_thread() is _thread:
        return fn(*args)
    future: Future = Future()
    _queue().put((future, fn, args))
    return future.result()
