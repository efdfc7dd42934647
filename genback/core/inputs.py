"""Validation of caller input: token ids, options. Errors name the argument and the bad value."""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Sequence
import operator
from itertools import islice, repeat
from typing import NoReturn

import numpy as np
import torch

from ..queries.context import Context, exact_ints
from ..cpython import same_items, untrack_ids
from ..queries.kinds import HASH_TAIL, context_hash

_parent_of, _vocab_of, _n_of = map(operator.attrgetter, ("parent", "vocab", "_n"))
_is, _sub = operator.is_, operator.sub
_ONLY_CONTEXT, _ONE = {Context}, {1}


def check_token_ids(
    token_ids, vocab_size: int, name: str = "token_ids", allow_empty: bool = False
) -> tuple[int, ...]:
    """Return ``token_ids`` as a tuple of Python ints after checking them.

    Accepts a list or tuple of ints (NumPy integers too), a :class:`~genback.queries.context.Context`,
    or a 1-D integer NumPy array or torch tensor (any device).

    Raises:
        TypeError: ``token_ids`` is not a sequence of integers (a str, floats, bools, a 2-D array).
        ValueError: it is empty (unless ``allow_empty``) or an id lies outside ``[0, vocab_size)``.
    """
    if isinstance(token_ids, (list, tuple, Context)):
        ids = token_ids.tokens if type(token_ids) is Context else tuple(token_ids)
        if set(map(type, ids)) - {int}:  # (C-level: no per-id Python frame)
            ids = exact_ints(ids, name)
    elif isinstance(token_ids, (torch.Tensor, np.ndarray)):
        ids = _array_ids(token_ids, name)
    else:
        raise TypeError(
            f"{name} must be a list of int token ids, got {type(token_ids).__name__}: "
            f"{_short(token_ids)}"
        )
    if not ids:
        if allow_empty:
            return ids
        raise ValueError(f"{name} must be non-empty, got {_short(token_ids)}")
    if min(ids) < 0 or max(ids) >= vocab_size:  # (C-level)
        _raise_out_of_vocab(ids, vocab_size, name)
    return ids


def _array_ids(array, name: str) -> tuple[int, ...]:
    """A 1-D integer NumPy array or torch tensor (any device) as a tuple of ints.

    Raises:
        TypeError: a float, complex or bool dtype. ValueError: not 1-D.
    """
    dtype = array.dtype
    is_int = (
        (not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool)
        if isinstance(array, torch.Tensor)
        else np.issubdtype(dtype, np.integer)
    )
    if not is_int:
        raise TypeError(f"{name} must hold integer token ids, got an array of dtype {dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one context), got shape {tuple(array.shape)}")
    return tuple(array.tolist())


def _raise_out_of_vocab(ids: tuple[int, ...], vocab_size: int, name: str,
                        offset: int = 0) -> NoReturn:
    """``ValueError`` naming the first id of ``ids`` outside ``[0, vocab_size)`` (at index
    ``offset`` + its index in ``ids``)."""
    i, t = next((i, t) for i, t in enumerate(ids) if t < 0 or t >= vocab_size)
    raise ValueError(f"{name}[{offset + i}] = {t} is outside the vocabulary [0, {vocab_size})")


# contexts of at least this many tokens are compared with a validated context's base by identity
# first (genback.cpython.same_items, ~0.6 us whatever the length); shorter ones by value. By
# value touches every int object (the copy raises each one's reference count): 256 contexts of
# 100 tokens whose ints are distinct objects cost 8.6 us per check by value, 2.8 by identity;
# with a shared prompt's ints (hot) 2.5 and 2.7 (measured on this project's CPU)
IDENTITY_MIN = 64


