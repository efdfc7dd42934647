"""genback's CPython-level speedups, in one place and behind one switch.

Four measured tricks that lean on how CPython lays out and tracks objects. Each is exact (it
changes no result, only the host time of serving), each checks itself and steps aside where its
facts do not hold (another implementation, a build without the GIL, a self-test that disagrees),
and all four are turned off together by the environment variable ``GENBACK_CPYTHON_SPEEDUPS=0``
(read at import; :data:`ENABLED`). Each checks its own premise at import, on the running
interpreter, by what it observes rather than by its version number (the object layout by a
comparison of known objects, untracking by ``gc.is_tracked``, the hold by counting the
collections that allocations start with the threshold low and raised, through ``gc.callbacks``),
and where a premise does not hold that trick steps aside, with a debug line on this module's
logger and its reason in :data:`STEPPED_ASIDE`. Tested (CI) on CPython 3.11 and 3.13 with the GIL
(every premise holds there, and on 3.12.1, checked by hand); each trick below names the versions
its gain was measured on (``benchmarks/history/issue-65.md``: the commands and numbers):

1. **Identity of a context's items** (:func:`same_items`). An SMC program extends each
   particle's context by one token per step and passes it as a new list (``context +
   [token]``), holding its parent's very int objects. The front checks it against its parent's
   validated tuple (:class:`genback.core.inputs.ContextChecker`) by comparing the two arrays of
   object pointers with C's ``memcmp`` (~1 us for 4,000 tokens) instead of ``tuple(ids) ==
   parent + (last,)`` (two new tuples, every item's reference count written two to three
   times: ~44 us per query for 256 contexts of 4,000 tokens on this project's CPU, measured).
   Equal pointers are identical objects, hence equal items; unequal pointers answer nothing and
   the caller compares values. It relies on CPython's layout (since 3.0): a tuple's item
   pointers follow its variable-size header (``tuple.__basicsize__`` bytes from ``id()``); a
   list's header is followed by a pointer to its item array; ``memcmp`` is called through
   ``ctypes.PyDLL``, which keeps the GIL held, so no other thread can resize the list meanwhile.
   Measured on 3.11 (above) and 3.13 (4,000 items, one loaded core: by identity 12 / 27 us, by
   value 294 / 242 us on 3.11 / 3.13).
2. **Untracking validated contexts** (:func:`untrack_ids`). A new tuple is tracked by the cyclic
   garbage collector until a collection finds only atomic items and untracks it
   (``_PyTuple_MaybeUntrack``), walking it three times first: ~6.5 ns per token (0.7 us per
   query at 100 tokens, 6.5 us at 1,000, ~100 us at 16,000). A tuple of exact ints can never be
   in a cycle, so ``PyObject_GC_UnTrack`` (through ``ctypes.pythonapi``, GIL held) does at once
   what that collection would do. Measured on 3.11 and 3.13 (a young collection after a new
   1,000-int tuple, one loaded core: 104 / 64 us tracked, 24 / 22 us untracked); its premise (a new tuple of ints is
   tracked, and the call untracks it) is checked at import: where tuples of atomic items are not
   tracked at creation there is nothing to do, and it steps aside.
3. **Freezing the startup heap** (:func:`freeze_startup_heap`). Loading torch, transformers and
   a model leaves ~0.5 million tracked objects; each full collection walks them all (~250 ms with
   transformers loaded, about 50 us per query of an SMC step averaged over a run,
   ``benchmarks/bench_host.py``). At the first model's construction every object alive is
   collected, then frozen (``gc.freeze``), as vLLM does after its server starts
   (``vllm.utils.gc_utils.freeze_gc_heap``). Frozen objects are still freed by reference
   counting; at exit they are unfrozen, so shutdown finalises them as usual. Measured on 3.11 and
   3.13 (torch and transformers loaded, one loaded core: a full collection 1,070 / 1,378 ms, then
   ~0 once frozen); its effect (frozen objects leave the generations a collection walks) is
   counted in the tests on each version.
4. **Young collections after the launch** (:func:`hold_collections`, :func:`forward_issued`).
   A young-generation collection runs when allocations outnumber deallocations by the first
   threshold (700 through 3.12, 2,000 from 3.13), wherever that happens, and walks every container made since the last one:
   in an SMC step, the caller's new context lists among them (256 lists of 4,000 ids are a
   million items). On a GPU, the host's work before a step's launch is serial with the device
   (``benchmarks/RESULTS.md``, session 61: a step is that work plus the GPU's), so a collection
   there lengthens the step, and one after the launch runs while the GPU computes. While a
   batch that may run on the event loop's thread (the batcher's ``inline_cohort``) is pending,
   the first threshold is raised (``gc.set_threshold``) so that allocation triggers no young
   collection; it is put back when the batch's first forward is issued (its kernels queued on
   the device), or when the batch leaves otherwise (dispatched to the worker thread, failed,
   reset), and the collection that was due runs at the next allocation. Nothing is ever
   disabled: if a batch is abandoned pending (its loop closed with it), collections only run
   :data:`HELD_THRESHOLD` allocations apart until the batcher serves another loop or closes. A
   threshold changed by the program meanwhile is left as it set it. On for CUDA models (on the
   CPU the forward is the host's own work, and a collection costs the same before or after it).
   Measured on this project's CPU (the way into a 256-query step, lists of 4,000 ids), on 3.11:
   12.2 ms with collections in it, 3.8-5.2 without; on 3.13 (threshold 2,000) the hold still
   takes them out of the way in (``benchmarks/history/issue-65.md``). Its premise (raising the
   first threshold defers the collections allocation starts) is counted at import.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import logging
import os
import sys
import sysconfig
import threading

ENABLED = os.environ.get("GENBACK_CPYTHON_SPEEDUPS", "1").strip().lower() not in (
    "0", "false", "no", "off")
"""Whether the speedups are on (the environment variable ``GENBACK_CPYTHON_SPEEDUPS``, read at
import; ``0`` turns all four off: contexts are compared by value, no tuple is untracked, the
heap is not frozen, no collection is held)."""

log = logging.getLogger(__name__)

STEPPED_ASIDE: dict[str, str] = {}
"""The tricks that are off in this process, by name (``"same_items"``, ``"untrack_ids"``,
``"freeze_startup_heap"``, ``"hold_collections"``), each with the reason (the switch, or a premise
that does not hold on this interpreter); empty where all four act."""

_PYTHON = f"{sys.implementation.name} {sys.version.split()[0]}"


def _step_aside(trick: str, why: str) -> None:
    STEPPED_ASIDE[trick] = why
    if ENABLED:
        log.debug("genback.cpython: %s steps aside on %s: %s", trick, _PYTHON, why)


if not ENABLED:
    for _trick in ("same_items", "untrack_ids", "freeze_startup_heap", "hold_collections"):
        _step_aside(_trick, "GENBACK_CPYTHON_SPEEDUPS=0")

# -- 1. identity of a context's items -----------------------------------------------------------

_HEADER = tuple.__basicsize__  # PyObject_VAR_HEAD: where a tuple's items / a list's ob_item lie
_POINTER = ctypes.sizeof(ctypes.c_void_p)


def _load_memcmp():
    if not ENABLED:
        return None
    if sys.implementation.name != "cpython":
        return _step_aside("same_items", "not CPython: its object layout is unknown here")
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return _step_aside("same_items", "a build without the GIL: a list may be resized meanwhile")
    try:
        fn = ctypes.PyDLL(None).memcmp  # PyDLL: the GIL stays held during the call
    except (OSError, AttributeError, TypeError) as e:
        return _step_aside("same_items", f"no memcmp through ctypes ({e})")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_memcmp = _load_memcmp()
_read_pointer = ctypes.c_void_p.from_address


def same_items(seq, tup: tuple, n: int) -> bool:
    """True when the first ``n`` items of ``seq`` (a list or a tuple, exactly) are the very
    objects of ``tup``'s first ``n`` (hence equal); False when they are not, or when that
    cannot be told this way (then compare values): on other types of ``seq``, and when ``n``
    is negative or longer than either (nothing is read past their items)."""
    kind = type(seq)
    if (_memcmp is None or (kind is not list and kind is not tuple) or type(tup) is not tuple
            or n < 0 or n > len(seq) or n > len(tup)):
        return False
    if n == 0:
        return True
    items = _read_pointer(id(seq) + _HEADER).value if kind is list else id(seq) + _HEADER
    return _memcmp(items, id(tup) + _HEADER, n * _POINTER) == 0


def _self_test() -> bool:
    a, b, c = object(), object(), object()
    return (same_items([a, b, c, a], (a, b, c), 3) and same_items((a, b), (a, b, c), 2)
            and not same_items([a, c, b], (a, b, c), 3) and not same_items([a, b], (a, c), 2))


if _memcmp is not None and not _self_test():  # (a layout this module does not know)
    _memcmp = None
    _step_aside("same_items", "the self-test of the list / tuple layout disagrees")

AVAILABLE = _memcmp is not None


# -- 2. untracking validated contexts ------------------------------------------------------------

def _gc_untrack():
    """``PyObject_GC_UnTrack`` of the running CPython, or None (another implementation, or its
    premise does not hold here: :data:`STEPPED_ASIDE`)."""
    if not ENABLED:
        return None
    if sys.implementation.name != "cpython":
        return _step_aside("untrack_ids", "not CPython")
    try:
        fn = ctypes.pythonapi.PyObject_GC_UnTrack
    except (ImportError, AttributeError, OSError) as e:
        return _step_aside("untrack_ids", f"no PyObject_GC_UnTrack through ctypes ({e})")
    fn.argtypes = [ctypes.py_object]
    fn.restype = None
    probe = tuple(range(1 << 20, (1 << 20) + UNTRACK_MIN))  # (ints beyond the small-int cache)
    if not gc.is_tracked(probe):
        return _step_aside("untrack_ids", "a new tuple of ints is not tracked: nothing to untrack")
    fn(probe)
    if gc.is_tracked(probe):
        return _step_aside("untrack_ids", "PyObject_GC_UnTrack left the tuple tracked")
    return fn
# shorter tuples cost the collector less than the call. Measured on this project's CPU (Python
# 3.11, one core): the call ~0.2 µs; the young collection that untracks a surviving tuple itself
# ~0.09 µs for 10 ints, 0.22 µs for 30, 0.69 µs for 100, 6.5 µs for 1,000 (about 6.5 ns per
# item: three passes over it). Break-even near 30 items.
UNTRACK_MIN = 32

_untrack = _gc_untrack()


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


# -- 3. freezing the startup heap -------------------------------------------------------------------

if ENABLED and not all(hasattr(gc, f) for f in ("freeze", "unfreeze", "get_freeze_count")):
    _step_aside("freeze_startup_heap", "this gc module cannot freeze")

_lock = threading.Lock()
_done = False


def freeze_startup_heap() -> bool:
    """Collect, then freeze every object tracked now (``gc.freeze``), once per process; later
    calls do nothing. Returns whether this call froze the heap (False when done already, or when
    the speedups are off: :data:`ENABLED`)."""
    global _done
    if not ENABLED or "freeze_startup_heap" in STEPPED_ASIDE:
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


# -- 4. young collections after the launch ----------------------------------------------------------

HELD_THRESHOLD = 100_000
"""The first threshold of ``gc.set_threshold`` while a batch holds collections (a step of
10,000 queries allocates fewer tracked objects than this)."""

_held = 0  # holds not yet released (every batcher, every thread)
_saved: tuple | None = None  # the thresholds before the first hold, while raised by us


class _Inline(threading.local):
    hold: CollectionHold | None = None  # the hold of the batch this thread computes inline


inline = _Inline()  # (read by a runner after each forward: an attribute, not a call)


class CollectionHold:
    """One batch's hold on young collections (:func:`hold_collections`); :meth:`release` puts
    the threshold back once no other hold remains. Releasing twice does nothing."""

    __slots__ = ("held",)

    def __init__(self):
        global _held, _saved
        with _lock:
            if _held == 0:
                now = gc.get_threshold()
                if 0 < now[0] < HELD_THRESHOLD:  # (0: the program turned collections off)
                    _saved = now
                    gc.set_threshold(HELD_THRESHOLD, *now[1:])
            _held += 1
        self.held = True

    def release(self) -> None:
        global _held, _saved
        if not self.held:
            return
        self.held = False
        with _lock:
            _held -= 1
            if _held == 0 and _saved is not None:
                if gc.get_threshold()[0] == HELD_THRESHOLD:  # (else the program changed it)
                    gc.set_threshold(*_saved)
                _saved = None


_PROBE = 100  # the first threshold of the import-time count (any young collection is ~1 us)


def _count_collections(threshold: int, allocations: int) -> int:
    """Collections started (``gc.callbacks``) while ``allocations`` new lists are made and kept,
    with the first threshold ``threshold``; the thresholds are put back."""
    started = []

    def note(phase, info):
        if phase == "start":
            started.append(info.get("generation"))
    saved = gc.get_threshold()
    try:
        gc.collect(0)  # (a young generation of ~0 objects: the count starts here)
        gc.callbacks.append(note)
        gc.set_threshold(threshold, *saved[1:])
        kept = []
        for _ in range(allocations):
            kept.append([])
        return len(started)
    finally:
        gc.set_threshold(*saved)
        if note in gc.callbacks:
            gc.callbacks.remove(note)


def _hold_premise() -> str | None:
    """None where raising the first threshold defers the collections that allocations start
    (counted: ``4 * _PROBE`` new lists start some with the threshold at ``_PROBE``, none with it at
    :data:`HELD_THRESHOLD`); else why not. Not counted when the program turned collections off
    (then nothing falls anywhere, and a hold only raises a threshold)."""
    if not gc.isenabled():
        return None
    low = _count_collections(_PROBE, 4 * _PROBE)
    if low == 0:
        return f"{4 * _PROBE} allocations started no collection at threshold {_PROBE}"
    held = _count_collections(HELD_THRESHOLD, 4 * _PROBE)
    if held:
        return f"{held} collection(s) started with the threshold at {HELD_THRESHOLD}"
    return None


if ENABLED:
    _why = _hold_premise()
    if _why is not None:
        _step_aside("hold_collections", _why)


def hold_collections() -> CollectionHold | None:
    """A new :class:`CollectionHold`, or None when the speedups are off (:data:`ENABLED`) or the
    hold's premise does not hold on this interpreter (:data:`STEPPED_ASIDE`)."""
    if not ENABLED or "hold_collections" in STEPPED_ASIDE:
        return None
    return CollectionHold()


def forward_issued() -> None:
    """A runner's first forward of a batch is issued: release the hold of the batch this thread
    computes inline, if any (the collection that was due runs after the launch)."""
    hold = inline.hold
    if hold is not None:
        inline.hold = None
        hold.release()


def release(hold: CollectionHold | None) -> None:
    """Release ``hold`` (None: nothing)."""
    if hold is not None:
        hold.release()


@contextlib.contextmanager
def held_inline(hold: CollectionHold):
    """While this thread computes the batch of ``hold`` inline: :func:`forward_issued` releases
    it; released at the end in any case."""
    inline.hold = hold
    try:
        yield
    finally:
        inline.hold = None
        hold.release()
