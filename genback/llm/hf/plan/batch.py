"""Planning a batch against the KV tree, as plain data: which token paths each forward runs, and
which query outputs each path answers.

* :class:`Path`: one token sequence a forward extends beyond its cached prefix (a row of the
  forward's input batch), with the :class:`Output` s it answers. A query whose tokens are a prefix
  of a longer path of the batch is answered by that path, at its own positions: a forward computes
  logits at every position it forwards, so the 256 nested prefixes of one sequence cost one path.
* :func:`plan_step`: the plan of a uniform decode step (an SMC or decoding step: every query one
  token after a context whose KV ends at a tree node), matched in O(1) per query from the
  tree's notes (:class:`..cache.ends.Ends`), with no grouping, sorting or budget check per query.
* :func:`plan_batch`: the levels of any other batch: KV-only prefills of uncached prefixes that several
  paths share (shortest first), then the paths that answer the queries. Each query is matched
  against the tree once; prefixes are compared only on their uncached suffixes, in C (tuple
  slices and comparisons), never token by token in Python.
* :func:`group_paths`: forwards sized by work — the tokens they forward (padding included) and the
  bytes their attention needs — never by the length of whole contexts.
* :class:`.budget.ForwardBudget`: a query too large for one forward becomes the queries that answer it
  in forwards that fit (chunked prefill, then its targets in slices).

Which cached segments a forward reads once for all paths below them is decided per forward, over
the union of its paths (:func:`.segments.split_segments`).
"""

from __future__ import annotations

import operator
from typing import Callable

from ....queries.kinds import Query
from ..cache.nodes import common_prefix_length
from ..cache.nodes import prefix_segments


class Output:
    """Query ``query`` (index ``index`` of the batch), answered by a path at ``tokens[:end]`` of
    it: its logits are those of the path's positions ``end - query.n_outputs .. end - 1``.
    (A plain class with slots: one is made per query, and a frozen dataclass costs ~1 µs more
    to build.)"""

    __slots__ = ("index", "query", "end")

    def __init__(self, index: int, query: Query, end: int):
        self.index, self.query, self.end = index, query, end

    def __repr__(self) -> str:
        return f"Output(index={self.index}, end={self.end}, query={self.query!r})"


class Path:
    """A token sequence one forward extends: the tree's path down to ``holder`` (the node
    ``KVTree.match`` ended in, held by the runner while the path is in use) holds the KV of
    ``tokens[:cached]``; the forward computes ``tokens[cached:]`` and the logits ``outputs``
    need. ``limit``: how far its cached prefix may reach (its first needed position).

    A plan's paths are not changed once planned, but for their match, which is set once: by
    the planner (``match`` here, or :meth:`matched`), or, for a path after a prefill level or a
    piece of a query too large for one forward, by the runner when its level runs (the KV
    before it is in the tree by then). ``holder is None`` until matched. ``n_new``:
    ``len(tokens) - cached``, kept with the match.

    ``tokens`` is the answered query's own :attr:`~genback.queries.kinds.Query.context` (a tuple or
    the front's :class:`~genback.queries.context.Context`, never flattened here: a decode step reads
    its length and last token only), or a tuple for a prefill: the runner notes where its KV
    ends by the identity of that object (:class:`..cache.ends.Ends`), the object a later query names
    as its ``parent``."""

    __slots__ = ("tokens", "adapter", "limit", "outputs", "cached", "holder", "n_new")

    def __init__(self, tokens: tuple[int, ...], adapter, limit: int, outputs: list[Output],
                 match=None, n_tokens: int | None = None):
        self.tokens = tokens
        self.adapter = adapter
        self.limit = limit
        self.outputs = outputs
        _, self.cached, self.holder = match if match is not None else (None, 0, None)
        # (as matched() keeps it; n_tokens: len(tokens), when the caller has it)
        self.n_new = (len(tokens) if n_tokens is None else n_tokens) - self.cached

    def matched(self, cached: int, holder) -> None:
        """Set the match: the tree's path down to ``holder`` (a node, the root included)
        holds ``tokens[:cached]`` (``n_new``, the tokens the forward computes, is kept with it:
        the planner and the forward read it several times per path).

        Raises:
            RuntimeError: the path is matched already (a match is set once).
        """
        if self.holder is not None:
            raise RuntimeError(f"{self!r} is matched already; a path's match is set once")
        self.cached, self.holder = cached, holder
        self.n_new = len(self.tokens) - cached

    @property
    def segments(self) -> list | None:
        """The cached prefix's segments ``(node, k, kv)`` from the root down (see
        :func:`..cache.kvtree.prefix_segments`; a walk per call), or None until matched."""
        return None if self.holder is None else prefix_segments(self.holder, self.cached)

    def __repr__(self) -> str:
        return (f"Path({len(self.tokens)} tokens, cached={self.cached}, limit={self.limit}, "
                f"outputs={[(o.index, o.end) for o in self.outputs]})")


