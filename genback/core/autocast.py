"""No autocast around genback's forwards: the calling thread's ``torch.autocast`` never changes
the rows genback computes."""

from __future__ import annotations

import contextlib

import torch

# device types whose thread-local autocast is switched off around genback's forwards
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


@contextlib.contextmanager
def no_autocast():
    """Run the block with ``torch.autocast`` off on every device type that the calling thread
    has it on (a no-op, ~1 µs, when none has). A batch may run on the caller's thread (a step
    whose cohort is in, :mod:`genback.batcher`; ``ask_sync``; ``pin``), and the caller's
    autocast, a thread-local setting, must not change genback's rows: they are the model's own
    dtype's, as on the worker thread."""
    on = [d for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    if not on:
        yield
        return
    with contextlib.ExitStack() as stack:
        for d in on:
            stack.enter_context(torch.autocast(d, enabled=False))
        yield
