"""The union of a forward's paths (genback.llm.hf.plan.segments) and the private pasts' slot layout
from it, against brute force: each path's segments listed one by one from the tree, counted per
path, laid out by concatenation. Random trees with splits after matching (a later insertion of the
same level splits a holder's edge) and compaction; every path's KV is read back token by token."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from genback.llm.hf.cache.kv_pool import KVPool
from genback.llm.hf.cache.kvtree import KVTree
from genback.llm.hf.plan.batch import Path
from genback.llm.hf.cache.nodes import prefix_segments
from genback.llm.hf.plan.anchors import Anchors
from genback.llm.hf.plan.segments import SegmentTable, split_segments


def _kv(tokens: tuple, start: int) -> torch.Tensor:
    """KV whose values name each token: [..., 0] its position, [..., 1] its id, [..., 2] a
    hash of the context up to it (so equal ids at equal positions on other paths differ)."""
    rows = [[float(i), float(tokens[i]), float(hash(tokens[:i + 1]) % 1000)]
            for i in range(start, len(tokens))]
    return torch.tensor(rows).reshape(1, 1, 1, -1, 3).expand(1, 2, 1, -1, 3).contiguous()


def _slots(pool: KVPool, tokens: tuple, start: int) -> np.ndarray:
    """A forward's part: take slots for ``tokens[start:]`` and write their :func:`_kv` there."""
    slots = pool.alloc(len(tokens) - start)
    pool.store[:, :, :, torch.from_numpy(slots)] = _kv(tokens, start)
    return slots


def _key(slots: np.ndarray) -> tuple[int, int]:
    return int(slots[0]), len(slots)  # (nodes' slots are disjoint: the first names a segment)


def _brute(paths: list[Path], min_shared: int):
    """The per-path rule, segment by segment: ``(shared {key: sorted path indices}, private
    [[key, ...] per path])`` with key ``(first slot, length)`` of a segment. The segments on
    every path: each one that is long enough and one run of slots is shared by itself, the
    others are joined, root side first, into one segment (shared when long enough, else the
    first private segment of every path); the segments on some paths: shared when on two or
    more and long enough."""
    segs = [prefix_segments(p.holder, p.cached) for p in paths]
    count = Counter((id(n), k) for row in segs for n, k, _ in row)
    R = len(paths)
    shared, private = {}, [[] for _ in paths]
    joined = [slots for n, k, slots in segs[0] if count[(id(n), k)] == R]
    alone = [s for s in joined if R >= 2 and len(s) >= min_shared
             and s.tolist() == list(range(int(s[0]), int(s[0]) + len(s)))]
    rest = [s for s in joined if not any(s is a for a in alone)]
    for s in alone:
        shared[_key(s)] = list(range(R))
    if rest:
        key = _key(np.concatenate(rest))
        if R >= 2 and key[1] >= min_shared:
            shared[key] = list(range(R))
        else:
            for mine in private:
                mine.append(key)
    for i, row in enumerate(segs):
        for n, k, slots in row:
            if count[(id(n), k)] == R:
                continue
            if count[(id(n), k)] >= 2 and k >= min_shared:
                shared.setdefault(_key(slots), []).append(i)
            else:
                private[i].append(_key(slots))
    return shared, private


def _by_paths(shared: dict) -> dict:
    """``{(path indices): sorted slots}``: the slots each set of paths shares, whatever the
    segments' boundaries."""
    out: dict = {}
    for (start, length), idx in shared.items():
        out.setdefault(tuple(idx), []).extend(range(start, start + length))
    return {k: sorted(v) for k, v in out.items()}


