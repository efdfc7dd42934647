"""``Context``: a validated context held as a shared flat prefix plus a short tail of tokens.

An SMC program asks, at every step, for each particle's context plus one token. Held as one
tuple per context, every step copies each particle's whole context into a new tuple (``parent +
(token,)``: every id's reference count written, and again when the tuple is freed): ~18 us per
query at 4,000 tokens on this project's CPU, measured, and O(length) per step whatever else is
done. A :class:`Context` shares its parent's ``base`` tuple and adds the token to a short
``tail``, so a one-token extension costs O(:data:`TAIL_MAX`); once the tail is full, the next
extension starts a new flat base (one O(length) copy per :data:`TAIL_MAX` steps). It is the
rope of string libraries (Boehm, Atkinson and Plass, 1995, "Ropes: an alternative to
strings"), kept to two pieces.

The front's memory of validated contexts (:class:`genback.core.inputs.ContextChecker`) makes
them; a query carries one as its :attr:`genback.queries.kinds.Query.context`, and its flat tuple
(:attr:`Context.tokens`) is built only when something asks for it (then kept): the HF runner's
uniform decode step reads a context's length, its last token and a slice of its tail only.

Callers hold them too (``lm.context(ids)``, then ``ctx + [token]`` each step): a context made by
``+`` remembers the context it extends until a model has checked it, so the model checks only the
tokens added (:meth:`genback.core.inputs.ContextChecker.check_context`), and a step's check costs
the same at 100 tokens as at 100,000. A list of the same ids is compared item by item instead
(its items could have changed since the last step).
"""

from __future__ import annotations

import numbers
from itertools import chain

from ..cpython import untrack_ids

# most tokens a context's tail holds; the next extension copies base + tail into a new base
TAIL_MAX = 64


class Context:
    """Token ids ``base + tail``, immutable: a sequence of ints with tuple equality.

    Args:
        base: a tuple of exact ints (shared by the contexts that extend it).
        tail: a short tuple of exact ints after ``base``.
        vocab: the context's ids are known to lie in ``[0, vocab)`` (a model with a
            vocabulary of at least ``vocab`` ids takes it unchecked); 0: not checked yet.

    ``len``, indexing, :meth:`extend` and ``+`` cost nothing that grows with the context, a slice
    what a tuple's slice costs; slices with a step, comparison with another context or a
    tuple, and ``hash`` build the flat tuple once (:attr:`tokens`). Equal to a tuple or
    context of the same ids; hashes as that tuple. Made by a model (``lm.context(ids)``, or
    the front for each query), not directly.
    """

    __slots__ = ("base", "tail", "_n", "_flat", "vocab", "parent")

    def __init__(self, base: tuple, tail: tuple = (), vocab: int = 0):
        self.base = base
        self.tail = tail
        self._n = len(base) + len(tail)
        self._flat = None if tail else base
        self.vocab = vocab
        # the context this one extends, made by ``+`` and not checked yet (dropped once a model
        # has checked this one: a chain of contexts is never kept alive)
        self.parent: Context | None = None

    @property
    def tokens(self) -> tuple:
        """The ids as one flat tuple (built at the first call, then kept)."""
        flat = self._flat
        if flat is None:
            flat = self._flat = untrack_ids(self.base + self.tail)
        return flat

    def extend(self, token: int) -> "Context":
        """This context plus ``token`` (a checked id): the same ``base`` and a longer tail,
        or, when the tail holds :data:`TAIL_MAX` tokens, a new flat base; checked as this one
        is."""
        tail = self.tail
        if len(tail) < TAIL_MAX:  # (mostly: what _joined does, one call less per query)
            return Context(self.base, tail + (token,), self.vocab)
        return self._joined((token,), self.vocab)

    def _joined(self, extra: tuple, vocab: int) -> "Context":
        if len(self.tail) + len(extra) <= TAIL_MAX:
            return Context(self.base, self.tail + extra, vocab)
        flat = self._flat
        return Context(untrack_ids((flat if flat is not None else self.base + self.tail) + extra),
                       (), vocab)

    def __add__(self, other) -> "Context":
        """``ctx + [token, ...]`` (a list or tuple of ints; NumPy integers become ints): the
        longer context, in O(added tokens) but once every :data:`TAIL_MAX` tokens. A model
        checks only the added ids when it is asked (their range: ``ValueError`` there).

        Raises:
            TypeError: ``other`` is not a list or tuple of integers (bools refused).
        """
        kind = type(other)
        if kind is not list and kind is not tuple:
            return NotImplemented
        extra = tuple(other)
        if not extra:
            return self
        if set(map(type, extra)) - {int}:  # (C-level for plain ints)
            extra = exact_ints(extra, "the ids added")
        out = self._joined(extra, 0)
        out.parent = self
        return out

    def last(self, k: int) -> tuple:
        """The last ``k`` ids (``k >= 1``; all of them when there are fewer) as a tuple, in
        O(``k``): ``ctx[-k:]`` without a slice's general case."""
        tail = self.tail
        if len(tail) >= k:
            return tail[-k:]
        return self.base[len(tail) - k:] + tail

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        b = len(self.base)
        if type(index) is int:
            if index < 0:
                index += self._n
                if index < 0:
                    raise IndexError("Context index out of range")
            return self.base[index] if index < b else self.tail[index - b]
        if not isinstance(index, slice):
            raise TypeError(f"Context indices must be ints or slices, not "
                            f"{type(index).__name__}")
        start, stop, step = index.indices(self._n)
        if step == 1:
            if stop <= start:
                return ()
            if start >= b:
                return self.tail[start - b:stop - b]
            if stop <= b:
                return self.base[start:stop]
            return self.base[start:] + self.tail[:stop - b]
        return self.tokens[index]

    def __iter__(self):
        return chain(self.base, self.tail)

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if type(other) is Context:
            if other._n != self._n:
                return False
            if other.base is self.base:
                return other.tail == self.tail
            return self.tokens == other.tokens
        if type(other) is tuple:
            return len(other) == self._n and self.tokens == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.tokens)

    def __repr__(self) -> str:
        return f"Context({self._n} tokens, tail {len(self.tail)})"


def exact_ints(ids: tuple, name: str = "token_ids") -> tuple[int, ...]:
    """``ids`` (a tuple holding some non-``int`` items) as plain ints (NumPy integers
    converted), or ``TypeError`` naming the first item that is not an integer (bools
    included)."""
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(
                f"{name}[{i}] must be an int token id, got {type(t).__name__}: {t!r}"
            )
    return tuple(int(t) for t in ids)


def last_ids(contexts) -> list[int]:
    """Each context's last id (tuples and :class:`Context` objects, none empty), in one
    comprehension: no Python frame per context (a step's inputs and its commit read them
    for every row)."""
    return [c[-1] if type(c) is not Context else (c.tail or c.base)[-1] for c in contexts]


def flat(tokens) -> tuple:
    """``tokens`` (a tuple, a :class:`Context` or another sequence of ints) as a flat tuple."""
    kind = type(tokens)
    if kind is tuple:
        return tokens
    return tokens.tokens if kind is Context else tuple(tokens)
