"""The tree path's uniform steps laid out from the last step's rows (genback.llm.hf.plan.lanes
in genback.llm.hf.forward.tree): every row's slots are its cached context's slots in the
tree plus its new slot, checked at every step against a walk of the tree; rows equal an uncached
forward; counted steps; another adapter retires the rows (a freed slot: test_decode_step)."""

from __future__ import annotations

import random

import numpy as np

from genback.llm import AsyncTransformer
from genback.llm.hf.cache.nodes import prefix_segments
from genback.llm.hf.forward import tree as tree_forward
from genback.llm.hf.plan.lanes import REFRESH, Lanes

from test_decode_step import _run_trace
from test_llm_tree import _smc_trace


def _spy_on_layouts(monkeypatch) -> list:
    """Check, at every tree forward of one new token per path, that each row reads exactly its
    cached context's slots (the shared segments it is listed under, then its row without
    padding; attention is indifferent to their order) plus its new slot. Returns the list of
    forwards checked (rows each)."""
    checked = []
    run, tree_batch = tree_forward.TreeForward.run, tree_forward._tree_batch
    current = {}

    def spy_run(self, paths, uniform=False):
        current["paths"] = paths
        return run(self, paths, uniform)

    def spy_batch(kernel, pool, shared, layout, pads, slots, R, m, known=None):
        paths = current["paths"]
        if m == 1:
            for i, p in enumerate(paths):
                tree = [s for _, _, s in prefix_segments(p.holder, p.cached)]
                want = np.sort(np.concatenate(tree + [slots[i]]))
                mine = [s for s, idx in shared if i in set(idx)]
                got = np.sort(np.concatenate(mine + [layout[i, pads[i]:]]))
                assert np.array_equal(got, want)
            checked.append(R)
        return tree_batch(kernel, pool, shared, layout, pads, slots, R, m, known)

    monkeypatch.setattr(tree_forward.TreeForward, "run", spy_run)
    monkeypatch.setattr(tree_forward, "_tree_batch", spy_batch)
    return checked


def _spy_on_masks(monkeypatch) -> list:
    """Record, at every tree forward of one new token per path, ``(a row is padded, no mask
    was built)``; returns the list it fills."""
    seen = []
    tree_batch = tree_forward._tree_batch

    def spy_batch(kernel, pool, shared, layout, pads, slots, R, m, known=None):
        batch = tree_batch(kernel, pool, shared, layout, pads, slots, R, m, known)
        if m == 1:
            seen.append((bool(pads.any()), batch.mask is None))
        return batch

    monkeypatch.setattr(tree_forward, "_tree_batch", spy_batch)
    return seen


def _extended_trace(rng: random.Random, parts: list, steps: int, resample) -> list:
    """The contexts of ``steps`` steps: each step ``parts = resample(step, parts)``, then every
    particle extended by one random token."""
    trace = []
    for step in range(steps):
        parts = resample(step, parts)
        for p in parts:
            p.append(100 + rng.randrange(50))
        trace.append([list(p) for p in parts])
    return trace


