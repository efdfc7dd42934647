"""``Context`` (a validated context as a shared base plus a short tail) against the flat tuple
of the same ids, and the front's memory of contexts over SMC-shaped runs."""

import gc
import operator

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from genback.queries.context import TAIL_MAX, Context, flat
from genback.core import inputs
from genback.core.inputs import ContextChecker
from genback.queries.kinds import NextToken, context_hash

from test_identity import spy_identity


def _grown(base: list[int], extra: list[int]) -> Context:
    ctx = Context(tuple(base))
    for t in extra:
        ctx = ctx.extend(t)
    return ctx


def test_every_slice_of_small_contexts_equals_the_tuples():
    """Every start/stop pair (empty, reversed and out-of-range ones included) over every split
    of up to six ids into base and tail, against the flat tuple's slice."""
    for n in range(7):
        ids = list(range(10, 10 + n))
        for cut in range(n + 1):
            ctx = _grown(ids[:cut], ids[cut:])
            ref = tuple(ids)
            for a in [None, *range(-n - 2, n + 3)]:
                for b in [None, *range(-n - 2, n + 3)]:
                    got = ctx[a:b]
                    assert type(got) is tuple and got == ref[a:b], (cut, a, b)


@settings(max_examples=200, deadline=None)
@given(base=st.lists(st.integers(0, 999), max_size=80),
       extra=st.lists(st.integers(0, 999), max_size=3 * TAIL_MAX),
       i=st.integers(-300, 300), a=st.one_of(st.none(), st.integers(-300, 300)),
       b=st.one_of(st.none(), st.integers(-300, 300)),
       step=st.sampled_from([None, 1, 2, -1, -3]))
@example(base=[0], extra=[0, 0], i=0, a=1, b=0, step=None)  # an empty slice inside the tail (CI)
def test_a_context_reads_as_its_flat_tuple(base, extra, i, a, b, step):
    ctx = _grown(base, extra)
    ref = tuple(base + extra)
    assert len(ctx) == len(ref) and ctx.tokens == ref and flat(ctx) == ref
    assert len(ctx.tail) <= TAIL_MAX
    assert tuple(ctx) == ref and list(iter(ctx)) == list(ref)
    if -len(ref) <= i < len(ref):
        assert ctx[i] == ref[i]
    else:
        with pytest.raises(IndexError):
            ctx[i]
    got = ctx[a:b:step]
    assert type(got) is tuple and got == ref[a:b:step]
    assert ctx == ref and ref == ctx and not (ctx != ref)
    assert ctx == _grown(list(ref), []) and hash(ctx) == hash(ref)
    assert context_hash(ctx) == context_hash(ref)
    if ref:
        assert ctx != ref[:-1] and ctx != Context(ref[:-1]) and ctx != ref[:-1] + (1000,)
    assert ctx.__eq__([*ref]) is NotImplemented  # (not a list: tuples' own rule)


def test_an_extension_shares_its_base_until_the_tail_is_full():
    root = Context(tuple(range(100)))
    ctx, bases = root, []
    for t in range(3 * TAIL_MAX + 5):
        ctx = ctx.extend(t)
        if not any(ctx.base is b for b in bases):
            bases.append(ctx.base)  # (kept alive: a freed base's id() can be reused)
        assert len(ctx.tail) <= TAIL_MAX
    # one new flat base per TAIL_MAX + 1 extensions: the copies are amortised
    assert len(bases) == 1 + (3 * TAIL_MAX + 5) // (TAIL_MAX + 1)
    assert ctx.tokens == tuple(range(100)) + tuple(range(3 * TAIL_MAX + 5))
    assert root.extend(7).base is root.base  # (siblings share it too)
    with pytest.raises(TypeError, match="ints or slices"):
        root["a"]


def test_queries_of_one_context_are_equal_without_a_flat_tuple():
    ctx = Context(tuple(range(300))).extend(5)
    a, b = NextToken(ctx, None), NextToken(ctx, None)
    assert a == b and hash(a) == hash(b) and ctx._flat is None  # (compared by identity)
    c = NextToken(tuple(range(300)) + (5,), None)  # the same ids as a flat tuple
    assert a == c and c == a and hash(a) == hash(c)
    assert a.tokens == c.tokens and a.context is ctx and c.context is c.tokens
    assert NextToken(Context(tuple(range(300))).extend(6), None) != a


