"""Freezing the Python heap that exists once a model is loaded, so that garbage collection stops
rescanning it.

Loading torch, transformers and a model leaves ~0.5 million objects tracked by Python's cyclic
garbage collector. Serving allocates many small objects (queries, futures, rows), which triggers
collections; each full (oldest-generation) collection walks every tracked object: ~250 ms per
collection with transformers loaded, measured on this project's CPU, about 50 µs per query of an
SMC step averaged over a run (``benchmarks/bench_host.py``). ``gc.freeze()`` moves every object
alive now into a permanent generation that collections skip. vLLM does the same after its server
starts (``vllm.utils.gc_utils.freeze_gc_heap``: collect every generation, then freeze).

Objects frozen are still freed by reference counting; only cyclic garbage among them would never
be collected (everything unreachable is collected first); at exit they are unfrozen again. Set
``GENBACK_GC_FREEZE=0`` to keep the collector as it is.

Validated contexts are tuples of ints, created per query (an SMC step's context is its parent's
tuple plus one token). A new tuple is tracked by the collector until the first collection that
sees it finds only atomic items and untracks it (CPython's ``_PyTuple_MaybeUntrack``); until then
that collection walks it three times, item by item: about 6.5 ns per token (0.7 µs per query at
100 tokens, 6.5 µs at 1,000, ~100 µs at 16,000), more than the rest of the query's host work for
long contexts. :func:`untrack_ids` does at once what that collection would do, with the C API's
``PyObject_GC_UnTrack`` (through ``ctypes.pythonapi``, which holds the GIL during the call).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading

_lock = threading.Lock()
_done = False


def freeze_startup_heap() -> bool:
    """Collect, then freeze every object tracked now (``gc.freeze``), once per process; later
    calls do nothing. Returns whether this call froze the heap (False when done already, or when
    the environment variable ``GENBACK_GC_FREEZE`` is ``0``)."""
    global _done
    if os.environ.get("GENBACK_GC_FREEZE", "1").strip() in ("0", "false", "no", "off"):
        return False
    with _lock:
        if _done:
            return False
        _done = True
        gc.collect()
        gc.freeze()
        # at exit, hand the frozen objects back to the collector, so that interpreter shutdown
        # finalises them as usual (extension modules report objects never finalised as leaks)
        atexit.register(gc.unfreeze)
        return True


def _gc_untrack():
    """``PyObject_GC_UnTrack`` of the running CPython, or None (another implementation)."""
    if sys.implementation.name != "cpython":
        return None
    try:
        import ctypes

        fn = ctypes.pythonapi.PyObject_GC_UnTrack
    except (ImportError, AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.py_object]
    fn.restype = None
    return fn


_untrack = _gc_untrack()
# shorter tuples cost the collector less than the call. Measured on this project's CPU (Python
# 3.11, one core): the call ~0.2 µs; the young collection that untracks a surviving tuple itself
# ~0.09 µs for 10 ints, 0.22 µs for 30, 0.69 µs for 100, 6.5 µs for 1,000 (about 6.5 ns per
# item: three passes over it). Break-even near 30 items.
UNTRACK_MIN = 32


def untrack_ids(ids: tuple) -> tuple:
    """Stop the cyclic garbage collector from tracking ``ids`` and return it.

    ``ids`` must be a tuple whose items are all exact ``int`` objects (a validated context): such a
    tuple can never be part of a reference cycle, and CPython's own collector untracks it at the
    first collection that sees it, after walking it. Tuples shorter than :data:`UNTRACK_MIN`, and
    every tuple on an interpreter other than CPython, are returned as they are. Raises
    ``TypeError`` when ``ids`` is not a tuple.
    """
    if type(ids) is not tuple:
        raise TypeError(f"ids must be a tuple of ints, got {type(ids).__name__}")
    if _untrack is not None and len(ids) >= UNTRACK_MIN and gc.is_tracked(ids):
        _untrack(ids)
    return ids
