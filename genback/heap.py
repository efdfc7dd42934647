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
"""

from __future__ import annotations

import atexit
import gc
import os
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
