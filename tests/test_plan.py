"""Batch planning by tree paths: nested prefixes answered by one path (forwards counted), each
query matched against the tree once, plans as plain data, exact against uncached forwards; the
C-level common-prefix helper against brute force; the front's memory of validated contexts."""

from __future__ import annotations

import asyncio
import random

import pytest
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from genback.llm import AsyncTransformer
from genback.core.inputs import ContextChecker
from genback.queries.kinds import NextToken, Prefill, Score
from genback.llm.hf.cache.kv_pool import KVPool
from genback.llm.hf.cache.kvtree import KVTree
from genback.llm.hf.cache.nodes import Node, append_slots, common_prefix_length
from genback.llm.hf.plan.batch import Path, group_paths, plan_batch, plan_step
from genback.llm.hf.plan.budget import ForwardBudget
from genback.queries.kinds import Step
from genback.queries.sampling import Pick, SamplingParams


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40),
       st.data())
def test_common_prefix_length_matches_brute_force(a, b, data):
    brute = 0
    while brute < min(len(a), len(b)) and a[brute] == b[brute]:
        brute += 1
    start = data.draw(st.integers(0, brute))
    assert common_prefix_length(tuple(a), tuple(b), start) == brute


def _tree_with(tokens: tuple) -> KVTree:
    tree = KVTree(1 << 30)
    tree.insert(tokens, 0, np.arange(1, len(tokens) + 1))
    return tree


def test_nested_prefixes_plan_as_one_path_with_an_output_per_prefix():
    prompt = tuple(range(100, 110))
    seq = tuple(range(500, 756))  # 256 tokens
    tree = _tree_with(prompt)
    queries = [NextToken(prompt + seq[:i]) for i in range(1, 257)]
    plan = plan_batch(queries, lambda q, limit: tree.match(q.tokens, limit))
    assert len(plan) == 1 and len(plan[0]) == 1  # one level, one path
    path = plan[0][0]
    assert path.tokens == prompt + seq and path.cached == len(prompt)
    assert sorted(o.end for o in path.outputs) == [len(prompt) + i for i in range(1, 257)]
    assert {o.index for o in path.outputs} == set(range(256))


def test_branching_batch_prefills_the_shared_uncached_prefix_first():
    prompt = tuple(range(100, 140))
    queries = [NextToken(prompt + (1,)), NextToken(prompt + (2,)),
               Score(prompt + (3, 4), (4, 5)), NextToken(prompt[:20])]
    plan = plan_batch(queries, lambda q, limit: KVTree(1 << 20).match(q.tokens, limit))
    *prefills, answers = plan
    assert [[p.tokens for p in level] for level in prefills] == [[prompt]]
    assert all(not p.outputs for level in prefills for p in level)
    # prompt[:20] is a prefix of the others: answered by one of their paths, not its own
    assert len(answers) == 3
    assert sorted(o.index for p in answers for o in p.outputs) == [0, 1, 2, 3]
    assert all(p.segments is None for p in answers)  # matched when their level runs


def test_each_query_of_a_step_is_matched_against_the_tree_once(tiny_hf, gpt2_tok):
    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    prompt = list(range(1000, 1100))
    particles = [prompt + [p] for p in range(16)]
    lm.batch_next_token_logprobs_sync(particles)
    calls = []
    match = lm.runner.tree.match
    lm.runner.tree.match = lambda *a, **k: calls.append(1) or match(*a, **k)
    try:
        # two tokens on: no known parent, so the general planner matches each query (a one-token
        # step is planned from its parent's note, without a match: the test below)
        particles = [c + [7, 8] for c in particles]
        forwards = lm.forwards
        lm.batch_next_token_logprobs_sync(particles)
        assert len(calls) == 16 and lm.forwards == forwards + 1
    finally:
        lm.runner.tree.match = match
        lm.close()