def _check_split(pool, paths, min_shared, m, shared, private, exact_bounds=True):
    """``split_segments``' answer against :func:`_brute`, each path's KV read back token by
    token, and the private layout against concatenation. ``exact_bounds=False``: the shared
    slots of each set of paths must agree, not where segments begin and end (a call with
    anchors may keep the joined segment of the common nodes it found last time after an
    insertion split one of them: the same slots, one run, read once)."""
    want_shared, want_private = _brute(paths, min_shared)
    got_shared = {_key(slots): idx for slots, idx in shared}
    assert got_shared == want_shared or (
        not exact_bounds and _by_paths(got_shared) == _by_paths(want_shared)), (
        got_shared, want_shared)
    got_private = [[_key(private.segs[j]) for j in row if j >= 0]
                   for row in private.chains.tolist()]
    assert got_private == want_private
    assert len({_key(seg) for seg in private.segs}) == len(private.segs)  # each segment once

    # every path's KV, shared and private parts together, is its prefix, token by token
    for i, p in enumerate(paths):
        parts = [slots for slots, idx in shared if i in idx]
        parts += [private.segs[j] for j in private.chains[i].tolist() if j >= 0]
        got = (pool.read(np.concatenate(parts))[0, 0, 0] if parts else torch.zeros((0, 3)))
        got = got[got[:, 0].argsort()]
        assert torch.equal(got, _kv(p.tokens[:p.cached], 0)[0, 0, 0] if p.cached
                           else torch.zeros((0, 3)))

    # the layout: each row's private past, left-padded with slot 0, then its tail (new slots)
    tail = np.arange(len(paths) * m).reshape(len(paths), m) + 10_000
    layout, pads = private.layout(tail)
    lengths = [sum(len(private.segs[j]) for j in row if j >= 0)
               for row in private.chains.tolist()]
    P = max(lengths, default=0)
    assert layout.shape == (len(paths), P + m) and pads.tolist() == [P - n for n in lengths]
    for i, row in enumerate(private.chains.tolist()):
        segs = [private.segs[j] for j in row if j >= 0]
        want = np.concatenate(segs) if segs else np.empty(0, dtype=np.int64)
        assert layout[i, pads[i]:P].tolist() == want.tolist()
        assert (layout[i, :pads[i]] == 0).all()  # the padding reads slot 0
        assert layout[i, P:].tolist() == tail[i].tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=14),
       st.lists(st.integers(0, 40), min_size=1, max_size=10),
       st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), max_size=4),
       st.integers(1, 6), st.integers(1, 3), st.booleans())
def test_union_of_paths_agrees_with_per_path_segments(seqs, picks, later, min_shared, m, compact):
    pool = KVPool((1, 1, 3, torch.float32, torch.device("cpu")), capacity=8)
    tree = KVTree(1 << 30, pool)
    stored = []
    for s in seqs:  # contexts sharing prefixes (small alphabet)
        tokens = tuple(s)
        _, cached, holder = tree.match(tokens)
        if cached < len(tokens):
            node = tree.insert(tokens, cached, _slots(pool, tokens, cached), near=holder)
            if compact:
                tree.compact(node)
        stored.append(tokens)
    # paths: prefixes of stored contexts (some ending inside an edge), matched now
    paths = []
    for j in picks:
        tokens = stored[j % len(stored)]
        tokens = tokens[: 1 + (j // len(stored)) % len(tokens)] + (3,)  # a new last token
        _, cached, holder = tree.match(tokens, segments=False)
        tree.acquire(holder)
        paths.append(Path(tokens, None, len(tokens), [], (None, cached, holder)))
    # the same paths with anchors (each call may walk only below the last one's common node),
    # before and after insertions that split the paths' holders (and compaction)
    anchors = Anchors()
    _check_split(pool, paths, min_shared, m, *split_segments(paths, min_shared, anchors=anchors))
    for s in later:  # insertions after matching: they may split the paths' holders
        tokens = tuple(s) + (4,)
        _, cached, holder = tree.match(tokens)
        if cached < len(tokens):
            node = tree.insert(tokens, cached, _slots(pool, tokens, cached), near=holder)
            if compact:
                tree.compact(node)
    _check_split(pool, paths, min_shared, m, *split_segments(paths, min_shared))
    _check_split(pool, paths, min_shared, m, *split_segments(paths, min_shared, anchors=anchors),
                 exact_bounds=False)
    _check_split(pool, paths[::-1], min_shared, m,
                 *split_segments(paths[::-1], min_shared, anchors=anchors), exact_bounds=False)
    for p in paths:
        tree.release(p.holder)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "touch", "match", "evict"]),
                              st.lists(st.integers(1, 3), min_size=1, max_size=5),
                              st.integers(0, 3)), min_size=1, max_size=40))
