"""No autocast around genback's forwards: the calling thread's ``torch.autocast`` never changes
the rows genback computes."""

from __future__ import annotations

import contextlib

import torch

# device types whose thread-local autocast is switched off around genback's forwards
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


class no_autocast:
    """Run the ``with`` block with ``torch.autocast`` off on every device type that the calling
    thread has it on (a no-op, ~1 µs, when none has). A batch may run on the caller's thread (a
    step whose cohort is in, :mod:`genback.batching.batcher`; ``ask_sync``; ``pin``), and the caller's
    autocast, a thread-local setting, must not change genback's rows: they are the model's own
    dtype's, as on the worker thread. (A class, not a generator: fewer calls per batch.)"""

    __slots__ = ("stack",)

    def __enter__(self):
        on = [d for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
        self.stack = None
        if on:
            with contextlib.ExitStack() as stack:  # (what entered is exited if one fails)
                for d in on:
                    stack.enter_context(torch.autocast(d, enabled=False))
                self.stack = stack.pop_all()

    def __exit__(self, *exc) -> None:
        if self.stack is not None:
            self.stack.close()
