"""Whether a list or tuple starts with the very objects of a tuple, compared in C without
touching the objects.

An SMC program extends each particle's context by one token per step and passes it as a new
list (``context + [token]``). The front checks it against its parent's validated context
(:class:`genback.core.inputs.ContextChecker`: the flat ``base`` tuple of a
:class:`genback.context.Context`); the caller's list holds the parent's very int
objects (it was built from the list the parent came from), so the check is a question of
identity. Asked in Python (``tuple(ids) == parent + (last,)``) it costs two new tuples, one
freed again, and a comparison: every one of the context's int objects has its reference count
written two to three times, scattered through memory (~44 us per query for 256 contexts of 4,000
tokens on this project's CPU, measured, ~11 ms per SMC step). :func:`same_items` instead
compares the two arrays of object pointers with C's ``memcmp`` (~1 us for 4,000 tokens):
equal pointers are identical objects, so the items are equal; unequal pointers answer
nothing (equal ints may be distinct objects) and the caller compares values as before.

Layout facts it relies on (CPython, every version since 3.0): a tuple's item pointers follow
its variable-size object header (``tuple.__basicsize__`` bytes from the object's address, which
is ``id()``); a list's header is followed by a pointer to its item array. It calls ``memcmp``
through ``ctypes.PyDLL``, which keeps the GIL held, so no other thread can resize the list
meanwhile. :data:`AVAILABLE` is False, and :func:`same_items` always returns False, on other
implementations, on builds without the GIL, where ``memcmp`` cannot be found, and when a
self-test at import disagrees with Python's own comparison.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig

_HEADER = tuple.__basicsize__  # PyObject_VAR_HEAD: where a tuple's items / a list's ob_item lie
_POINTER = ctypes.sizeof(ctypes.c_void_p)


def _load_memcmp():
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    try:
        fn = ctypes.PyDLL(None).memcmp  # PyDLL: the GIL stays held during the call
    except (OSError, AttributeError, TypeError):
        return None
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

AVAILABLE = _memcmp is not None