async def test_nested_prefixes_cost_one_forward_and_are_exact(tiny_hf, gpt2_tok):
    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    try:
        prompt = list(range(300, 340))
        lm.cache_kv(prompt)
        seq = [(7 * i + 11) % 5000 for i in range(200)]
        contexts = [prompt + seq[:i] for i in range(201)]  # the prompt itself, then extensions
        forwards, tokens = lm.forwards, lm.tokens_forwarded
        rows = await lm.batch_next_token_logprobs(contexts)
        assert lm.forwards - forwards == 1
        # the 200 tokens once, plus the prompt's last token for the prompt's own row
        assert lm.tokens_forwarded - tokens == len(seq) + 1
        for i in (0, 1, 57, 199, 200):
            ref = lm.next_token_logprobs_uncached(contexts[i])
            torch.testing.assert_close(rows[i], ref, rtol=0, atol=1e-5)
        lps = await lm.token_logprobs(prompt, seq)
        picked = rows[torch.arange(200), torch.tensor(seq)]
        torch.testing.assert_close(picked, lps, rtol=0, atol=1e-5)
    finally:
        await lm.aclose()


async def test_nested_rows_scores_and_prefills_share_one_path(tiny_hf, gpt2_tok):
    """Different kinds on one sequence: rows at prefixes, a score of a middle slice and a
    prefill of a prefix are all answered by the one path over the longest."""
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05)
    try:
        seq = [(13 * i + 5) % 5000 for i in range(60)]
        row_a, row_b, (lp, greedy), _ = await asyncio.gather(
            lm.next_token_logprobs(seq[:20]), lm.next_token_logprobs(seq),
            lm.score(seq[:30], seq[30:45]), asyncio.to_thread(lambda: None))
        assert lm.forwards == 1 and lm.tokens_forwarded == 60
        torch.testing.assert_close(row_a, lm.next_token_logprobs_uncached(seq[:20]),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(row_b, lm.next_token_logprobs_uncached(seq), rtol=0, atol=1e-5)
        refs = [lm.next_token_logprobs_uncached(seq[:k]) for k in range(30, 45)]
        torch.testing.assert_close(lp, torch.stack([r[t] for r, t in zip(refs, seq[30:45])]),
                                   rtol=0, atol=1e-5)
        assert greedy.tolist() == [int(r.argmax()) == t for r, t in zip(refs, seq[30:45])]
    finally:
        await lm.aclose()


async def test_nested_prefixes_on_smollm2_match_token_logprobs(smol_hf):
    """genlm-control's PromptedLLM.log_probability shape on the real model: every prefix of a
    sequence in one batch, one forward, rows agreeing with token_logprobs and uncached rows."""
    model, tok = smol_hf
    lm = AsyncTransformer(model, tok)
    try:
        prompt = tok.encode("The capital of France is")
        seq = tok.encode(" Paris. It is known for the Eiffel Tower and its museums.")
        rows = await lm.batch_next_token_logprobs([prompt + seq[:i] for i in range(len(seq))])
        assert lm.forwards == 1
        lps = await lm.token_logprobs(prompt, seq)
        picked = rows[torch.arange(len(seq)), torch.tensor(seq)]
        torch.testing.assert_close(picked, lps, rtol=0, atol=1e-4)
        assert abs(float(rows[0][tok.encode(" Paris")[0]]) - -0.258) < 0.01
        ref = lm.next_token_logprobs_uncached(prompt + seq[:5])
        torch.testing.assert_close(rows[5], ref, rtol=0, atol=1e-4)
    finally:
        await lm.aclose()


def test_prefill_level_paths_do_not_reach_past_a_nested_output():
    """A query nested in a path whose shared prefix is prefilled first still gets its own
    position: the path's cached prefix is limited to the first position an output needs."""
    prompt = tuple(range(100, 130))
    queries = [NextToken(prompt + (1,)), NextToken(prompt + (1, 2, 3)),
               NextToken(prompt + (1, 2, 4))]
    plan = plan_batch(queries, lambda q, limit: KVTree(1 << 20).match(q.tokens, limit))
    paths = plan[-1]
    holder = next(p for p in paths if any(o.index == 0 for o in p.outputs))
    assert holder.limit <= len(prompt)  # position of the token 1: where query 0 needs logits


def test_context_checker_checks_only_the_new_token_of_an_extension():
    check = ContextChecker(vocab_size=100)
    base = check(list(range(50)))
    assert check(list(range(50)) + [7]) == base + (7,)
    with pytest.raises(ValueError, match=r"token_ids\[50\] = 100"):
        check(list(range(50)) + [100])
    with pytest.raises(TypeError, match=r"token_ids\[50\] must be an int"):
        check(list(range(50)) + [8.0])
    with pytest.raises(TypeError, match=r"token_ids\[0\] must be an int"):
        check([True, 2])
    # a context equal to a validated one comes back as the validated ints, never as floats
    again = check([float(i) for i in range(50)])
    assert again == base and all(type(t) is int for t in again)
    assert isinstance(Prefill((1, 2)), Prefill)


async def test_a_caller_mutating_its_row_cannot_change_the_cached_row(tiny_lm):
    """Rows are shared views of one forward's output inside genback; each caller gets its own
    copy (one copy per answered row), so writing into it changes nothing for the next caller."""
    ctx = [11, 12, 13]
    first, second = await asyncio.gather(tiny_lm.next_token_logprobs(ctx),
                                         tiny_lm.next_token_logprobs(ctx + [14]))
    keep = first.clone()
    first.fill_(0.0)
    second.fill_(0.0)
    again = await tiny_lm.next_token_logprobs(ctx)  # an output-cache hit
    assert tiny_lm.cache_info()["row_hits"] >= 1
    torch.testing.assert_close(again, keep, rtol=0, atol=0)
    batch = tiny_lm.batch_next_token_logprobs_sync([ctx, ctx])
    batch.fill_(1.0)
    torch.testing.assert_close(await tiny_lm.next_token_logprobs(ctx), keep, rtol=0, atol=0)
    # two callers of one new context in one batch (the batcher's copy for the second), beside
    # others: each gets its own row, a view of a block of at most HOST_OWNED_BLOCK_BYTES
    from genback.queries.rows import HOST_BLOCK_BYTES as HOST_OWNED_BLOCK_BYTES

    new = [ctx + [15], ctx + [15]] + [ctx + [16, t] for t in range(40)]
    rows = await asyncio.gather(*(tiny_lm.next_token_logprobs(c) for c in new))
    assert rows[0].data_ptr() != rows[1].data_ptr()
    assert all(r.untyped_storage().nbytes() <= max(HOST_OWNED_BLOCK_BYTES, r.nbytes)
               for r in rows)
    want = rows[1].clone()
    rows[0].fill_(0.0)
    torch.testing.assert_close(rows[1], want, rtol=0, atol=0)
    torch.testing.assert_close(await tiny_lm.next_token_logprobs(ctx + [15]), want,
                               rtol=0, atol=0)


def _kv_of(tree: KVTree, tokens: tuple, **kw) -> tuple[torch.Tensor, int]:
    segments, cached, _ = tree.match(tokens, touch=False, **kw)
    if not segments:
        return None, cached
    return tree.pool.read(np.concatenate([slots for _, _, slots in segments])), cached


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3)), min_size=1, max_size=60),
       st.integers(0, 2**31 - 1))