def query_path(q: Query, index: int = 0) -> Path:
    """The path that answers ``q`` alone (index ``index`` of its batch), not matched yet."""
    n = q.n_tokens
    return Path(q.context, q.adapter, n - q.n_outputs, [Output(index, q, n)], n_tokens=n)


def plan_step(queries: list[Query], ends, adapter, budget, resolve=None) -> list[Path] | None:
    """The plan of a uniform decode step, or None when ``queries`` are not one.

    A uniform step is what an SMC step or a decoding step asks: every query is a next-token row
    or a decoding step whose context is its :attr:`~genback.queries.kinds.Query.parent` plus one token,
    that parent's KV ends exactly at a tree node (``ends.get(parent, adapter)``: noted by the
    runner when it was computed, and still there), no two queries have the same context, and
    the longest context's one-token forward fits in ``budget``. Then each query is one matched
    path (cached: its parent; holder: that node) that forwards its last token; this is what
    :func:`plan_batch` would plan for them (one level, one path per query), without matching,
    grouping or sorting: a dictionary look-up and a :class:`Path` per query.

    Args:
        queries: distinct queries of one adapter.
        ends: the tree's :class:`..cache.ends.Ends`.
        adapter: the queries' adapter key.
        budget: the runner's :class:`.budget.ForwardBudget`.
        resolve: finds a parent with no note by its tokens (:meth:`..cache.ends.Ends.nodes`).
    """
    nodes = ends.nodes([q.parent for q in queries], adapter, resolve)
    if nodes is None:  # (a Score or Prefill has no parent; a parent's node may be gone)
        return None
    paths: list[Path] = []
    longest = 0
    for i, (q, node) in enumerate(zip(queries, nodes)):
        if q.n_outputs != 1:
            return None
        n = q.n_tokens
        paths.append(Path(q.context, adapter, n - 1, [Output(i, q, n)], (None, n - 1, node), n))
        if n > longest:
            longest = n
    # two queries with one context (a row and a decoding step of it, or two picks) are answered
    # by one path in plan_batch: planned there (equal contexts have equal hashes; a mere hash
    # collision only sends the step there too)
    if len({q.tokens_hash for q in queries}) < len(queries):
        return None
    if budget.working_set(1, longest, 1) > budget.max_bytes:
        return None  # (the longest is answered in pieces)
    return paths


def is_uniform(group) -> bool:
    """Whether planned paths ``group`` are a uniform decode step: each path forwards one token
    after a cached context and answers one query at its end
    (:attr:`genback.queries.kinds.Query.at_end`: a next-token row or a decoding step)."""
    for p in group:
        if p.n_new != 1 or p.cached == 0 or len(p.outputs) != 1:
            return False
        o = p.outputs[0]
        if o.end != len(p.tokens) or not o.query.at_end:
            return False
    return True


def plan_batch(queries: list[Query], match: Callable, min_gain: int = 2) -> list[list[Path]]:
    """Plan distinct queries of one adapter as levels of paths (each level one or more forwards).

    Args:
        queries: distinct queries of one adapter, each fitting in one forward.
        match: ``match(query, limit) -> (segments, cached, holder)``, the tree's longest cached
            prefix of ``query.tokens`` of at most ``limit`` tokens (``KVTree.match``, given the
            query's ``parent``).
        min_gain: a prefix shared by several paths is prefilled once first when it saves at
            least this many tokens of forward per path.

    Returns:
        ``[prefill level, ..., answer level]``: prefill levels hold KV-only paths (no outputs,
        not matched yet: run after the levels before them), shortest prefixes first; the last
        level holds every query's path, matched already unless a prefill level precedes it.
    """
    # a query forwards at least its positions from len(tokens) - n_outputs on (their logits are
    # needed), so its cached prefix reaches at most there. Queries whose cached prefixes end in
    # the same node agree on their tokens up to the shortest of those prefixes: they are
    # compared on what follows it only (nothing cached: one group, whatever root)
    groups: dict = {}
    for i, q in enumerate(queries):
        limit = len(q.tokens) - q.n_outputs
        m = match(q, limit)
        groups.setdefault(id(m[2]) if m[1] else None, []).append((i, q, limit, m))
    paths: list[Path] = []
    matches: list = []  # each path's match (set once planning is over: see below)
    shared: set = set()
    for members in groups.values():
        if len(members) == 1:  # (most groups in an SMC step: each particle's own leaf)
            i, q, limit, m = members[0]
            paths.append(Path(q.context, q.adapter, limit, [Output(i, q, len(q.context))]))
            matches.append(m)
            continue
        base = min(m[1] for _, _, _, m in members)
        members.sort(key=lambda e: e[1].tokens[base:])  # a prefix sorts right before extensions
        leaves: list[Path] = []
        pending: list[Output] = []
        first = None  # the match of the pending query with the shortest cached prefix
        for j, (i, q, limit, m) in enumerate(members):
            pending.append(Output(i, q, len(q.tokens)))
            if first is None or m[1] < first[1]:
                first = m
            if j + 1 < len(members):
                nxt = members[j + 1][1].tokens
                if len(nxt) >= len(q.tokens) and nxt[base:len(q.tokens)] == q.tokens[base:]:
                    continue  # answered by the path of an extension of it (the next leaf)
            leaves.append(Path(q.context, q.adapter, min(
                o.end - o.query.n_outputs for o in pending), pending))
            matches.append(first)
            pending, first = [], None
        if len(leaves) > 1:
            _shared_prefixes(leaves, base, min_gain, shared)
        paths.extend(leaves)
    if shared:  # prefills commit KV first: every path is matched when its level runs
        adapter = queries[0].adapter
        levels = [[Path(prefix, adapter, len(prefix), []) for prefix in level]
                  for level in nesting_levels(sorted(shared))]
        return levels + [paths]
    for p, m in zip(paths, matches):
        p.matched(m[1], m[2])
    return [paths]