def test_tree_steps_from_the_last_steps_rows_read_the_trees_slots(tiny_hf, gpt2_tok,
                                                                  monkeypatch):
    """SMC with resampling over more steps than a lane table lives, on the tree path (the CPU's
    default): each step after a full layout is the last step's rows plus a column (counted:
    all but one in every REFRESH + 1), every row reads its context's slots, and rows equal an
    uncached forward."""
    checked = _spy_on_layouts(monkeypatch)
    trace = _smc_trace(random.Random(11), 80, 16, 2 * REFRESH + 5, 3, 50)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0)
    lm.runner.chain = None  # (every step planned: the chain's steps, test_step_chain.py)
    try:
        assert lm.runner.decode_step is None  # (the tree path)
        lm.cache_kv(trace[0][0][:-1])
        assert _run_trace(lm, trace, {}) <= 1e-5
        info = lm.cache_info()
        assert len(checked) == len(trace) and info["forwards"] == len(trace) + 1
        full = len(trace) - info["tree_lane_steps"]
        assert full == -(-len(trace) // (REFRESH + 1))
    finally:
        lm.close()


def test_segments_shared_by_some_rows_follow_their_rows(tiny_hf, gpt2_tok, monkeypatch):
    """Particles over two prompts (each read in place by its own rows, min_shared_tokens=8),
    resampled across both: a step from lanes lists each shared segment under the rows that
    extend one of its rows, and rows equal an uncached forward."""
    checked = _spy_on_layouts(monkeypatch)
    rng = random.Random(4)
    prompts = [[100 + rng.randrange(50) for _ in range(40)] for _ in range(2)]
    parts = [list(prompts[i % 2]) for i in range(8)]

    def resample(step, parts):  # every 4 steps: the prompts' shares of rows change
        if step and step % 4 == 0:
            return [list(parts[rng.choice([0, 2, 4, 1])]) for _ in range(8)]
        return parts

    trace = _extended_trace(rng, parts, 12, resample)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0,
                          min_shared_tokens=8)
    lm.runner.chain = None  # (every step planned: the chain's steps, test_step_chain.py)
    try:
        lm.batch_next_token_logprobs_sync([p[:-1] for p in trace[0]])
        assert _run_trace(lm, trace, {}) <= 1e-5
        assert lm.cache_info()["tree_lane_steps"] >= len(trace) - 2 and len(checked) >= 12
    finally:
        lm.close()


def test_a_decode_step_with_no_padded_row_attends_without_a_mask(tiny_hf, gpt2_tok,
                                                                 monkeypatch):
    """Particles over two prompts of different lengths, nothing read as shared (every past
    private, so the shorter rows are left-padded), then all resampled onto one prompt (no row
    padded): a decode step builds its mask exactly when a row is padded, and every row equals
    an uncached forward either way."""
    seen = _spy_on_masks(monkeypatch)
    rng = random.Random(9)
    prompts = [[100 + rng.randrange(50) for _ in range(n)] for n in (30, 37)]
    parts = [list(prompts[i % 2]) for i in range(6)]
    # at step 5 every particle onto the longer prompt: pasts of one length
    trace = _extended_trace(rng, parts, 10, lambda step, parts: (
        [list(parts[1]) for _ in range(6)] if step == 5 else parts))
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0,
                          min_shared_tokens=1000)
    try:
        assert lm.runner.decode_step is None  # (the tree path)
        assert _run_trace(lm, trace, {}) <= 1e-5
    finally:
        lm.close()
    assert all(padded != unmasked for padded, unmasked in seen)
    assert {padded for padded, _ in seen} == {True, False}


def test_rows_of_another_adapter_or_a_stale_pool_are_not_reused():
    """``Lanes.rows``: each parent context's row by its identity, else by an equal
    context's (another object: a twin whose query was answered); None for a group of another
    adapter, after the pool freed slots, once a full layout is due, or for a parent equal to no
    row (one of the same length and last id that differs before it included)."""
    parents = [(1, 2, 3), (1, 2, 4)]
    lanes = Lanes(parents, None, np.array([[7, 8], [7, 9]]), np.zeros(2, dtype=np.int64), [],
                  5, 0)
    assert lanes.rows([parents[1], parents[0], parents[1]], None, 5).tolist() == [1, 0, 1]
    assert lanes.rows(parents, 3, 5) is None
    assert lanes.rows(parents, None, 6) is None
    twin = tuple(parents[0])[:2] + (3,)  # equal to parents[0], another object
    assert twin is not parents[0]
    assert lanes.rows([parents[1], twin], None, 5).tolist() == [1, 0]
    assert lanes.rows([(1, 5, 3)], None, 5) is None  # (same length and last id, not equal)
    assert lanes.rows([(2, 4)], None, 5) is None
    assert lanes.rows([], None, 5) is None
    old = Lanes(parents, None, lanes.table, lanes.pads, [], 5, REFRESH)
    assert old.rows(parents, None, 5) is None