def test_compacted_tree_keeps_every_path_exact(ops, seed):
    """Random SMC-like growth: particles extend by 1-3 tokens and copy each other; after each
    call a leaf that ends at the cached prefix grows in place (``KVTree.extend``) or the new
    tokens get a node, compacted (as the runner does). Each context's KV, read back
    through the merged nodes, equals the KV that was inserted for its tokens (brute force: a
    per-token value, written into the pool slots the insertion took), pinned nodes keep their
    boundary, branching nodes are never merged, and every slot a node holds is in use once."""
    gen = torch.Generator().manual_seed(seed)
    value = {}  # (context prefix) -> this token's KV value, defined by the inserting call
    pool = KVPool((1, 1, 1, torch.float32, torch.device("cpu")), capacity=8)

    def kv_for(tokens, start):
        return torch.stack([value[tokens[:i + 1]] for i in range(start, len(tokens))], dim=3)

    def slots_for(tokens, start):  # a forward: take slots, write the new tokens' KV there
        slots = pool.alloc(len(tokens) - start)
        for j, slot in enumerate(slots.tolist()):
            pool.store[:, :, :, slot] = value[tokens[:start + j + 1]]
        return slots

    tree = KVTree(1 << 30, pool)
    prompt = tuple(range(50, 58))
    for i in range(len(prompt)):
        value[prompt[:i + 1]] = torch.randn((1, 2, 1, 1), generator=gen)
    tree.insert(prompt, 0, slots_for(prompt, 0))
    assert tree.pin(prompt)
    particles = [prompt] * 4
    for k, n in ops:
        i = k % len(particles)
        if k >= 4:  # resample: a particle copies another
            particles[(i + 1) % len(particles)] = particles[i]
            continue
        old = particles[i]
        new = old + tuple(int(x) for x in torch.randint(0, 3, (n,), generator=gen))
        for j in range(len(old), len(new)):
            value.setdefault(new[:j + 1], torch.randn((1, 2, 1, 1), generator=gen))
        segments, cached, holder = tree.match(new)
        particles[i] = new
        if cached < len(new):  # as the runner commits: a leaf grows in place, else a child
            slots = slots_for(new, cached)
            if not (holder.depth == cached and tree.extend(holder, new, slots)):
                tree.compact(tree.insert(new, cached, slots, near=holder))
        for p in set(particles):
            got, cached = _kv_of(tree, p)
            assert cached == len(p)
            assert torch.equal(got, kv_for(p, 0))
        assert tree.find(prompt) is not None and tree.find(prompt).pinned
        for node in list(tree._nodes):  # a merged-away node is gone from the tree's nodes
            assert node.slots is not None and node.parent is not None
            assert len(node.slots) == len(node.edge)
    assert sum(node.bytes for node in tree._nodes) == tree.bytes_held
    held = np.concatenate([node.slots for node in tree._nodes])
    assert len(set(held.tolist())) == len(held) == pool.in_use and 0 not in held