class ContextChecker:
    """:func:`check_token_ids` for contexts, with a memory of the contexts it validated.

    A context equal to one validated recently, or extending one by a single token (an SMC step,
    a decoding step), is checked in work that does not grow with its length in Python: its
    hash (its last :data:`~genback.queries.kinds.HASH_TAIL` ids), one comparison in C and the new
    token's check, instead of a pass over every id. Validated contexts are kept as
    :class:`~genback.queries.context.Context` s: an extension shares its parent's flat ``base`` and
    adds the token to a short tail, so no step copies a whole context
    (:mod:`genback.queries.context`). The validated object itself is returned (equal ids that are not
    plain ints, such as NumPy ints, come back as the ints validated before), with its hash, so
    a query built from it never hashes the context again.

    Args:
        vocab_size: ids must lie in ``[0, vocab_size)``.
        max_contexts: most validated contexts remembered (least recently used dropped first);
            the memory holds references to contexts that the output cache and queries mostly
            hold anyway, and extensions share their bases.

    Every flat tuple of at least :data:`genback.cpython.UNTRACK_MIN` tokens is untracked by the
    cyclic garbage collector (:func:`genback.cpython.untrack_ids`): it holds exact ints only, and a
    long context would otherwise be walked by the next collection.

    Thread-safe for its purpose: a lost update under concurrent use only costs a full check.
    """

    def __init__(self, vocab_size: int, max_contexts: int = 4096):
        self.vocab_size = vocab_size
        self.max_contexts = max_contexts
        # hash(context) -> the validated context (keyed by an int: a dict lookup by a long tuple
        # costs several times its hash plus one comparison)
        self._seen: OrderedDict[int, Context] = OrderedDict()

    def __call__(self, token_ids, name: str = "token_ids") -> tuple[int, ...]:
        """Checked ``token_ids`` as a tuple of ints; raises as :func:`check_token_ids`."""
        return self.check(token_ids, name)[0]

    def check(self, token_ids, name: str = "token_ids"
              ) -> tuple[tuple[int, ...], int, Context | None]:
        """:meth:`check_context` with the context as a flat tuple of ints.

        Raises:
            TypeError / ValueError: as :func:`check_token_ids`.
        """
        ctx, h, parent = self.check_context(token_ids, name)
        return ctx.tokens, h, parent

    def check_context(self, token_ids, name: str = "token_ids"
                      ) -> tuple[Context, int, Context | None]:
        """``(context, context_hash(ids), parent)``: checked ``token_ids`` as a
        :class:`~genback.queries.context.Context`, its hash (:func:`genback.queries.kinds.context_hash`,
        independent of the context's length in cost) and, when ``ids`` extends a remembered
        context by one token, that context (``parent == ids[:-1]``, compared here; else None).

        A list or tuple that holds the very int objects of a remembered context's base (an SMC
        program's ``context + [token]``) is compared with it by identity in C
        (:func:`genback.cpython.same_items`, no reference count touched); otherwise, and the
        tail always, by value.

        Raises:
            TypeError / ValueError: as :func:`check_token_ids`.
        """
        kind = type(token_ids)
        if kind is Context:
            return self._check_object(token_ids, name)
        if (kind is list or kind is tuple) and token_ids:
            try:
                n = len(token_ids)
                # context_hash of the context, without copying it
                h = hash((n, tuple(token_ids[-HASH_TAIL:]) if kind is list
                          else token_ids[-HASH_TAIL:]))
                hit = self._seen.get(h)
                if hit is not None and hit._n == n and _starts_with(token_ids, hit):
                    self._touch(h)
                    return hit, h, None
                last = token_ids[-1]
                if type(last) is int and 0 <= last < self.vocab_size:
                    head = token_ids[-HASH_TAIL - 1:-1]  # (context_hash of ids[:-1])
                    parent = self._seen.get(hash((n - 1, tuple(head) if kind is list else head)))
                    if (parent is not None and parent._n == n - 1
                            and _starts_with(token_ids, parent)):
                        hit = parent.extend(last)  # the caller's context
                        self._remember(h, hit)
                        return hit, h, parent
            except TypeError:  # an unhashable element: the full check names it
                pass
        return self._check_new(token_ids, name)

    def _check_object(self, ctx: Context, name: str) -> tuple[Context, int, Context | None]:
        """:meth:`check_context` of a caller's :class:`~genback.queries.context.Context`: its ids are
        checked once per model vocabulary (a context checked already is taken as it is; one
        made by ``+`` from a checked one has only its added ids checked), then it is
        remembered itself, and the context it extends by one token is its parent."""
        parent = ctx.parent
        vocab = self.vocab_size
        if not 0 < ctx.vocab <= vocab:
            if parent is not None and 0 < parent.vocab <= vocab and parent._n == ctx._n - 1:
                # (a checked context plus one id, an SMC step: that id alone)
                last = (ctx.tail or ctx.base)[-1]
                if not 0 <= last < vocab:
                    _raise_out_of_vocab((last,), vocab, name, parent._n)
                ctx.vocab = vocab
            elif not self._checked_chain(ctx, name):  # (not ints: made otherwise than by a model)
                return self._check_new(ctx.tokens, name)
        ctx.parent = None  # (checked: nothing before it is kept alive by it)
        h = hash((ctx._n, ctx.last(HASH_TAIL)))  # (context_hash)
        self._remember(h, ctx)
        if parent is not None and (parent._n != ctx._n - 1 or not 0 < parent.vocab <= vocab):
            parent = None
        return ctx, h, parent

    def check_step(self, contexts: list) -> tuple[list, list, list, list] | None:
        """:meth:`check_context` of a step's contexts at once, when each is a caller's
        :class:`~genback.queries.context.Context` made by ``+`` of one id from a context checked
        for this vocabulary (an SMC step over ``lm.context`` objects): ``(contexts, hashes,
        parents, lengths)`` (the contexts themselves), each context marked checked and
        remembered, as one call of :meth:`check_context` each would leave them, but in array
        passes (the parents, their lengths and the added ids read by C-level getters; the ids'
        range by ``min`` and ``max``). None, with nothing changed, when any context is not such
        a one (the caller checks them one by one then, and names a bad one). Plain lists are
        checked one by one: the same passes over lists (each parent by its hash, its items by
        identity in C, the context made by ``extend``) measured no faster (7-10 µs a list
        either way, this project's CPU, session 68)."""
        if len(contexts) < 2:
            return None
        if set(map(type, contexts)) != _ONLY_CONTEXT:  # (lists: one by one, as fast, measured)
            return None
        parents = list(map(_parent_of, contexts))
        if any(map(_is, parents, repeat(None))) or any(map(_vocab_of, contexts)):
            return None
        vocab = self.vocab_size
        checked = list(map(_vocab_of, parents))
        if min(checked) <= 0 or max(checked) > vocab:
            return None
        lengths = list(map(_n_of, contexts))
        if set(map(_sub, lengths, map(_n_of, parents))) != _ONE:
            return None
        added = [(c.tail or c.base)[-1] for c in contexts]
        if min(added) < 0 or max(added) >= vocab:
            return None
        for c in contexts:  # (checked: nothing before it is kept alive by it)
            c.vocab, c.parent = vocab, None
        hashes = [hash((c._n, c.tail[-HASH_TAIL:] if len(c.tail) >= HASH_TAIL
                        else c.base[len(c.tail) - HASH_TAIL:] + c.tail)) for c in contexts]
        self._remember_many(hashes, contexts)
        return contexts, hashes, parents, lengths

    def _remember_many(self, hashes: list, contexts: list) -> None:
        """:meth:`_remember` of each context at once (a hash seen before keeps its place)."""
        seen = self._seen
        seen.update(zip(hashes, contexts))
        for _ in range(len(seen) - self.max_contexts):
            try:
                seen.popitem(last=False)
            except KeyError:  # emptied meanwhile by another thread
                break

    def _checked_chain(self, ctx: Context, name: str) -> bool:
        """Check ``ctx`` and the contexts it was made from by ``+`` back to one checked for this
        vocabulary (or to the first, checked whole): each one's added ids only; mark them
        checked. False when the first one's items are not exact ints (nothing marked).

        Raises:
            TypeError / ValueError: as :func:`check_token_ids` (the first bad id named by its
            index in ``ctx``)."""
        vocab = self.vocab_size
        chain = []
        c = ctx
        while c is not None and not 0 < c.vocab <= vocab:
            chain.append(c)
            c = c.parent  # (read once: another thread may be checking it too)
        if c is None:  # (nothing checked before the first: all its ids)
            first = chain.pop()
            flat = first.tokens
            if check_token_ids(flat, vocab, name) is not flat:
                return False
            first.vocab = vocab
        for c in reversed(chain):  # (oldest first: each one's parent is checked by now)
            parent = c.parent
            if parent is None:  # (checked meanwhile on another thread)
                continue
            start = parent._n
            added = c[start:]
            if min(added) < 0 or max(added) >= vocab:  # (C-level)
                _raise_out_of_vocab(added, vocab, name, start)
            c.vocab = vocab
            if c is not ctx:
                c.parent = None
        return True

    def _check_new(self, token_ids, name: str) -> tuple[Context, int, None]:
        """The full check of a context not remembered (:func:`check_token_ids`): ``(context,
        its hash, None)``; the context is remembered."""
        ids = check_token_ids(token_ids, self.vocab_size, name)
        h = context_hash(ids)
        ctx = Context(untrack_ids(ids), (), self.vocab_size)  # (exact ints: untracked)
        self._remember(h, ctx)
        return ctx, h, None

    def _touch(self, h: int) -> None:
        try:
            self._seen.move_to_end(h)
        except KeyError:  # evicted meanwhile by another thread: it is only a memory
            pass

    def _remember(self, h: int, ctx: Context) -> None:
        seen = self._seen
        if h in seen:  # (another context of this hash: replaced, and now the most recent)
            seen[h] = ctx
            self._touch(h)
        else:  # (a new key goes last: the most recent already)
            seen[h] = ctx
        while len(seen) > self.max_contexts:
            try:
                seen.popitem(last=False)
            except KeyError:  # emptied meanwhile by another thread
                break

    def clear(self) -> None:
        self._seen.clear()