def test_the_checker_follows_a_lineage_past_many_tails(monkeypatch):
    """An SMC particle over 300 steps (beyond several tails): every step is found as its
    parent's extension, by the identity of the base's ints, and equals the caller's ids."""
    calls = spy_identity(monkeypatch)
    check = ContextChecker(vocab_size=50_000)
    ids = [40_000 + i for i in range(400)]  # beyond the small-int cache: distinct objects
    parent, _, none = check.check_context(ids)
    assert none is None
    for step in range(300):
        ids = ids + [int(str(1000 + step))]  # a new int object each step, as int(tensor) gives
        ctx, h, got = check.check_context(ids)
        assert got is parent and h == context_hash(tuple(ids))
        assert ctx == tuple(ids) and ctx[-1] is ids[-1]
        parent = ctx
    assert calls and all(calls)  # every base compared by identity, none fell back to values
    # a caller that changes an id inside an old base or inside the tail is checked in full
    for where in (10, len(ids) - 3):
        bad = list(ids)
        bad[where] = 3
        got, _, p = check.check_context(bad + [9])
        assert p is None and got == tuple(bad) + (9,)


def test_checked_contexts_hold_no_tracked_tuple():
    check = ContextChecker(vocab_size=50_000)
    ids = [1000 + i for i in range(200)]
    ctx, _, _ = check.check_context(ids)
    assert not gc.is_tracked(ctx.base)
    for t in range(TAIL_MAX + 1):
        ids = ids + [2000 + t]
        ctx = check.check_context(ids)[0]
    assert ctx.tail == () and not gc.is_tracked(ctx.base)  # (a new base, untracked)


@pytest.mark.parametrize("params", [
    dict(), dict(repetition_penalty=1.7), dict(presence_penalty=0.4),
    dict(frequency_penalty=0.3), dict(no_repeat_ngram_size=2),
    dict(greedy=False, seed=3, top_k=5)])
def test_a_decoding_step_chooses_from_a_context_as_from_its_tuple(params):
    """The runner hands a decoding step's context to ``choose`` as the front's Context: every
    penalty reads it as it reads the flat tuple of the same ids."""
    import torch

    from genback.queries.sampling import Pick, SamplingParams, choose

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=gen)
    ids = tuple(int(t) for t in torch.randint(0, 50, (150,), generator=gen))
    ctx = _grown(list(ids[:70]), list(ids[70:]))  # (a base, a full tail, a new base, a tail)
    assert ctx.tail and ctx.tokens == ids
    pick = Pick(SamplingParams(logprobs=True, **params), prompt_length=40, step=3)
    assert choose(logits, ctx, pick) == choose(logits, ids, pick)


# -- contexts held by callers (lm.context(ids), then ctx + [token]) -------------------------------

@settings(max_examples=200, deadline=None)
@given(base=st.lists(st.integers(0, 999), min_size=1, max_size=80),
       adds=st.lists(st.lists(st.integers(0, 1100), max_size=2 * TAIL_MAX), max_size=6),
       vocab=st.sampled_from([1000, 1200]))
def test_a_chain_of_plus_reads_as_the_lists_and_checks_its_added_ids_only(base, adds, vocab):
    """``ctx + ids`` over any chain (tails filled and flattened) is the concatenated list; the
    checker takes it (and every context it was made from) exactly when every id is in range,
    with the list's hash, marks it checked, and never runs the whole-context check on it."""
    full = []
    real = inputs.check_token_ids

    def counted(ids, *args, **kwargs):
        full.append(len(ids))
        return real(ids, *args, **kwargs)

    inputs.check_token_ids = counted
    try:
        check = ContextChecker(vocab_size=vocab)
        root, _, _ = check.check_context(list(base))
        assert root.vocab == vocab and full == [len(base)]
        ctx, ref = root, list(base)
        for extra in adds:
            ctx, ref = ctx + extra, ref + extra
            assert list(ctx) == ref and len(ctx.tail) <= TAIL_MAX
        assert (ctx + []) is ctx and ctx == tuple(ref)
        bad = next((i for i, t in enumerate(ref) if t >= vocab), None)
        if bad is not None:
            with pytest.raises(ValueError, match=rf"token_ids\[{bad}\] = {ref[bad]} is outside"):
                check.check_context(ctx)
            assert ctx.vocab == 0  # (not taken: asking again raises again)
        else:
            got, h, parent = check.check_context(ctx)
            assert got is ctx and h == context_hash(tuple(ref)) and ctx.vocab == vocab
            assert ctx.parent is None  # (nothing before it kept alive by it)
            last = next((extra for extra in reversed(adds) if extra), None)
            # the parent, for a one-token extension only (the decode step's plan)
            assert (parent is not None) == (last is not None and len(last) == 1)
            if parent is not None:
                assert list(parent) == ref[:-1] and parent.vocab == vocab
            assert check.check_context(ctx)[0] is ctx  # checked: taken as it is
            assert check.check_context(list(ref))[0] is ctx  # a list of its ids finds it
        assert full == [len(base)]  # the first check alone was a whole-context check
    finally:
        inputs.check_token_ids = real


