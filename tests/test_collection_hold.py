"""Young collections held while a batch is pending, until its first forward is issued
(``genback.cpython``'s fourth trick, the batcher's ``defer_collections``): an SMC step over the
tiny GPT-2 runs no young collection between its first query and its forward, gives the same rows,
and the threshold is the program's again after every way a batch can leave."""

from __future__ import annotations

import asyncio
import gc
import random

import pytest
import torch

from genback.batching import batcher as batcher_module
from genback import cpython
from genback.batching.batcher import Batcher, BatcherClosed
from genback.llm import AsyncTransformer


@pytest.fixture
def collections():
    """``events``: ``"gc"`` at each collection's start, in order with what the test appends."""
    events: list = []

    def noted(phase, info):
        if phase == "start":
            events.append("gc")
    gc.callbacks.append(noted)
    try:
        yield events
    finally:
        gc.callbacks.remove(noted)


def _smc_steps(lm, events, particles=256, steps=6, seed=0):
    """An SMC-shaped run on lists (each step ``parent + [token]``, resampled every 3 steps),
    its forwards marked in ``events``; returns every step's rows and each step's events."""
    rng = random.Random(seed)
    prompt = [rng.randrange(50000) for _ in range(200)]
    # (the decode step's forward: a planned step's and a chained one's, .chain.StepChain)
    forward, runner_run = lm.runner.decode_step.forward, lm.runner.run

    def marked(*args, **kwargs):
        events.append("forward")
        return forward(*args, **kwargs)

    def answered(*args, **kwargs):
        out = runner_run(*args, **kwargs)
        events.append("answered")
        return out
    lm.runner.decode_step.forward, lm.runner.run = marked, answered
    per_step, rows = [], []

    async def run():
        parts = [list(prompt) for _ in range(particles)]
        await lm.next_token_logprobs(prompt)
        for s in range(steps):
            if s and s % 3 == 0:
                parts = [list(parts[rng.randrange(particles)]) for _ in range(particles)]
            parts = [p + [rng.randrange(64)] for p in parts]
            events.clear()
            events.append("step")
            rows.append(torch.stack(await asyncio.gather(
                *(lm.next_token_logprobs(c) for c in parts))))
            per_step.append(list(events))
    asyncio.run(run())
    return rows, per_step


def _before_forward(step_events, since="step"):
    """Collections in a step before its forward, from its start (or its first query joining the
    batch: ``since="held"``, when the batch's hold was taken)."""
    return step_events[step_events.index(since):step_events.index("forward")].count("gc")


# a first threshold below what one step's way in allocates on every version (256 queries: more
# than 256 new containers), so that without the hold collections fall there whatever the
# interpreter's default (700 through 3.12, 2,000 from 3.13: at 2,000 a step may start none)
LOW = 200


def _run_smc(tiny_hf, gpt2_tok, events, defer):
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.01, decode="eager")
    assert lm.scheduler.defer_collections is False  # (a CPU model: off by default)
    lm.scheduler.defer_collections = defer
    try:
        got = _smc_steps(lm, events)
        assert lm.scheduler.inline_batches >= 6  # (the steps ran inline: lockstep)
        assert lm.cache_info()["chained_steps"] >= 3  # (planned steps and chained ones)
    finally:
        lm.close()
    return got


@pytest.mark.skipif(not cpython.ENABLED, reason="GENBACK_CPYTHON_SPEEDUPS=0 turns it off")
def test_a_step_runs_no_young_collection_before_its_forward(tiny_hf, gpt2_tok, collections,
                                                            monkeypatch):
    """What the hold guarantees, counted on this interpreter: at a threshold low enough that
    collections start in every step's way in without the hold, with it none starts between a
    step's first query joining its batch (the hold taken: ``gather`` makes its tasks before any
    query runs) and its forward, and the one that was due starts right after the forward; at
    the interpreter's own threshold, none there either; rows identical."""
    assert "hold_collections" not in cpython.STEPPED_ASIDE  # (its premise holds: counted at import)

    def marked_hold():  # (the step's first query joined its pending batch)
        collections.append("held")
        return cpython.hold_collections()
    monkeypatch.setattr(batcher_module, "hold_collections", marked_hold)
    before = gc.get_threshold()
    got = {}
    try:
        gc.set_threshold(LOW, *before[1:])  # (the program's threshold: a hold puts it back)
        for defer in (False, True):
            got[defer] = _run_smc(tiny_hf, gpt2_tok, collections, defer)
            assert gc.get_threshold() == (LOW, *before[1:])
    finally:
        gc.set_threshold(*before)
    (rows_off, steps_off), (rows_on, steps_on) = got[False], got[True]
    # without the hold, collections start in every step's way in (256 queries allocate more
    # than the threshold); with it, none from the hold to the forward, and the one that was due
    # right after it, before the runner has answered the step (it released the hold:
    # forward_issued)
    assert all(_before_forward(s) >= 1 for s in steps_off), steps_off
    assert [_before_forward(s, "held") for s in steps_on] == [0] * len(steps_on)
    assert all("gc" in s[s.index("forward"):s.index("answered")] for s in steps_on[1:])
    # at the interpreter's own threshold the guarantee is the same
    rows_own, steps_own = _run_smc(tiny_hf, gpt2_tok, collections, True)
    assert gc.get_threshold() == before
    assert [_before_forward(s, "held") for s in steps_own] == [0] * len(steps_own)
    for a, b, c in zip(rows_off, rows_on, rows_own):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_the_hold_premise_is_counted_on_this_interpreter():
    """The import-time count the hold relies on, again: new containers start collections at a
    low first threshold and none at :data:`genback.cpython.HELD_THRESHOLD`; thresholds back."""
    before = gc.get_threshold()
    assert cpython._count_collections(100, 1000) >= 1
    assert cpython._count_collections(cpython.HELD_THRESHOLD, 1000) == 0
    assert gc.get_threshold() == before
    assert cpython._hold_premise() is None