def test_eviction_is_least_recently_used_with_ancestors_used_with_their_paths(ops):
    """The tree's stamps (genback.llm.hf.cache.recency) against a brute-force record of
    every use: a node's recency is the last use of its own path or of any path below it (a
    use of a path uses its ancestors), and every node an ``evict`` removes is at most as recent
    as every leaf it left (none held or pinned here)."""
    tree = KVTree(1 << 30)  # (no pool: a token is a byte)
    tick, uses, slot = 0, {}, [1]
    path = {}  # node -> its tokens from the root, kept as the tree changes (splits)

    def tokens_of(node):
        out = ()
        while node.parent is not None:
            out = node.edge + out
            node = node.parent
        return out

    def recency(node):
        mine = tokens_of(node)
        return max((t for p, t in uses.items() if p[:len(mine)] == mine), default=-1)

    for op, seq, k in ops:
        seq = tuple(seq)
        if op == "insert":
            _, cached, holder = tree.match(seq, touch=False)
            if cached < len(seq):
                n = len(seq) - cached
                node = tree.insert(seq, cached, np.arange(slot[0], slot[0] + n), near=holder,
                                   touch=False)
                slot[0] += n
                tick += 1
                tree.touch_all([node])
                uses[tokens_of(node)] = tick
        elif op == "touch":  # one step's touch of a leaf or two, or of an inner node: one tick
            leaves = [n for n in tree._nodes if not n.children]
            inner = [n for n in tree._nodes if n.children]
            nodes = ([leaves[k % len(leaves)]] if k < 2 else inner[:1] if k == 2 and inner
                     else leaves[:2]) if leaves else []
            tick += 1
            tree.touch_all(nodes)
            for node in nodes:
                uses[tokens_of(node)] = tick
        elif op == "match":
            _, cached, holder = tree.match(seq)
            if holder.parent is not None:
                tick += 1
                uses[tokens_of(holder)] = tick
        else:
            before = {node: recency(node) for node in tree._nodes}
            tree.budget_bytes = max(1, tree.bytes_held - k - 1)
            tree.evict()
            assert tree.bytes_held <= tree.budget_bytes or not tree._nodes
            gone = [n for n in before if n not in tree._nodes]
            leaves = [n for n in tree._nodes if not n.children]
            if gone and leaves:
                assert max(before[n] for n in gone) <= min(before[n] for n in leaves)
            tree.budget_bytes = 1 << 30
    assert len(tree) == len(tree._nodes) and tree.bytes_held == sum(
        n.bytes for n in tree._nodes)