def _starts_with(seq, ctx: Context) -> bool:
    """Whether list or tuple ``seq`` starts with validated ``ctx``'s ids: its base by the
    identity of the base's items when it is at least :data:`IDENTITY_MIN` long
    (:func:`genback.cpython.same_items`), else, or when the objects differ, by value; its
    tail by value."""
    base, tail = ctx.base, ctx.tail
    b = len(base)
    if not (b >= IDENTITY_MIN and same_items(seq, base, b)):
        if base != (seq[:b] if type(seq) is tuple else tuple(islice(seq, b))):
            return False
    return not tail or tail == tuple(seq[b:b + len(tail)])


def check_positive_int(value, name: str) -> int:
    """Raise ``ValueError`` unless ``value`` is an int > 0 (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_list(token_ids_list, name: str) -> list:
    """``token_ids_list`` as a non-empty list of contexts (each checked later, by the caller).

    Raises:
        TypeError: not a sequence (a str or bytes included); the message names ``name``.
        ValueError: an empty one.
    """
    if isinstance(token_ids_list, (str, bytes)) or not isinstance(token_ids_list, Sequence):
        raise TypeError(
            f"{name} must be a list of token-id lists, got {type(token_ids_list).__name__}"
        )
    if len(token_ids_list) == 0:
        raise ValueError(f"{name} must hold at least one context, got an empty list")
    return list(token_ids_list)


def model_eos_ids(tokenizer, eos_token_ids, vocab_size: int) -> frozenset[int]:
    """``eos_token_ids`` (checked ids in ``[0, vocab_size)``) and the tokenizer's EOS, if any.

    Raises:
        TypeError / ValueError: a bad id (the message names ``eos_token_ids``).
    """
    eos = set(check_token_ids(list(eos_token_ids), vocab_size, "eos_token_ids",
                              allow_empty=True))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    return frozenset(eos)


def check_lora(lora_name) -> None:
    """The check of a model with no LoRA adapter loaded: any adapter name is an error."""
    if lora_name is not None:
        raise ValueError(
            f"lora_name={lora_name!r}: this model has no LoRA adapters loaded; pass "
            "lora_name=None (AsyncTransformer / AsyncVirtualLM: register one with add_new_lora)"
        )


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
