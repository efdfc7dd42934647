"""Checks of the requests a session is handed: a malformed request fails alone, with a
``TypeError`` / ``ValueError`` that names the field and shows the bad value (never a Python
internal such as ``'int' object has no attribute 'startswith'``).

The session reads attributes only, so Evalution's own request dataclasses pass as well as
genback's; anything without the fields of its kind is rejected by type.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["check_loglikelihood_request", "check_rolling_request", "check_generation_request",
           "token_ids", "check_batch_size"]

_LL_FIELDS = ("context", "continuation", "context_input_ids", "continuation_input_ids")


def _show(value) -> str:
    text = repr(value)
    return f"{type(value).__name__}: {text if len(text) <= 80 else text[:77] + '...'}"


def _kind(request, kind: str, fields: tuple[str, ...]) -> None:
    if isinstance(request, (str, bytes)) or not all(hasattr(request, f) for f in fields):
        raise TypeError(f"a request must be a {kind} (fields {', '.join(fields)}), got "
                        f"{_show(request)}")


def _text(value, name: str, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str{' or None' if optional else ''}, got "
                        f"{_show(value)}")


def token_ids(value, name: str) -> list[int] | None:
    """``value`` as a list of non-negative ints, or None when it is None.

    A list or tuple of exact ints (what a tokenizer returns) is checked in C: the set of its
    items' types and its minimum, no Python step per id (a 100-id list: ~3 us, where an
    ``isinstance`` per id took ~30 us); a 1-D integer NumPy array by its dtype and minimum.
    Anything else (NumPy ints in a list, a bool, a float) takes the per-id check, which names
    the first bad item.

    Raises:
        TypeError: not a list / tuple of ints (a str, bytes, bool or float included).
        ValueError: a negative id.
    """
    if value is None:
        return None
    kind = type(value)
    if kind is list or kind is tuple:
        if not value:
            return []
        if {*map(type, value)} == _INT and min(value) >= 0:  # (C-level)
            return list(value)
    elif (kind is np.ndarray and value.ndim == 1 and value.dtype.kind in "iu"
          and (not value.size or value.min() >= 0)):
        return value.tolist()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of int token ids, got {_show(value)}")
    out = []
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name}[{i}] must be an int token id, got {_show(t)}")
        if t < 0:
            raise ValueError(f"{name}[{i}] must be a token id >= 0, got {t}")
        out.append(int(t))
    return out


_INT = {int}


def _metadata(request) -> None:
    meta = getattr(request, "metadata", None)
    if meta is not None and not isinstance(meta, dict):
        raise TypeError(f"metadata must be a dict, got {_show(meta)}")


def check_loglikelihood_request(request) -> tuple[list[int] | None, list[int] | None]:
    """Check that ``request`` looks like a ``LoglikelihoodRequest`` whose ``context`` /
    ``continuation`` are str (or None) and whose id fields are int lists (or None); return
    the two id fields as checked by :func:`token_ids` (``(context_ids, continuation_ids)``).

    Raises:
        TypeError: a malformed request or field. ValueError: a negative id.
    """
    _kind(request, "LoglikelihoodRequest", _LL_FIELDS)
    _text(request.context, "context")
    _text(request.continuation, "continuation")
    ctx = token_ids(request.context_input_ids, "context_input_ids")
    cont = token_ids(request.continuation_input_ids, "continuation_input_ids")
    _metadata(request)
    return ctx, cont


def check_rolling_request(request) -> list[int] | None:
    """Check that ``request`` looks like a ``RollingLoglikelihoodRequest``; return its
    ``input_ids`` as checked by :func:`token_ids` (None when it has none).

    Raises:
        TypeError: a malformed request or field. ValueError: a negative id.
    """
    _kind(request, "RollingLoglikelihoodRequest", ("text", "input_ids"))
    _text(request.text, "text")
    ids = token_ids(request.input_ids, "input_ids")
    _metadata(request)
    return ids


def check_generation_request(request) -> list[str]:
    """Check a ``GenerationRequest``'s fields; return its stop strings as a list.

    Raises:
        TypeError: a field of the wrong type (``prompt`` not a str, ``stop`` not a str or a list
            of str, ``messages`` not a list of dicts, ...).
        ValueError: ``max_new_tokens`` < 0.
    """
    _kind(request, "GenerationRequest", ("prompt", "messages", "rendered_prompt", "input_ids",
                                         "stop", "max_new_tokens"))
    _text(request.prompt, "prompt")
    _text(request.rendered_prompt, "rendered_prompt")
    messages = request.messages
    if messages is not None and (isinstance(messages, (str, bytes))
                                 or not isinstance(messages, (list, tuple))
                                 or not all(isinstance(m, dict) for m in messages)):
        raise TypeError(f"messages must be a list of dicts (role, content), got {_show(messages)}")
    token_ids(request.input_ids, "input_ids")
    max_new = request.max_new_tokens
    if isinstance(max_new, bool) or not isinstance(max_new, numbers.Integral):
        raise TypeError(f"max_new_tokens must be an int >= 0, got {_show(max_new)}")
    if max_new < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new!r}")
    stop = request.stop if request.stop is not None else []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise TypeError(f"stop must be a str or a list of str, got {_show(request.stop)}")
    _metadata(request)
    return list(stop)


def check_batch_size(batch_size) -> None:
    """Raises ``ValueError`` unless ``batch_size`` (a call's requests in flight) is None or a
    positive int."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