def test_contexts_checked_for_another_vocabulary():
    """A context checked against a larger vocabulary is checked again, in full, by a model with
    a smaller one (and refused if an id is beyond it); one checked against a smaller one is
    taken by a larger as it is."""
    big, small = ContextChecker(vocab_size=50_000), ContextChecker(vocab_size=1000)
    ctx = big.check_context([10, 20, 30])[0] + [40_000]
    assert big.check_context(ctx)[0] is ctx and ctx.vocab == 50_000
    with pytest.raises(ValueError, match=r"token_ids\[3\] = 40000 is outside"):
        small.check_context(ctx)
    ok = small.check_context([1, 2])[0] + [3]
    assert small.check_context(ok)[0] is ok and ok.vocab == 1000
    assert big.check_context(ok)[0] is ok and ok.vocab == 1000  # (ids < 1000 < 50,000)


def test_a_step_at_a_time_checks_each_added_id():
    """An SMC program's chain, checked at every step (each context extends a checked one by one
    id: the check's one-id case): every context is taken with the list's hash and its parent;
    an id out of range (too large or negative) fails with its index, and the context stays
    unchecked while the chain goes on from its parent."""
    check = ContextChecker(vocab_size=100)
    ctx, ref = check.check_context(list(range(40)))[0], list(range(40))
    for step, token in enumerate([5, 99, 0, 7] * 20):  # (past TAIL_MAX: a new base on the way)
        for bad in (100, -1):
            wrong = ctx + [bad]
            with pytest.raises(ValueError, match=rf"token_ids\[{len(ref)}\] = {bad} is outside"):
                check.check_context(wrong)
            assert wrong.vocab == 0 and wrong.parent is ctx
        nxt = ctx + [token]
        got, h, parent = check.check_context(nxt)
        ref.append(token)
        assert got is nxt and parent is ctx and h == context_hash(tuple(ref)) and nxt.vocab == 100
        assert list(nxt) == ref and nxt.parent is None
        ctx = nxt


def test_plus_takes_integers_only():
    ctx = ContextChecker(vocab_size=100).check_context([1, 2])[0]
    assert list(ctx + [np.int64(5), 6]) == [1, 2, 5, 6] and type((ctx + [np.int64(5)])[-1]) is int
    for bad in ([1.5], [True], [None], ["3"]):
        with pytest.raises(TypeError, match=r"the ids added\[0\] must be an int token id"):
            ctx + bad
    with pytest.raises(TypeError):
        ctx + "ab"
    with pytest.raises(TypeError):
        ctx + 3


async def test_smc_steps_on_context_objects_equal_lists(tiny_hf, gpt2_tok, monkeypatch):
    """The same SMC trace asked as lists and as ``lm.context`` objects extended by ``+`` (two
    fresh models): the same rows, forwards and tokens forwarded, rows equal to uncached
    forwards; the object route checks each step's added token only (no whole-context check
    after the prompt's, no comparison of a context with its parent)."""
    import asyncio

    from genback.llm import AsyncTransformer

    prompt = gpt2_tok.encode("The quick brown fox jumps over the lazy dog. " * 6)
    results = {}
    for route in ("list", "context"):
        lm = AsyncTransformer(tiny_hf, gpt2_tok)
        gen = torch.Generator().manual_seed(0)
        parts = [lm.context(prompt) if route == "context" else list(prompt)] * 8
        full, compared = [], []
        if route == "context":  # (after lm.context: the prompt's own check)
            real, same = inputs.check_token_ids, inputs.same_items
            monkeypatch.setattr(inputs, "check_token_ids",
                                lambda *a, **k: full.append(a) or real(*a, **k))
            monkeypatch.setattr(inputs, "same_items",
                                lambda *a: compared.append(a) or same(*a))
        steps = []
        for step in range(12):
            rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in parts))
            steps.append((list(map(list, parts)), torch.stack(rows)))
            nxt = torch.multinomial(torch.stack(rows).exp(), 1, generator=gen)[:, 0].tolist()
            parts = [p + [t] for p, t in zip(parts, nxt)]
            if step % 4 == 3:
                parts = [parts[i] for i in (0, 0, 1, 1, 2, 3, 3, 3)]
        info = lm.cache_info()
        asked, last = steps[-1]
        for i in (0, 7):
            ref = lm.next_token_logprobs_uncached(asked[i])
            assert (last[i] - ref).abs().max() < 1e-5
        if route == "context":
            assert all(type(p) is Context for p in parts) and not full and not compared
        results[route] = (steps, info["forwards"], info["tokens_forwarded"])
        await lm.aclose()
    (steps_l, fw_l, tok_l), (steps_c, fw_c, tok_c) = results["list"], results["context"]
    for (asked_l, rows_l), (asked_c, rows_c) in zip(steps_l, steps_c):
        assert asked_l == asked_c and torch.equal(rows_l, rows_c)
    assert (fw_c, tok_c) == (fw_l, tok_l)