def _dump(tree: KVTree) -> tuple:
    """The tree's whole state, comparable between trees: every node's edge, slots, depth,
    bytes and pin from the roots down (children in key order), and the byte count."""
    def walk(node):
        return (node.edge, None if node.slots is None else node.slots.tolist(), node.depth,
                node.bytes, node.pinned, [walk(node.children[k]) for k in sorted(node.children)])
    return walk(tree.root), tree.bytes_held, len(tree._nodes)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(2, 5))
def test_grow_commits_a_step_as_extend_and_insert_do_row_by_row(seed, particles, cap):
    """``KVTree.grow`` (the runner's commit of a uniform step, in one call) leaves exactly the
    tree that the row-by-row commit leaves (``extend`` where a leaf can grow in place, else
    ``insert``), with the same notes: an SMC trace with resampling (holders held twice), a
    small alphabet (a new token whose child exists already), particles going back to older
    contexts (a cached prefix ending inside an edge), a short ``EXTEND_MAX`` (full edges) and
    compaction after every step, as the runner runs it."""
    rng = random.Random(seed)
    trees = [KVTree(1 << 30, token_bytes=3), KVTree(1 << 30, token_bytes=3)]
    prompt = (9, 8, 7)
    for tree in trees:
        tree.EXTEND_MAX = cap
        tree.ends.note(prompt, tree.insert(prompt, 0, np.arange(1, 4)))
    contexts, next_slot, history = [prompt] * particles, 4, []
    for step in range(12):
        children = list(dict.fromkeys(c + (rng.randrange(3),) for c in contexts))
        slots = [np.array([next_slot + i]) for i in range(len(children))]
        next_slot += len(children)
        parents = [c[:-1] for c in children]
        parents = [next(p for p in contexts if p == q) for q in parents]  # (the noted objects)
        states = []
        for k, tree in enumerate(trees):
            matched = [tree.match(c, len(c) - 1, touch=False, parent=p, segments=False)
                       for c, p in zip(children, parents)]
            holders, cached = [m[2] for m in matched], [m[1] for m in matched]
            tree.acquire(*holders)
            if k == 0:
                nodes, inserted = tree.grow(holders, children, cached,
                                            [c[-1] for c in children], slots)
                tree.ends.note_many(children, nodes, [len(c) for c in children])
            else:
                nodes, inserted = [], []
                for holder, c, n, s in zip(holders, children, cached, slots):
                    if holder.depth == n and tree.extend(holder, c, s):
                        nodes.append(holder)
                    else:
                        inserted.append(tree.insert(c, n, s, near=holder, touch=False))
                        nodes.append(inserted[-1])
                    tree.ends.note(c, nodes[-1])
            tree.release(*holders)
            for node in nodes:
                if node.slots is not None and node.parent is not None:
                    tree.compact(node)
            ends = [tree.ends.get(c) for c in children]  # (a note holds while its node ends
            # where its context does: not one that a longer context of the step grew since)
            assert all(e is None or e.depth == len(c) for e, c in zip(ends, children))
            states.append((_dump(tree), len(inserted), [e is None for e in ends],
                           [tree.match(c, touch=False, parent=c)[1] for c in children]))
        assert states[0] == states[1]
        history += children  # (now and then a particle goes back to an older context: its KV
        # may end inside a grown leaf's edge, matched below its holder's end)
        contexts = [rng.choice(children if rng.random() < 0.8 else history)
                    for _ in range(particles)]


