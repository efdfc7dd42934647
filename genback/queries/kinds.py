"""The kinds of question a batch asks a backend runner, each with its result type.

| kind | asks | result |
|---|---|---|
| `NextToken` | the next-token distribution after `tokens` | float32 `[V]` log-probs |
| `Score` | log-probs of `targets`, a continuation, at the last `len(targets)` positions | float32 `[n]`; with `greedy` also bool `[n]` argmax flags |
| `Prefill` | only the KV of `tokens` (kept by runners with a KV cache) | None |
| `Step` | a decoding step: a token chosen after `tokens` on the model's device | `genback.queries.sampling.Choice` |

Every kind has ``tokens`` (a tuple of ints; ``context``, the same ids as given: a tuple, or the
front's :class:`~genback.queries.context.Context`, whose flat tuple is built only when ``tokens`` is
read), ``adapter`` (None for the base model, else the runner's
key of a LoRA adapter: the same tokens under two adapters are two different queries),
``n_tokens`` (``len(tokens)``, kept) and ``n_outputs`` (how many positions' logits it needs:
the last ``n_outputs`` positions of ``tokens``).

The front and the planners never test a query's type: they ask the query.

| question | attribute | NextToken | Score | Prefill | Step |
|---|---|---|---|---|---|
| is its result a row the output cache keeps? | `cacheable` | yes | no | no | no |
| is it answered by the logits of its last position alone? | `at_end` | yes | no | no | yes |
| how does it split when too large for one forward? | `slices(n)` | itself | slices of `n` targets | itself | itself |
| how do the results of its pieces join? | `join(parts)` | the last | concatenated | the last | the last |

Only a runner turns logits into each kind's result, in one place of each runner (the HF
runner's :mod:`genback.llm.hf.forward.results`).

Queries are immutable and hashable. Their hash covers a context's length and last
:data:`HASH_TAIL` tokens only (:func:`context_hash`), so it costs the same for 100 tokens as for
16,000; equality still compares whole contexts (in C), so two contexts that agree on their tails
are merely a hash collision, never confused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .context import flat

if TYPE_CHECKING:
    from .context import Context
    from .sampling import Pick


HASH_TAIL = 32  # tokens of a context's end that its hash covers


def context_hash(tokens: tuple[int, ...]) -> int:
    """Hash of a context: its length and its last :data:`HASH_TAIL` tokens (independent of its
    length in cost). Equal contexts have equal hashes; the converse need not hold."""
    return hash((len(tokens), tokens[-HASH_TAIL:]))


class Query:
    """Base of the query kinds: ``tokens`` (tuple of ints) and ``adapter`` (None or an int key).

    Not constructed directly; see :class:`NextToken`, :class:`Score`, :class:`Prefill`,
    :class:`Step`. Every kind takes:

    Args:
        tokens: the context: a tuple of ints, or a validated
            :class:`~genback.queries.context.Context` (whose flat tuple is built only when read).
        adapter: None (the base model) or a runner's adapter key.
        tokens_hash: ``context_hash(tokens)`` when the caller has it (the front's check
            computes it), else computed here.
        parent: the lineage hint: a context known to equal ``tokens[:-1]``, the very object an
            earlier query had as its context, so a runner may find that query's KV by identity
            (not part of equality or the hash).
        n_tokens: ``len(tokens)`` when the caller has it (the front's check), else computed
            here; kept as :attr:`n_tokens` (read by the planners without a call of a context's
            ``__len__``).
    """

    __slots__ = ("context", "adapter", "tokens_hash", "_hash", "parent", "n_tokens")
    n_outputs = 1
    cacheable = False
    """Whether its result is a next-token row the output cache keeps."""
    at_end = True
    """Whether it is answered by the logits of its context's last position alone (one output,
    at the end: a decode step's row)."""

    def __init__(self, tokens: "tuple[int, ...] | Context", adapter: int | None = None, *,
                 tokens_hash: int | None = None, parent: "tuple | Context | None" = None,
                 n_tokens: int | None = None):
        self.n_tokens = len(tokens) if n_tokens is None else n_tokens
        # the ids as given: a tuple, or a validated Context (the front's, for a next-token
        # query: its flat tuple is built only when asked for, see genback.queries.context)
        self.context = tokens
        self.adapter = adapter
        # a context known to equal tokens[:-1] (checked when the context was validated), the
        # very object an earlier query had as its context: a runner may find that query's KV by
        # identity instead of comparing the context (not part of equality or the hash)
        self.parent = parent
        # context_hash(tokens): given when known (the front's check computed it; a Step is
        # built with its NextToken's), not hashed again
        self.tokens_hash = context_hash(tokens) if tokens_hash is None else tokens_hash
        self._hash = hash((type(self).__name__, self.tokens_hash, adapter) + self.extra)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The context's ids as a flat tuple (a :class:`~genback.queries.context.Context`'s is built at
        the first call, then kept)."""
        return flat(self.context)

    extra: tuple = ()
    """What else but the context and the adapter makes two queries of one kind differ (a score's
    targets, a step's pick): part of equality and the hash (set before ``Query.__init__``)."""

    def slices(self, n: int) -> list["Query"]:
        """The queries that answer this one's outputs in slices of at most ``n`` positions each
        (the last pieces of a query too large for one forward; their KV before them is
        computed first): ``[self]`` but for a :class:`Score`."""
        return [self]

    def join(self, parts: list):
        """This query's result from the results of :meth:`slices`, in order (the results of
        KV-only pieces before them, None, left out): the last one, or None for none."""
        return parts[-1] if parts else None

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (
            type(other) is type(self) and self._hash == other._hash
            and self.adapter == other.adapter and self.extra == other.extra
            and (self.context is other.context or self.context == other.context))

    def __repr__(self) -> str:
        toks = self.tokens if len(self.tokens) <= 8 else (*self.tokens[:4], "...", *self.tokens[-2:])
        return f"{type(self).__name__}(tokens={toks} ({len(self.tokens)}), adapter={self.adapter})"


class NextToken(Query):
    """The next-token log-prob row after ``tokens``: float32 ``[V]``, log-normalised."""

    __slots__ = ()
    cacheable = True

    @classmethod
    def many(cls, contexts: list, adapter, hashes: list, parents: list, lengths: list
             ) -> list["NextToken"]:
        """The queries ``NextToken(contexts[i], adapter, tokens_hash=hashes[i],
        parent=parents[i], n_tokens=lengths[i])`` of a step, built without a call of
        ``__init__`` each (its keywords cost ~0.5 us a query)."""
        new, out, name = object.__new__, [], cls.__name__
        append = out.append
        for context, h, parent, n in zip(contexts, hashes, parents, lengths):
            q = new(cls)
            q.context, q.adapter, q.parent, q.tokens_hash, q.n_tokens = (
                context, adapter, parent, h, n)
            q._hash = hash((name, h, adapter))  # (as __init__'s: no extra)
            append(q)
        return out

    def without_parent(self) -> "NextToken":
        """An equal query without the lineage hint ``parent`` (``self`` when it has none): the
        key the output cache keeps, so that a cached row does not keep its parent context
        alive. Copies the fields (~0.2 us; building a new query re-hashes: ~0.6 us)."""
        if self.parent is None:
            return self
        key = object.__new__(NextToken)
        key.context, key.adapter, key.parent = self.context, self.adapter, None
        key.tokens_hash, key._hash, key.n_tokens = self.tokens_hash, self._hash, self.n_tokens
        return key


class Prefill(Query):
    """Compute and keep the KV of ``tokens`` (a prompt pinned by ``cache_kv``, a prefix several
    queries share, a chunk of a query too large for one forward). Result: None."""

    __slots__ = ()
    n_outputs = 0
    at_end = False


class Score(Query):
    """Log-probs of ``targets`` at the last ``len(targets)`` positions of ``tokens + targets[-1:]``.

    For a continuation after a context: ``tokens = context + continuation[:-1]``, ``targets =
    continuation``. Result: float32 ``[n]`` (``n = len(targets) >= 1``); with ``greedy`` the pair
    ``(logprobs float32 [n], is_greedy bool [n])``, ``is_greedy[i]`` telling whether
    ``targets[i]`` is the argmax of its position's logits (both from the same forward).
    """

    __slots__ = ("targets", "greedy", "extra")
    at_end = False

    def __init__(self, tokens: tuple[int, ...], targets: tuple[int, ...],
                 adapter: int | None = None, greedy: bool = False):
        if not 1 <= len(targets) <= len(tokens):
            raise ValueError(f"Score needs 1 to len(tokens) targets, got {len(targets)} for "
                             f"{len(tokens)} tokens")
        self.targets = tuple(targets)
        self.greedy = bool(greedy)
        self.extra = (self.targets, self.greedy)
        super().__init__(tokens, adapter)

    @property
    def n_outputs(self) -> int:
        return len(self.targets)

    def slices(self, n: int) -> list["Score"]:
        """Consecutive slices of at most ``n`` targets, each over the tokens up to its slice."""
        L, k = len(self.tokens), len(self.targets)
        return [Score(self.tokens[:L - k + min(k, a + n)], self.targets[a:a + n], self.adapter,
                      self.greedy) for a in range(0, k, n)]

    def join(self, parts: list):
        """The slices' log-probs (and greedy flags) concatenated in order."""
        import torch  # (importing the query kinds does not import torch)

        if self.greedy:
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        return torch.cat(parts)


class Step(Query):
    """A decoding step: the :class:`~genback.queries.sampling.Choice` that :func:`genback.queries.sampling.choose`
    makes from the logits after ``tokens`` as ``pick`` says, on the model's device (only the
    token and the asked-for log-probs leave it). Runners that answer it declare ``picks``."""

    __slots__ = ("pick", "extra")

    def __init__(self, tokens: tuple[int, ...], pick: "Pick", adapter: int | None = None, *,
                 tokens_hash: int | None = None, parent: "tuple | Context | None" = None,
                 n_tokens: int | None = None):
        self.pick = pick
        self.extra = (pick,)
        super().__init__(tokens, adapter, tokens_hash=tokens_hash, parent=parent,
                         n_tokens=n_tokens)

