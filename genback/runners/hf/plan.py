"""Planning a batch against the KV tree: what each row forwards, which forwards, which segments.

* :class:`Row`: one query matched against the tree (its cached segments and new tokens).
* :func:`shared_prefixes` / :func:`nesting_levels`: uncached prefixes that several queries of a
  batch share, prefilled once each, shortest first.
* :func:`group_rows`: forwards sized by work — the tokens they forward (padding included) and the
  bytes their attention needs — never by the length of whole contexts.
* :func:`split_segments`: which cached segments a forward reads once for all rows below them
  (shared) and which it gathers per row (private).
"""

from __future__ import annotations

from ...query import Query


class Row:
    """A query planned against the tree: ``segments`` (``(node, k, kv)`` from ``KVTree.match``)
    hold the KV of ``tokens[:cached]``; the row forwards ``tokens[cached:]``."""

    __slots__ = ("query", "segments", "cached", "holder", "new_kv", "result")

    def __init__(self, query: Query, segments, cached: int, holder):
        self.query = query
        self.segments = segments
        self.cached = cached
        self.holder = holder
        self.new_kv = None
        self.result = None

    @property
    def n_new(self) -> int:
        return len(self.query.tokens) - self.cached


# what one forward costs by itself, in tokens of forward (measured on SmolLM2-135M fp32 on one CPU
# core: a 1-token forward ~30 tokens' worth of a long one, mostly reading the weights)
FORWARD_COST_TOKENS = 32


def group_rows(rows: list[Row], max_tokens: int, max_bytes: int,
               score_bytes_per_key: int) -> list[list[Row]]:
    """Split rows into forwards.

    Rows are sorted by new-token count (longest first); a forward grows while its right padding
    stays within ``max(FORWARD_COST_TOKENS, padded tokens / 16)`` (a forward costs about that
    many tokens by itself, reading the weights: padding beyond it costs more than a forward of
    its own), its padded new tokens stay within ``max_tokens`` and the
    attention scores of its private part (``rows * new * (longest cached + new) *
    score_bytes_per_key``, an upper bound) within ``max_bytes``. A single row may exceed both
    (it is forwarded alone). Decode steps (one new token each) share one forward up to the
    limits, however long their contexts.
    """
    order = sorted(rows, key=lambda r: r.n_new, reverse=True)
    groups: list[list[Row]] = []
    group: list[Row] = []
    longest = real = 0
    past = 0
    for r in order:
        m = r.n_new
        if group:
            size = len(group) + 1
            p = max(past, r.cached)
            waste = size * longest - (real + m)
            if (waste > max(FORWARD_COST_TOKENS, size * longest // 16)
                    or size * longest > max_tokens
                    or size * longest * (p + longest) * score_bytes_per_key > max_bytes):
                groups.append(group)
                group = []
        if not group:
            longest, real, past = m, 0, 0
        group.append(r)
        real += m
        past = max(past, r.cached)
    if group:
        groups.append(group)
    return groups


def split_segments(rows: list[Row], min_shared_tokens: int):
    """Decide which cached segments a forward attends to once for all rows below them.

    A segment (a node's first ``k`` tokens) used by ``n >= 2`` rows is shared when the copies it
    saves, ``(n - 1) * k`` tokens, reach ``min_shared_tokens``: below that, the per-segment
    kernel launches and merges cost more than gathering it per row.

    Returns:
        ``(shared, private)``: ``shared`` a list of ``(kv, row indices)``; ``private`` one list
        per row of its other segments' KV tensors (as ``KVTree.match`` gave them: a node's own
        ``kv`` when the whole edge is used, so its identity lasts across forwards; see
        :class:`.past_pool.PastPool`).
    """
    users: dict[tuple, list[int]] = {}
    kvs: dict[tuple, object] = {}
    for i, r in enumerate(rows):
        for node, k, kv in r.segments:
            key = (id(node), k)
            users.setdefault(key, []).append(i)
            kvs[key] = kv
    shared, shared_keys = [], set()
    for key, idx in users.items():
        if len(idx) >= 2 and (len(idx) - 1) * key[1] >= min_shared_tokens:
            shared.append((kvs[key], idx))
            shared_keys.add(key)
    private = [[kv for node, k, kv in r.segments if (id(node), k) not in shared_keys]
               for r in rows]
    return shared, private


def shared_prefixes(contexts: list[tuple[int, ...]], cached_length, min_gain: int = 2):
    """Prefixes that two or more contexts share beyond their cached part (at least ``min_gain``
    tokens beyond it), distinct and sorted; forwarding them once first saves re-forwarding them
    for every context (e.g. the first step of particles that all extend one uncached prompt)."""
    if len(contexts) < 2:
        return []
    order = sorted(contexts)  # equal contexts of several queries share all but their last token
    lcp = [0] * len(order)  # lcp[i]: common prefix length of order[i-1] and order[i]
    for i in range(1, len(order)):
        a, b = order[i - 1], order[i]
        n = min(len(a), len(b))
        k = 0
        while k < n and a[k] == b[k]:
            k += 1
        lcp[i] = k
    found = set()
    for i, tokens in enumerate(order):
        share = max(lcp[i], lcp[i + 1] if i + 1 < len(order) else 0)
        share = min(share, len(tokens) - 1)  # the last token is forwarded by the query itself
        if share >= min_gain and share - cached_length(tokens[:share]) >= min_gain:
            found.add(tokens[:share])
    return sorted(found)


def nesting_levels(prefixes: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Split sorted, distinct ``prefixes`` into levels: level k holds those with exactly k proper
    prefixes among the others (a prefix sorts before its extensions, so one stack pass does it)."""
    levels: list[list[tuple[int, ...]]] = []
    stack: list[tuple[int, ...]] = []
    for p in prefixes:
        while stack and p[: len(stack[-1])] != stack[-1]:
            stack.pop()
        if len(stack) == len(levels):
            levels.append([])
        levels[len(stack)].append(p)
        stack.append(p)
    return levels
