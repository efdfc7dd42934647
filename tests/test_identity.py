"""genback.cpython.same_items against Python's own comparisons, and the context checker's two
ways of matching a remembered context (identity in C, then values) giving the same answers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genback import cpython as identity
from genback.cpython import same_items
from genback.core import inputs
from genback.core.inputs import IDENTITY_MIN, ContextChecker


def test_it_is_available_on_this_interpreter():
    # CI and the development machine run CPython with the GIL: the fast path must be on there
    assert identity.AVAILABLE


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), max_size=30),
       st.booleans(), st.data())
def test_same_items_agrees_with_identity_item_by_item(a, b, as_list, data):
    pool = [object() for _ in range(4)]  # four distinct objects, compared by identity only
    seq = [pool[i] for i in a]
    tup = tuple(pool[i] for i in b)
    n = data.draw(st.integers(0, min(len(seq), len(tup))))
    seq = seq if as_list else tuple(seq)
    assert same_items(seq, tup, n) == all(x is y for x, y in zip(seq[:n], tup[:n]))


def test_equal_but_distinct_objects_are_not_the_same_items():
    big = [10**12 + i for i in range(40)]
    copies = [int(str(x)) for x in big]  # equal values, new objects
    assert copies == big and not same_items(copies, tuple(big), 40)
    assert same_items(list(big), tuple(big), 40)
    assert not same_items(iter([]), (), 0)  # only lists and tuples
    # never read past either: a length beyond one of them is a plain False
    assert not same_items(big, tuple(big), 41) and not same_items(big + [1], tuple(big), 41)
    assert not same_items(big, tuple(big), -1)


def spy_identity(monkeypatch) -> list[bool]:
    """The answers of every identity check the front's checker makes from now on."""
    answers = []

    def spy(seq, tup, n):
        answers.append(same_items(seq, tup, n))
        return answers[-1]

    monkeypatch.setattr(inputs, "same_items", spy)
    return answers


@pytest.mark.parametrize("rebuild", [False, True])
def test_the_checker_finds_the_parent_by_identity_or_by_value(rebuild, monkeypatch):
    """An SMC step's context: its parent's very ints plus one (identity), or the same values as
    new int objects (``tolist()`` each step: values); the same validated answer either way."""
    answers = spy_identity(monkeypatch)
    check = ContextChecker(vocab_size=50_000)
    ctx = [40_000 + i for i in range(300)]  # beyond the small-int cache: distinct objects
    parent, _, _ = check.check_context(ctx)
    step = [int(str(t)) for t in ctx] + [7] if rebuild else ctx + [7]
    ids, h, got_parent = check.check_context(step)
    assert got_parent is parent and ids == parent.tokens + (7,)
    assert ids.base is parent.base and ids.tail == (7,)  # (no copy of the context)
    assert answers == [not rebuild]  # compared by identity (or, after a miss, by value)
    # the same context again: the remembered context itself
    again, _, none = check.check_context(list(step))
    assert again is ids and none is None
    # a context that differs from the parent in the middle is not its extension
    other = list(ctx)
    other[150] = 3
    ids2, _, p2 = check.check_context(other + [7])
    assert p2 is None and ids2[150] == 3 and ids2 != ids


def test_a_mutated_list_is_checked_again():
    check = ContextChecker(vocab_size=100)
    ctx = list(range(60))
    first = check(ctx)
    ctx[10] = 99  # the caller reuses its list
    second = check(ctx)
    assert second[10] == 99 and first[10] == 10
    with pytest.raises(ValueError, match=r"token_ids\[10\] = 100"):
        ctx[10] = 100
        check(ctx)


def test_short_contexts_are_compared_by_value(monkeypatch):
    monkeypatch.setattr(inputs, "same_items", lambda *a: pytest.fail("identity for a short one"))
    check = ContextChecker(vocab_size=100)
    ctx = [i % 100 for i in range(IDENTITY_MIN - 2)]
    parent = check.check_context(ctx)[0]
    assert check.check_context(ctx + [5])[2] is parent and check.check_context(ctx)[0] is parent
    assert check(ctx) is parent.tokens
