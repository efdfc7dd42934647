"""``Context`` (a validated context as a shared base plus a short tail) against the flat tuple
of the same ids, and the front's memory of contexts over SMC-shaped runs."""

import gc

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from genback.context import TAIL_MAX, Context, flat
from genback.core.inputs import ContextChecker
from genback.query import NextToken, context_hash

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
    ctx, bases = root, set()
    for t in range(3 * TAIL_MAX + 5):
        ctx = ctx.extend(t)
        bases.add(id(ctx.base))
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

    from genback.sampling import Pick, SamplingParams, choose

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=gen)
    ids = tuple(int(t) for t in torch.randint(0, 50, (150,), generator=gen))
    ctx = _grown(list(ids[:70]), list(ids[70:]))  # (a base, a full tail, a new base, a tail)
    assert ctx.tail and ctx.tokens == ids
    pick = Pick(SamplingParams(logprobs=True, **params), prompt_length=40, step=3)
    assert choose(logits, ctx, pick) == choose(logits, ids, pick)