def test_a_growing_leafs_slots_go_in_place_and_no_view_changes():
    """``append_slots``: a leaf's slots grow in one buffer (no new one while it has room and
    ``slots`` is still the view it made); a node whose ``slots`` were set otherwise (a split)
    or a full buffer gets a new buffer; every view handed out earlier keeps its slots."""
    node = Node(None, (1, 2), np.array([5, 6]), 2)
    append_slots(node, np.array([7]), 8)
    buf, first = node.spare[0], node.slots
    assert len(buf) == 8 and first.tolist() == [5, 6, 7]
    append_slots(node, np.array([8, 9]), 8)
    assert node.spare[0] is buf and node.slots.base is buf  # (in place)
    assert node.slots.tolist() == [5, 6, 7, 8, 9] and first.tolist() == [5, 6, 7]
    upper, node.slots = node.slots[:2], node.slots[2:]  # a split
    append_slots(node, np.array([10]), 8)
    assert node.spare[0] is not buf and node.slots.tolist() == [7, 8, 9, 10]
    assert upper.tolist() == [5, 6] and buf[:5].tolist() == [5, 6, 7, 8, 9]
    buf = node.spare[0]
    append_slots(node, np.arange(11, 15), 8)  # fills the buffer: 8 slots
    assert node.spare[0] is buf and node.slots.tolist() == list(range(7, 15))
    append_slots(node, np.array([15]), 8)  # no room: a new, larger buffer
    assert node.spare[0] is not buf and node.slots.tolist() == list(range(7, 16))
    assert buf.tolist() == list(range(7, 15))


def test_match_by_parent_identity_agrees_with_a_walk_and_falls_back_when_stale():
    tree = KVTree(1 << 30)
    ctx = tuple(range(100, 400))
    node = tree.insert(ctx, 0, np.arange(1, 301))
    tree.ends.note(ctx, node)
    child = ctx + (7,)
    walked = tree.match(child, len(ctx), touch=False)
    fast = tree.match(child, len(ctx), touch=False, parent=ctx)
    assert fast[1] == walked[1] == len(ctx) and fast[2] is walked[2] is node
    assert [s[1] for s in fast[0]] == [s[1] for s in walked[0]]
    # an equal tuple that is not the noted object is not trusted: it is walked
    assert tree.match(child, touch=False, parent=tuple(list(ctx)))[1] == len(ctx)
    # a different adapter does not use the note
    assert tree.match(child, touch=False, adapter=3, parent=ctx)[1] == 0
    tree.ends.rotate()  # fewer than ends.keep notes: kept as they are
    assert tree.match(child, len(ctx), touch=False, parent=ctx)[2] is node
    tree.ends.keep = 1
    tree.ends.rotate()
    assert tree.match(child, len(ctx), touch=False, parent=ctx)[2] is node  # previous generation
    spied = []
    walk = tree._roots.get
    tree._roots = type("Spy", (dict,), {"get": lambda self, k, d=None: spied.append(k) or walk(k, d)})(
        tree._roots)
    assert tree.match(child, len(ctx), touch=False, parent=ctx)[1] == len(ctx) and not spied
    tree.ends.note((1, 2), node)
    tree.ends.rotate()
    tree.ends.note((3, 4), node)
    tree.ends.rotate()  # two generations later the note is forgotten: a walk, same answer
    assert tree.match(child, len(ctx), touch=False, parent=ctx)[1] == len(ctx) and spied
    tree.ends.note(ctx, node)
    tree.budget_bytes = 1
    tree.evict()  # the node is gone: the note is stale and must not be used
    assert node.slots is None
    assert tree.match(child, len(ctx), touch=False, parent=ctx)[1] == 0