def test_holds_nest_and_leave_a_threshold_the_program_set(monkeypatch):
    before = gc.get_threshold()
    try:
        a, b = cpython.CollectionHold(), cpython.CollectionHold()
        assert gc.get_threshold()[0] == cpython.HELD_THRESHOLD
        a.release()
        a.release()  # (twice: nothing)
        assert gc.get_threshold()[0] == cpython.HELD_THRESHOLD  # b still holds
        b.release()
        assert gc.get_threshold() == before
        c = cpython.CollectionHold()
        gc.set_threshold(5000, *before[1:])  # the program's own change, during a hold
        c.release()
        assert gc.get_threshold()[0] == 5000
        gc.set_threshold(0, *before[1:])  # collections off: a hold leaves them off
        d = cpython.CollectionHold()
        assert gc.get_threshold()[0] == 0
        d.release()
        assert gc.get_threshold()[0] == 0
        monkeypatch.setattr(cpython, "ENABLED", False)
        assert cpython.hold_collections() is None
    finally:
        gc.set_threshold(*before)


def _batcher(compute):
    b = Batcher(compute, window=0.05, max_batch_size=64)
    b.defer_collections = True
    return b


def test_every_way_a_batch_leaves_puts_the_threshold_back():
    """Inline (the cohort in), on the worker (its window), failed, all callers cancelled,
    reset while pending: the threshold is the program's again after each."""
    before = gc.get_threshold()
    seen = []

    def compute(queries):
        seen.append(gc.get_threshold()[0])
        if "bad" in queries:
            raise ValueError("bad query")
        return [q * 2 for q in queries]
    b = _batcher(compute)

    async def run():
        assert await b.submit(1, 1) == 2  # the first batch: its window, on the worker
        assert seen[-1] == before[0]  # (released at the dispatch to the worker)
        for _ in range(3):  # lockstep: inline, held until the computation (no forward here)
            assert await asyncio.gather(*(b.submit(k, k) for k in range(4))) == [0, 2, 4, 6]
        assert b.inline_batches >= 1 and seen[-1] == cpython.HELD_THRESHOLD
        assert gc.get_threshold() == before
        with pytest.raises(ValueError, match="bad query"):
            await asyncio.gather(*(b.submit(k, k) for k in ("bad", 1, 2, 3)))
        assert gc.get_threshold() == before
        task = asyncio.ensure_future(b.submit(9, 9))  # pending, then cancelled: never computed
        await asyncio.sleep(0)
        assert gc.get_threshold()[0] == cpython.HELD_THRESHOLD
        task.cancel()
        await asyncio.sleep(0.1)  # (its window passes: the empty batch is dropped)
        assert gc.get_threshold() == before
        pending = asyncio.ensure_future(b.submit(7, 7))
        await asyncio.sleep(0)
        assert b.reset() == 1
        with pytest.raises(BatcherClosed):
            await pending
        assert gc.get_threshold() == before
    try:
        asyncio.run(run())
    finally:
        b.close()
        gc.set_threshold(*before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")
@pytest.mark.skipif(not cpython.ENABLED, reason="GENBACK_CPYTHON_SPEEDUPS=0 turns it off")
def test_on_cuda_by_default_no_young_collection_before_a_captured_step(tiny_hf, gpt2_tok,
                                                                       collections, monkeypatch):
    """A CUDA model's default: held (``defer_collections`` True), through the captured decode
    step (``decode="auto"``): no collection from a step's first query joining its batch (the
    hold taken; ``gather`` makes its tasks before) to its forward, the threshold back."""
    import copy

    def marked_hold():
        collections.append("held")
        return cpython.hold_collections()
    monkeypatch.setattr(batcher_module, "hold_collections", marked_hold)
    before = gc.get_threshold()
    lm = AsyncTransformer(copy.deepcopy(tiny_hf).to("cuda"), gpt2_tok, batch_window=0.01)
    try:
        assert lm.scheduler.defer_collections is True
        _, steps = _smc_steps(lm, collections)
        assert [_before_forward(s, "held") for s in steps] == [0] * len(steps)
        assert lm.cache_info()["decode_steps"] >= 5
    finally:
        lm.close()
    assert gc.get_threshold() == before


def test_a_batch_left_pending_when_its_loop_closed_stops_holding_at_the_next_loop():
    """``asyncio.run`` returns while a query is pending (its task cancelled at shutdown, the
    batch never dispatched): the hold lasts only until the batcher serves the next loop."""
    before = gc.get_threshold()
    b = _batcher(lambda queries: list(queries))

    async def leave_pending():
        asyncio.ensure_future(b.submit(1, 1))
        await asyncio.sleep(0)  # (its query joins the batch; the window never ends)

    async def ask():
        return await b.submit(2, 2)
    try:
        asyncio.run(leave_pending())
        assert gc.get_threshold()[0] == cpython.HELD_THRESHOLD  # (raised, never off)
        assert asyncio.run(ask()) == 2
        assert gc.get_threshold() == before
    finally:
        b.close()
        gc.set_threshold(*before)
