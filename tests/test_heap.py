"""The heap freeze at the first model's construction (genback.cpython)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import gc, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel
sys.path.insert(0, {tests!r})
from _vocab_fixtures import gpt2_tokenizer
from genback.llm import AsyncTransformer
tok = gpt2_tokenizer()
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=16, n_layer=1, n_head=2)
before = gc.get_freeze_count()
walked_before = len(gc.get_objects())  # (what a full collection walks: the generations)
lm = AsyncTransformer(GPT2LMHeadModel(cfg).eval(), tok)
after_first = gc.get_freeze_count()
walked_after = len(gc.get_objects())
kept = [{{}} for _ in range(5000)]  # tracked objects a second freeze would take
AsyncTransformer(GPT2LMHeadModel(cfg).eval(), tok)
print(walked_before, walked_after, before, after_first, gc.get_freeze_count())
"""


def _run(env_value):
    env = dict(os.environ)
    env.pop("GENBACK_CPYTHON_SPEEDUPS", None)
    if env_value is not None:
        env["GENBACK_CPYTHON_SPEEDUPS"] = env_value
    tests = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=tests)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [int(x) for x in out.stdout.split()[-5:]]


def test_first_model_freezes_the_loaded_heap_once():
    walked_before, walked_after, before, first, second = _run(None)
    assert before == 0
    assert first > 10_000  # torch, transformers and the model's objects
    # counted on this interpreter: the frozen objects left the generations a collection walks
    assert walked_after < walked_before // 10
    # the second model does not freeze again: the 5,000 objects made in between stay
    # collectable (the permanent generation's count moves only by objects retracked meanwhile)
    assert abs(second - first) < 1_000


def test_gc_freeze_can_be_turned_off():
    walked_before, walked_after, *frozen = _run("0")
    assert frozen == [0, 0, 0] and walked_after > walked_before // 2


def test_validated_contexts_are_untracked_by_the_garbage_collector():
    import gc

    from genback.cpython import UNTRACK_MIN, untrack_ids
    from genback.core.inputs import ContextChecker

    checker = ContextChecker(vocab_size=50_000)
    prompt = [1000 + i for i in range(UNTRACK_MIN + 300)]  # ints the interpreter does not cache
    ids, _, parent = checker.check_context(list(prompt))  # the full check
    assert parent is None and not gc.is_tracked(ids.tokens) and ids == tuple(prompt)
    step, _, parent = checker.check_context(prompt + [7])  # an extension by one token
    assert parent is ids and step.base is ids.base and step == (*prompt, 7)
    assert not gc.is_tracked(step.tokens)  # (its flat tuple, once asked for)
    assert checker.check_context(prompt + [7])[0] is step  # seen before: the same one back
    assert checker.check(prompt + [7])[0] is step.tokens  # (as a flat tuple: the same too)
    gc.disable()  # (a collection in between would untrack the short tuple itself)
    try:
        short = tuple(range(1000, 1000 + UNTRACK_MIN - 1))
        assert untrack_ids(short) is short and gc.is_tracked(short)  # (not worth the call)
        long = tuple(range(1000, 1000 + UNTRACK_MIN))
        assert gc.is_tracked(long)
        assert untrack_ids(long) is long and not gc.is_tracked(long)
    finally:
        gc.enable()
    try:
        untrack_ids(list(long))
    except TypeError as e:
        assert "tuple" in str(e)
    else:
        raise AssertionError("untrack_ids accepted a list")


def test_kv_tree_edges_are_untracked_by_the_garbage_collector():
    """The KV tree's edges are tuples of token ids that live as long as their nodes: a new leaf's
    edge, both halves of a split edge and a merged chain's edge are untracked when they reach
    UNTRACK_MIN tokens (no collection walks them), shorter ones are left to the collector."""
    import gc

    import numpy as np

    from genback.cpython import UNTRACK_MIN
    from genback.llm.hf.cache.kvtree import KVTree

    def kv(n):  # n pool slots (the tree only indexes them here)
        return np.arange(1, n + 1)

    gc.disable()  # (a collection would untrack the short edges itself)
    try:
        tree = KVTree(1 << 30)
        prompt = tuple(range(1000, 1000 + 2 * UNTRACK_MIN))
        leaf = tree.insert(prompt, 0, kv(len(prompt)))
        assert leaf.edge == prompt and not gc.is_tracked(leaf.edge)
        # a context that leaves the prompt after UNTRACK_MIN tokens splits its edge there
        other = prompt[:UNTRACK_MIN] + (7,)
        tree.insert(other, UNTRACK_MIN, kv(1))
        upper = leaf.parent
        assert upper.edge == prompt[:UNTRACK_MIN] and not gc.is_tracked(upper.edge)
        assert leaf.edge == prompt[UNTRACK_MIN:] and not gc.is_tracked(leaf.edge)
        # one-token steps below the leaf, merged geometrically by compact
        ctx, node = prompt, leaf
        for t in range(2 * UNTRACK_MIN):
            ctx = ctx + (t,)
            node = tree.insert(ctx, len(ctx) - 1, kv(1), near=node)
            node = tree.compact(node)
        edges = []
        while node.parent is not None:
            edges.append(node.edge)
            node = node.parent
        assert sum(map(len, edges)) == len(ctx)
        # a merged edge holds step tokens (< 1000) and is long: untracked like every long edge
        assert any(len(e) >= UNTRACK_MIN and min(e) < 1000 for e in edges)
        assert all(not gc.is_tracked(e) for e in edges if len(e) >= UNTRACK_MIN)
    finally:
        gc.enable()


def test_one_switch_turns_every_cpython_speedup_off():
    """``GENBACK_CPYTHON_SPEEDUPS=0``: contexts are compared by value (``same_items`` answers
    nothing), no tuple is untracked, the heap is not frozen, no collection is held; on (the
    default) all four act: their premises hold on every tested version (none steps aside)."""
    script = (
        "import gc\n"
        "from genback import cpython\n"
        "t = tuple(range(1000, 1100)); a, b = object(), object()\n"
        "print(int(cpython.ENABLED), int(cpython.same_items([a, b], (a, b), 2)),\n"
        "      int(gc.is_tracked(cpython.untrack_ids(t))), int(cpython.freeze_startup_heap()),\n"
        "      int(cpython.hold_collections() is not None), len(cpython.STEPPED_ASIDE))\n")
    for value, want in (("0", [0, 0, 1, 0, 0, 4]), ("1", [1, 1, 0, 1, 1, 0])):
        env = dict(os.environ, GENBACK_CPYTHON_SPEEDUPS=value)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert [int(x) for x in out.stdout.split()] == want, value


def test_a_trick_that_steps_aside_says_why_in_a_debug_line(caplog, monkeypatch):
    import logging

    from genback import cpython

    monkeypatch.setattr(cpython, "STEPPED_ASIDE", {})
    monkeypatch.setattr(cpython, "ENABLED", True)
    with caplog.at_level(logging.DEBUG, logger="genback.cpython"):
        assert cpython._step_aside("hold_collections", "a premise that fails") is None
    assert cpython.STEPPED_ASIDE == {"hold_collections": "a premise that fails"}
    assert cpython.hold_collections() is None  # (it steps aside)
    [record] = caplog.records
    assert record.levelno == logging.DEBUG and "hold_collections steps aside" in record.message
    assert sys.version.split()[0] in record.message and "a premise that fails" in record.message