def _step_queries(tree: KVTree, n: int):
    """``n`` particles after a noted 50-token prompt whose KV ends at a node: each query one
    token after a validated parent (a copy per particle: the parent is the prompt's tuple)."""
    prompt = tuple(range(100, 150))
    node = tree.insert(prompt, 0, np.arange(1, 51))
    tree.ends.note(prompt, node)
    return prompt, node, [NextToken(prompt + (t,), parent=prompt) for t in range(n)]


def _plain(level):
    return sorted((p.tokens, p.cached, id(p.holder), p.limit,
                   [(o.index, o.end) for o in p.outputs]) for p in level)


def test_a_uniform_step_is_planned_as_plan_batch_plans_it_without_matching():
    tree = KVTree(1 << 30)
    prompt, node, queries = _step_queries(tree, 8)
    budget = ForwardBudget(1 << 30, 16, 4 * 1000)
    step = plan_step(queries, tree.ends, None, budget)
    general = plan_batch(queries, lambda q, limit: tree.match(
        q.tokens, limit, parent=q.parent, touch=False, segments=False))
    assert len(general) == 1 and _plain(step) == _plain(general[0])
    assert all(p.holder is node and p.cached == 50 and p.n_new == 1 for p in step)


def test_plan_step_leaves_every_other_batch_to_plan_batch():
    tree = KVTree(1 << 30)
    prompt, node, queries = _step_queries(tree, 4)
    budget = ForwardBudget(1 << 30, 16, 4 * 1000)
    assert plan_step(queries, tree.ends, None, budget) is not None
    # a query without a parent, a score, a prefill
    assert plan_step(queries + [NextToken(prompt + (9, 9))], tree.ends, None, budget) is None
    assert plan_step(queries + [Score(prompt, (3,))], tree.ends, None, budget) is None
    assert plan_step(queries + [Prefill(prompt + (5,))], tree.ends, None, budget) is None
    # a parent that is an equal tuple but not the noted one (never trusted), another adapter
    copy = tuple(list(prompt))
    assert plan_step([NextToken(copy + (1,), parent=copy)], tree.ends, None, budget) is None
    assert plan_step(queries, tree.ends, 3, budget) is None
    # a row and a decoding step of one context: one path answers both (plan_batch's)
    step = Step(prompt + (0,), Pick(SamplingParams(), 50, 0), parent=prompt)
    assert plan_step(queries + [step], tree.ends, None, budget) is None
    # the longest context's one-token forward does not fit: answered in pieces
    small = ForwardBudget(budget.working_set(1, 51, 1) - 1, 16, 4 * 1000)
    assert plan_step(queries, tree.ends, None, small) is None
    # the parent's node evicted: the note is stale
    tree.budget_bytes = 1
    tree.evict()
    assert plan_step(queries, tree.ends, None, budget) is None


def test_plan_step_finds_a_parent_with_no_note_by_its_tokens():
    """Particles whose contexts were equal asked one query, so one context object was noted:
    given ``resolve`` (the tree's :meth:`~genback.llm.hf.cache.kvtree.KVTree.end_node`), a
    parent that is an equal but other object is found by its tokens, its step planned as the
    noted parent's is; a parent whose KV ends inside an edge, or is not cached, is not."""
    tree = KVTree(1 << 30)
    prompt, node, queries = _step_queries(tree, 4)
    budget = ForwardBudget(1 << 30, 16, 4 * 1000)
    copy = tuple(list(prompt))
    others = [NextToken(copy + (t,), parent=copy) for t in range(4, 8)]
    assert plan_step(queries + others, tree.ends, None, budget) is None  # (no resolve)
    step = plan_step(queries + others, tree.ends, None, budget, tree.end_node)
    general = plan_batch(queries + others, lambda q, limit: tree.match(
        q.tokens, limit, touch=False, segments=False))
    assert len(general) == 1 and _plain(step) == _plain(general[0])
    assert all(p.holder is node and p.cached == 50 for p in step)
    inside = prompt[:40]  # cached, but inside the prompt's edge: no node ends there
    assert tree.end_node(inside) is None and tree.end_node(prompt + (1,)) is None
    assert plan_step([NextToken(inside + (1,), parent=inside)], tree.ends, None, budget,
                     tree.end_node) is None
    assert plan_step(queries, tree.ends, 3, budget, tree.end_node) is None  # (another adapter)
    assert tree.end_node(copy) is node and tree.end_node(copy, adapter=3) is None