def test_the_worked_example_of_split_segments():
    """The three-path tree of split_segments' docstring, its shared level and its slot rows."""
    tree = KVTree(1 << 30)
    x = tuple(range(1000, 1100))
    tree.insert(x, 0, np.arange(1, 101))
    a = tree.insert(x + (1,), 100, np.array([101]))
    b = tree.insert(x + (2,), 100, np.array([102]))
    c = tree.insert(x + (2, 3), 101, np.array([103]))
    paths = []
    for leaf in (a, b, c):
        tokens = x + ((1,) if leaf is a else (2,) if leaf is b else (2, 3)) + (9,)
        paths.append(Path(tokens, None, leaf.depth, [], (None, leaf.depth, leaf)))
    table = SegmentTable.of(paths)  # entries A, X, B, C
    assert [int(s[0]) for s in table.slots] == [101, 1, 102, 103]
    assert table.chains().tolist() == [[-1, 1, 0], [-1, 1, 2], [1, 2, 3]]
    shared, private = split_segments(paths, 64)
    (slots, rows), = shared
    assert slots.tolist() == list(range(1, 101)) and rows == [0, 1, 2]
    layout, pads = private.layout(np.array([[20], [21], [22]]))
    assert layout.tolist() == [[0, 101, 20], [0, 102, 21], [102, 103, 22]]
    assert pads.tolist() == [1, 1, 0]
    # X under three paths saves 2 * 100 copies: shared with that bound, private above it
    assert [r for _, r in split_segments(paths, 64, min_saved_tokens=200)[0]] == [[0, 1, 2]]
    shared, private = split_segments(paths, 1, min_saved_tokens=201)
    assert shared == []  # (B, 1 token under two paths, saves 1 copy: private too)
    layout, _ = private.layout(np.array([[20], [21], [22]]))
    past = [sorted(int(x) for x in row[:-1] if x) for row in layout]  # (0: the dummy slot)
    assert layout[:, -1].tolist() == [20, 21, 22]
    assert past == [list(range(1, 101)) + [101], list(range(1, 101)) + [102],
                    list(range(1, 101)) + [102, 103]]


def test_anchored_walks_agree_with_brute_force_through_an_smc_run():
    """An SMC-shaped run on the tree (particles extend by one token, are resampled, their KV is
    inserted and compacted, old leaves evicted under a budget): every step's split with
    anchors, and with the particles split into two forwards that leave each other's anchor,
    equals the per-path rule, and the anchor is used (the walks stay short)."""
    import random

    import genback.llm.hf.plan.segments as segments

    rng = random.Random(0)
    pool = KVPool((1, 1, 3, torch.float32, torch.device("cpu")), capacity=64)
    tree = KVTree(1 << 30, pool)
    tree.budget_bytes = 300 * tree.token_bytes  # (old leaves are evicted as the run goes)
    prompt = tuple(range(5, 85))  # 80 tokens: a long run, read in place
    _, cached, holder = tree.match(prompt)
    tree.insert(prompt, cached, _slots(pool, prompt, cached), near=holder)
    contexts = [prompt] * 6
    anchors, stops = Anchors(), []
    real_of = segments.SegmentTable.of

    def counting_of(paths, stop=None):
        table = real_of(paths, stop)
        stops.append((stop is not None and not table.off_stop, len(table.lengths)))
        return table

    segments.SegmentTable.of = counting_of
    try:
        for step in range(120):
            paths = []
            for c in contexts:
                tokens = c + (rng.randrange(3),)
                _, cached, holder = tree.match(tokens[:-1] + (99,), segments=False)
                tree.acquire(holder)
                paths.append(Path(tokens, None, len(tokens), [], (None, cached, holder)))
            groups = [paths] if step % 5 else [paths[:3], paths[3:]]  # (a step in two forwards)
            for group in groups:
                _check_split(pool, group, 16, 1,
                             *split_segments(group, 16, anchors=anchors))
            inserted = []
            for p in paths:
                if tree.find(p.tokens) is None:
                    _, cached, holder = tree.match(p.tokens)
                    inserted.append(tree.insert(p.tokens, cached,
                                                _slots(pool, p.tokens, cached), near=holder))
                tree.release(p.holder)
            for node in inserted:
                if node.slots is not None and node.parent is not None:
                    tree.compact(node)
            tree.evict()
            contexts = [p.tokens for p in paths]
            if step % 3 == 2:  # resampling: particles copy each other
                contexts = [rng.choice(contexts[:2]) for _ in contexts]
    finally:
        segments.SegmentTable.of = real_of
    used = [n for anchored, n in stops if anchored]
    assert len(used) > len(stops) // 2  # most calls walked only below an anchor