def _shared_prefixes(leaves: list[Path], cached: int, min_gain: int, found: set) -> None:
    """Add to ``found`` the prefixes (beyond the common cached ``cached`` tokens) that adjacent
    sorted ``leaves`` share, at least ``min_gain`` tokens long (e.g. the first step of particles
    that all extend one uncached prompt). A prefix is kept only up to the larger of the two
    leaves' limits: a path forwards its tokens from its limit on anyway (their logits are
    needed), so a prefill beyond both would be computed twice; a leaf whose limit is shorter
    still reuses the prefill up to its limit (paths are matched when their level runs)."""
    for a, b in zip(leaves, leaves[1:]):
        share = min(common_prefix_length(a.tokens, b.tokens, cached), max(a.limit, b.limit))
        if share - cached >= min_gain:
            found.add(a.tokens[:share])


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


# what one forward costs by itself, in tokens of forward (measured on SmolLM2-135M fp32 on one CPU
# core: a 1-token forward ~30 tokens' worth of a long one, mostly reading the weights)
FORWARD_COST_TOKENS = 32


def group_paths(paths: list[Path], max_tokens: int, max_bytes: int,
                score_bytes_per_key: int, budget=None) -> list[list[Path]]:
    """Split paths into forwards.

    With a packed ``budget`` (:class:`.budget.ForwardBudget`, ``packed``: rows laid end to end
    with no padding, attention that materialises no scores: CUDA's varlen kernels), forwards
    are filled in order up to ``max_tokens`` real tokens and ``max_bytes`` of
    :meth:`~.budget.ForwardBudget.working_set` (:func:`_packed_groups`). Otherwise:

    Paths are sorted by new-token count (longest first); a forward grows while its right padding
    stays within ``max(FORWARD_COST_TOKENS, padded tokens / 16)`` (a forward costs about that
    many tokens by itself, reading the weights: padding beyond it costs more than a forward of
    its own), its padded new tokens stay within ``max_tokens`` and the
    attention scores of its private part (``paths * new * (longest cached + new) *
    score_bytes_per_key``, an upper bound) within ``max_bytes``. A single path may exceed both
    (it is forwarded alone). Decode steps (one new token each) share one forward up to the
    limits, however long their contexts.
    """
    if budget is not None and budget.packed:
        return _packed_groups(paths, max_tokens, budget)
    order = sorted(paths, key=_n_new, reverse=True)
    # the whole batch in one forward when it fits (a decode step, mostly): the loop below
    # would make the same single group (its padding and byte tests only grow with the group)
    size, longest = len(order), order[0].n_new if order else 0
    padded = size * longest
    if order and padded <= max_tokens:
        waste = padded - sum(map(_n_new, order))
        past = max(map(_cached, order))
        if (waste <= max(FORWARD_COST_TOKENS, padded // 16)
                and padded * (past + longest) * score_bytes_per_key <= max_bytes):
            return [order]
    groups: list[list[Path]] = []
    group: list[Path] = []
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


def _packed_groups(paths: list[Path], max_tokens: int, budget) -> list[list[Path]]:
    """Forwards of packed rows (no padding): paths in order, a forward closed when the next
    path's tokens would pass ``max_tokens`` or its working set (scores of each row's new
    tokens over its keys, activations, logits: ``budget.working_set``) ``budget.max_bytes``;
    a path over either limit alone is forwarded alone."""
    groups: list[list[Path]] = []
    group: list[Path] = []
    tokens = size = 0
    for p in paths:
        m = p.n_new
        cost = budget.working_set(m, p.cached + m, sum(o.query.n_outputs for o in p.outputs))
        if group and (tokens + m > max_tokens or size + cost > budget.max_bytes):
            groups.append(group)
            group, tokens, size = [], 0, 0
        group.append(p)
        tokens += m
        size += cost
    if group:
        groups.append(group)
    return groups


_n_new = operator.attrgetter("n_new")
_cached = operator.attrgetter("cached")