def _grouped_by_the_rule(paths, max_tokens, max_bytes, score_bytes):
    """group_paths' rule applied path by path (the reference for its whole-batch shortcut)."""
    order = sorted(paths, key=lambda r: r.n_new, reverse=True)
    groups, group = [], []
    for r in order:
        trial = group + [r]
        longest = trial[0].n_new
        size = len(trial)
        waste = size * longest - sum(p.n_new for p in trial)
        past = max(p.cached for p in trial)
        if group and (waste > max(32, size * longest // 16) or size * longest > max_tokens
                      or size * longest * (past + longest) * score_bytes > max_bytes):
            groups.append(group)
            trial = [r]
        group = trial
    return groups + [group] if group else groups


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 80), st.integers(0, 500)), min_size=1, max_size=40),
       st.integers(1, 400), st.integers(1, 1 << 22), st.integers(1, 64))
def test_group_paths_agrees_with_its_rule_path_by_path(shapes, max_tokens, max_bytes, score_bytes):
    paths = []
    for n_new, cached in shapes:
        p = Path(tuple(range(cached + n_new)), None, cached, [])
        p.matched(cached, None)
        paths.append(p)
    got = group_paths(paths, max_tokens, max_bytes, score_bytes)
    want = _grouped_by_the_rule(paths, max_tokens, max_bytes, score_bytes)
    assert [[id(p) for p in g] for g in got] == [[id(p) for p in g] for g in want]


def test_a_paths_match_is_set_once():
    tree = _tree_with(tuple(range(100, 110)))
    plan = plan_batch([NextToken(tuple(range(100, 112)))],
                      lambda q, limit: tree.match(q.tokens, limit))
    (path,), = plan
    assert path.cached == 10 and path.n_new == 2
    with pytest.raises(RuntimeError, match="set once"):
        path.matched(0, tree.root)


@pytest.mark.parametrize("decode", ["auto", "eager"])  # (the tree path; the GPU's decode step)
@pytest.mark.parametrize("api", ["gather", "batch_sync"])
async def test_smc_steps_are_planned_from_their_parents_notes(tiny_hf, gpt2_tok, monkeypatch,
                                                              decode, api):
    """An SMC run through the public API (shared prompt, resampling; concurrent
    ``next_token_logprobs`` calls, or ``batch_next_token_logprobs_sync``): every step after the
    prompt is planned by plan_step (no plan_batch, no tree match), one forward per step, no
    context is copied whole (no flat tuple of a step's context is built: genback.queries.context), and
    every row equals an uncached forward."""
    import genback.llm.hf.execute as runner_module
    from test_llm_tree import _max_err, _smc_trace

    from genback.queries.context import Context

    trace = _smc_trace(random.Random(3), 300, 12, 7, 3, 50)  # 300 tokens: the identity check
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, decode=decode)
    try:
        await lm.next_token_logprobs(trace[0][0][:-1])  # the prompt: its KV and its note
        planned, matched = [], []
        plan = runner_module.plan_batch
        monkeypatch.setattr(runner_module, "plan_batch",
                            lambda *a, **k: planned.append(1) or plan(*a, **k))
        match = lm.runner.tree.match
        monkeypatch.setattr(lm.runner.tree, "match",
                            lambda *a, **k: matched.append(1) or match(*a, **k))
        flat, flattened = Context.tokens.fget, []
        monkeypatch.setattr(Context, "tokens", property(
            lambda c: (c._flat is None and flattened.append(len(c))) or flat(c)))
        forwards, worst, refs = lm.forwards, 0.0, {}
        for contexts in trace:
            if api == "gather":
                rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
            else:
                rows = lm.batch_next_token_logprobs_sync(contexts)
            assert not flattened
            worst = max(worst, _max_err(rows, contexts, lm, refs))
            flattened.clear()  # (the check's own forwards may flatten: not the step's)
        assert not planned and not matched
        assert lm.forwards - forwards == len(trace) and worst <= 1e-5
    finally:
        await lm.aclose()
