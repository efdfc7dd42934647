"""The forward budget: what one forward may hold, and a query too large for one forward split
into queries that each fit (chunked prefill, then its targets in slices)."""

from __future__ import annotations

from typing import Callable

from ....queries.kinds import Prefill, Query
from .batch import Path, query_path


class ForwardBudget:
    """What one forward may hold: ``max_bytes`` of working set, counted as attention scores
    (``score_bytes`` per query position and key: float32 x heads, where the kernel materialises
    them), activations (``token_bytes`` per forwarded token, where scores are not what bounds
    a forward) plus logits (``logit_bytes`` per output position: float32 x vocabulary).
    ``packed``: the forward's rows are packed end to end (no padding: :mod:`..forward.varlen`),
    so rows of any lengths share a forward (:func:`.batch.group_paths`)."""

    def __init__(self, max_bytes: int, score_bytes: int, logit_bytes: int, token_bytes: int = 0,
                 packed: bool = False):
        self.max_bytes, self.score_bytes, self.logit_bytes = max_bytes, score_bytes, logit_bytes
        self.token_bytes, self.packed = token_bytes, packed

    def working_set(self, n_new: int, length: int, n_outputs: int) -> int:
        """Upper bound of one row's forward working set in bytes: attention scores of ``n_new``
        queries over ``length`` keys (materialised by the masked kernels), the activations of
        its ``n_new`` tokens, plus the logits of ``n_outputs`` positions."""
        return (n_new * length * self.score_bytes + n_new * self.token_bytes
                + n_outputs * self.logit_bytes)

    def piece_paths(self, q: Query, cached: Callable[[Query, int], int]) -> list[Path] | None:
        """:meth:`pieces` as the paths that run them, one forward each, in order (matched when
        each runs: the KV of the pieces before it is in the tree by then); the only output of
        path ``k`` is piece ``k``, as ``Output(k, piece, len(piece.tokens))``.

        Raises:
            ValueError: as :meth:`pieces`.
        """
        pieces = self.pieces(q, cached)
        return None if pieces is None else [query_path(p, k) for k, p in enumerate(pieces)]

    def pieces(self, q: Query, cached: Callable[[Query, int], int]) -> list[Query] | None:
        """None when ``q`` fits in one forward, else the queries that answer it in forwards
        that each fit: KV-only prefills of its uncached context in chunks, then its targets in
        consecutive slices (each a query over the tokens up to its slice; the KV of the earlier
        ones is in the tree, so each forwards only its own tokens). ``cached(q, limit)``: how
        many tokens of ``q``'s context are cached (at most ``limit``), asked only when ``q``
        would not fit with nothing cached.

        Raises:
            ValueError: not even one output position fits in ``max_bytes``.
        """
        L, n_out = len(q.tokens), q.n_outputs
        limit = self.max_bytes
        if self.working_set(L, L, n_out) <= limit:  # fits even with nothing cached
            return None
        done = cached(q, L - n_out)
        if self.working_set(L - done, L, n_out) <= limit:
            return None
        per_position = self.working_set(1, L, 1)
        if per_position > limit:
            raise ValueError(
                f"a query of {L} tokens needs about {per_position:,} bytes for one position's "
                f"forward, more than max_forward_bytes={limit:,}; raise max_forward_bytes")
        # half the limit each for a prefill chunk and a target slice, which may share a forward
        chunk = max(1, limit // max(1, 2 * (L * self.score_bytes + self.token_bytes)))
        prefills: list[Query] = [Prefill(q.tokens[:end], q.adapter)
                                 for end in range(done + chunk, L - n_out + 1, chunk)]
        return prefills + q.slices(max(1, limit // (2 * per_position)))


def forward_budget(config, max_bytes: int, kernel: str | None, kv_heads: int) -> ForwardBudget:
    """The :class:`ForwardBudget` of a model (its transformers ``config``) whose tree forwards'
    private attention runs in ``kernel`` (:func:`..forward.varlen.kernel_for`; ``kv_heads``:
    the KV pool's heads, when the config names no query heads).

    ``kernel`` None (the masked kernels: the CPU, the dense path) counts the scores they
    materialise, float32 x query heads per query and key, and no activations (as before issue
    66: unchanged on the CPU). A varlen kernel (``"flash"``, ``"efficient"``, ``"reference"``)
    materialises no scores: a forward is bounded by its tokens' activations, float32 x
    ``3 * intermediate_size + 4 * hidden_size`` per token (the MLP's gate, up and product,
    and the residual stream's copies), and its rows are packed."""
    heads = getattr(config, "num_attention_heads", kv_heads)
    logit_bytes = 4 * int(getattr(config, "vocab_size", 0) or 0)
    if kernel is None:
        return ForwardBudget(max_bytes, 4 * heads, logit_bytes)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    inner = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    return ForwardBudget(max_bytes, 0, logit_bytes, 4 * (3 * inner + 4 * hidden), packed=True)