async def test_context_objects_on_smollm2_and_in_batch_calls(module_smol_lm):
    """The real SmolLM2: rows of ``lm.context`` objects extended by ``+`` (one token, several,
    a chain never asked in between) equal uncached forwards, through ``next_token_logprobs``,
    ``batch_next_token_logprobs`` and ``next_token_logprobs_sync``; a bad id added fails its own
    caller (where awaited), the others are answered."""
    import asyncio

    lm = module_smol_lm
    ids = lm.tokenizer.encode("The capital of France is")
    ctx = lm.context(ids)
    kids = [ctx + [t] for t in lm.tokenizer.encode(" Paris, and the")]
    kids.append(ctx + [11, 12] + [13])  # (a chain: the middle context is never asked)
    bad = ctx + [lm.vocab_size]
    rows = await asyncio.gather(*(lm.next_token_logprobs(k) for k in [*kids, bad]),
                                return_exceptions=True)
    assert isinstance(rows[-1], ValueError) and f"token_ids[{len(ids)}]" in str(rows[-1])
    for k, row in zip(kids, rows):
        assert (row - lm.next_token_logprobs_uncached(list(k))).abs().max() < 1e-4
    batch = await lm.batch_next_token_logprobs(kids)
    assert torch.equal(batch, torch.stack(rows[:-1]))
    assert torch.equal(lm.next_token_logprobs_sync(kids[0] + [5]),
                       lm.next_token_logprobs_sync(list(kids[0]) + [5]))
    assert lm.tokenizer.decode(int(lm.next_token_logprobs_sync(ctx).argmax())) == " Paris"
    with pytest.raises(TypeError, match="token_ids"):
        lm.context("The capital")


@settings(max_examples=100, deadline=None)
@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=2 * TAIL_MAX + 5),
       steps=st.lists(st.lists(st.tuples(st.integers(0, 5), st.integers(-1, 100)),
                               min_size=2, max_size=8), min_size=1, max_size=2 * TAIL_MAX + 3))
def test_a_steps_check_at_once_equals_the_check_of_each_context(prompt, steps):
    """``check_step`` (an SMC step's contexts checked in array passes) against one
    ``check_context`` each, on twin chains of ``lm.context`` objects over many steps (tails
    filled and flattened; parents picked with repeats, as resampling does): the same hashes,
    parents and lengths, the contexts marked checked alike; a step with an id out of range is
    left to the one-by-one check (None, nothing marked), which names it."""
    fast, slow = ContextChecker(vocab_size=100), ContextChecker(vocab_size=100)
    a = [fast.check_context(list(prompt))[0]] * 6
    b = [slow.check_context(list(prompt))[0]] * 6
    for step in steps:
        na = [a[i] + [t] for i, t in step]
        nb = [b[i] + [t] for i, t in step]
        got = fast.check_step(na)
        if any(not 0 <= t < 100 for _, t in step):
            assert got is None and all(c.vocab == 0 and c.parent is not None for c in na)
            bad = next(i for i, (_, t) in enumerate(step) if not 0 <= t < 100)
            with pytest.raises(ValueError, match="is outside"):
                fast.check_context(na[bad])
            continue
        want = [slow.check_context(c) for c in nb]
        checked, hashes, parents, lengths = got
        assert checked == na and all(map(operator.is_, checked, na))
        assert hashes == [h for _, h, _ in want] == [context_hash(tuple(c)) for c in nb]
        assert lengths == [len(c) for c in nb]
        assert [list(p) for p in parents] == [list(p) for _, _, p in want]
        assert all(c.vocab == 100 and c.parent is None for c in na)
        a, b = (na * 6)[:6], (nb * 6)[:6]
    assert fast.check_step([a[0]]) is None  # (one context: the one-by-one check)
    assert fast.check_step([list(prompt) + [1], list(prompt) + [2]]) is None  # (lists: too)
