"""Smoke test of ``benchmarks/bench_host.py``: its ``--quick`` path runs in-process on the tiny
model; asserts on the work done and the answers, never on time."""

from __future__ import annotations

import asyncio
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from genback.llm.hf.plan.lanes import REFRESH

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_host.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_host", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(bench):
    return bench.load("tiny", 512)


def test_tiny_tokenizer_is_a_trained_bpe(bench, tiny):
    model, tok = tiny
    assert len(tok) == 512 == model.get_output_embeddings().weight.shape[0]
    text = "The miller moved his sacks of grain to the loft."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 1.5  # merges learnt, not bytes
    assert model.config.max_position_embeddings >= 16_100
    assert len(bench.text_ids(tok, 3000)) == 3000


def test_quick_run_answers_every_query(bench, capsys):
    results = bench.main(["--quick"])
    out = capsys.readouterr().out
    args = bench.parse(["--quick"])
    assert [(r["n"], r["context"]) for r in results["smc"]] == [
        (n, c) for n in args.particles for c in args.contexts]
    for r in results["smc"]:
        assert r["answered"] == r["queries"] == r["n"] * args.steps
        assert r["rows_ok"]
        assert r["err"] <= 1e-5
        assert r["fwd_per_step"] >= 1
        assert all(math.isfinite(r[k])
                   for k in ("wall", "fwd", "host", "caller", "worker", "floor", "own"))
        assert r["floor"] > 0 and r["own"] == r["caller"] + r["worker"] - r["floor"]
        assert r["info"]["queries"] >= r["queries"]
        hand = r["loop"]  # the hand-written loop on the same trace shape: exact, and timed
        assert hand is not None and hand["err"] <= 1e-5
        assert math.isfinite(hand["host"]) and hand["fwd"] > 0
    nested = results["nested"]
    assert nested["rows"] == (args.nested_len, 512)
    assert nested["score"]["forwards"] == 1
    assert nested["diff"] <= 1e-5
    assert out.count("| tiny |") == len(results["smc"]) + 1


def test_cell_rows_match_an_uncached_forward(bench, tiny):
    """The clocks wrap the public API without changing what it answers: a measured step's
    rows equal an uncached forward's, and the hooks saw the forwards genback counted."""
    from genback.llm import AsyncTransformer

    model, tok = tiny
    torch.set_num_threads(1)

    async def run():
        lm = AsyncTransformer(model, tok)
        timer = bench.ForwardTimer(model)
        clock = bench.StepClock(timer, lm)
        prompt = bench.text_ids(tok, 200)
        contexts = [prompt + [5], prompt + [7], prompt + [5], prompt]
        try:
            await lm.next_token_logprobs(prompt)
            f0, calls0 = lm.cache_info()["forwards"], timer.calls
            rows = await clock.step(contexts)
            forwards, calls = lm.cache_info()["forwards"] - f0, timer.calls - calls0
            await clock.step(contexts[:2])  # (a second step: each step's host time is kept)
        finally:
            timer.remove()
            await lm.aclose()
        return contexts, rows, forwards, calls, clock

    contexts, rows, forwards, calls, clock = asyncio.run(run())
    pq = clock.per_query()
    assert forwards >= 1 and calls >= forwards
    assert pq["queries"] == 6 and len(clock.host_steps) == 2
    # the median step's host time lies between the two steps' (the sums' host/q does not)
    assert min(clock.host_steps) * 1e3 <= pq["host_med"] <= max(clock.host_steps) * 1e3
    assert math.isclose(pq["host"] * 6 / 1e6, sum(clock.host_steps), rel_tol=1e-9)
    for row, ref in zip(rows, bench.reference_rows(model, contexts)):
        assert torch.allclose(row, ref, atol=1e-5, rtol=0)


def test_long_run_reports_every_step(bench, tiny):
    """``benchmarks/bench_long_run.py``'s run: one forward per step, every step's KV bytes read
    counted, a wall and a host figure for every step."""
    import sys

    sys.path.insert(0, str(BENCH.parent))  # (it imports bench_host by name)
    try:
        spec = importlib.util.spec_from_file_location("bench_long_run",
                                                      BENCH.parent / "bench_long_run.py")
        long_run = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(long_run)
    finally:
        sys.path.remove(str(BENCH.parent))
    model, tok = tiny
    r = asyncio.run(long_run.run(model, tok, 8, 100, 12, 3, 0))
    assert len(r["wall"]) == len(r["host"]) == len(r["read"]) == 12
    assert r["info"]["forwards"] == 13  # the prefill, then one forward per step
    assert all(b > 0 for b in r["read"])
    assert all(math.isfinite(h) and math.isfinite(w) for h, w in zip(r["host"], r["wall"]))


def test_batch_route_answers_every_query_as_the_gather(bench):
    """``--api batch``: the same trace through one ``batch_next_token_logprobs`` call a step;
    the same rows (so the same sampled trace) and the same forwards as the ``gather``."""
    args = ["--quick", "--no-nested", "--particles", "8", "--contexts", "100"]
    gather, batch = bench.main(args)["smc"][0], bench.main(args + ["--api", "batch"])["smc"][0]
    assert batch["answered"] == batch["queries"] == gather["queries"]
    assert batch["rows_ok"] and batch["err"] <= 1e-5
    assert batch["distinct_last"] == gather["distinct_last"]
    assert batch["info"]["forwards"] == gather["info"]["forwards"]


@pytest.mark.parametrize("other, labels", [("worker", "inline / worker"),
                                           ("coroutine", "future / coroutine"),
                                           ("context", "list / context")])
def test_compare_runs_both_routes_alike(bench, capsys, other, labels):
    """``--compare-worker 1``: the cell once with a lockstep step on the event loop's thread and
    once on the worker; ``--compare-coroutine 1``: once as a gather of the queries' futures and
    once with a coroutine around each query; ``--compare-context 1``: once over lists, once over
    ``lm.context`` objects extended by ``+``. Each way the same rows (the same sampled trace),
    forwards and answers; the worker route's forwards ran on another thread (its caller CPU
    excludes them either way)."""
    args = ["--quick", "--no-nested", "--particles", "4", "--contexts", "100",
            f"--compare-{other}", "1"]
    results = bench.main(args)
    (first,), (second,) = results["smc"], results[other]
    assert first["answered"] == second["answered"] == first["queries"]
    assert first["distinct_last"] == second["distinct_last"]
    assert first["info"]["forwards"] == second["info"]["forwards"]
    assert first["info"]["tokens_forwarded"] == second["info"]["tokens_forwarded"]
    assert first["rows_ok"] and second["rows_ok"] and max(first["err"], second["err"]) <= 1e-5
    if other == "worker":
        assert second["worker"] > 0 and first["worker"] < second["worker"]
    assert labels in capsys.readouterr().out


def test_step_timeline_times_every_phase_and_unwraps():
    """``bench_step_timeline.py``: every phase of every cell timed (finite, >= 0; the forward
    and the compute step's own parts within the compute step), and genback's hand-off points
    and parts are its own again afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    from genback.batching.batcher import Batcher
    from genback.core import compute
    from genback.core.front import Front
    from genback.core.output_cache import OutputCache
    from genback.llm.hf import execute, runner

    def parts():
        return (execute.plan_step, runner.HFRunner._commit, runner.HFRunner._commit_step,
                runner.HFRunner._evict, OutputCache.put_many, compute.kept_copies,
                compute.owned_copies)

    spec = importlib.util.spec_from_file_location("bench_step_timeline",
                                                  BENCH.parent / "lab" / "bench_step_timeline.py")
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    before = (ThreadPoolExecutor.submit, Batcher._run_inline, Front._compute_owned,
              Batcher._finish, *parts())
    for api, worker in (("gather", []), ("batch", []), ("gather", ["--worker"])):
        cells = timeline.main(["--particles", "1", "4", "--steps", str(REFRESH + 3), "--api", api]
                              + worker)  # (a step chain commits within REFRESH + 1 steps)
        assert [c["particles"] for c in cells] == [1, 4]
        for c in cells:
            assert all(math.isfinite(c[p]) and c[p] >= 0
                       for p in timeline.PHASES + timeline.PARTS)
            assert c["fwd"] <= c["compute"]
            assert c["plan"] > 0 and c["commit"] > 0 and c["store"] > 0 and c["copies"] > 0
    assert (ThreadPoolExecutor.submit, Batcher._run_inline, Front._compute_owned,
            Batcher._finish, *parts()) == before


def test_cold_ops_times_every_operation_under_every_condition():
    """``bench_cold_ops.py`` runs in-process: one cell per condition, in order, a positive
    finite time for every operation and their sum."""
    spec = importlib.util.spec_from_file_location("bench_cold_ops",
                                                  BENCH.parent / "lab" / "bench_cold_ops.py")
    cold = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cold)
    cells = cold.main(["--rows", "2", "--tokens", "5", "--repeats", "3", "--sweep-mib", "1"])
    assert [c["condition"] for c in cells] == [
        "back to back", "after a 1-token forward", "after a decode step (2 rows, 5-token cache)",
        "after a 2 x 5 forward", "after a sweep of 1 MiB"]
    for c in cells:
        assert all(math.isfinite(c[o]) and c[o] > 0 for o in cold.OPS)
        assert c["sum"] == pytest.approx(sum(c[o] for o in cold.OPS))


def _host_ab():
    spec = importlib.util.spec_from_file_location("host_ab", BENCH.parent / "lab" / "host_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    return ab


def test_host_ab_runs_two_versions_side_by_side_in_one_process():
    """``host_ab.py``: a revision's package under a name of its own beside the working tree's,
    both on one model in one process (their attention functions registered apart: a copy that
    kept genback's names would run the other's), one row per version with finite host times
    and the first version's ratio 1; an unknown route is refused."""
    ab = _host_ab()
    rows = ab.main(["--side", "HEAD:batch-context", "--side", ".:gather", "--particles", "3",
                    "--contexts", "20", "--steps", "3"])
    assert [(r["rev"], r["route"]) for r in rows] == [("HEAD", "batch-context"), (".", "gather")]
    assert rows[0]["x"] == 1.0 and rows[0]["paired"] == 1.0
    assert all(math.isfinite(r["query_us"]) and r["query_us"] > 0 for r in rows)
    with pytest.raises(ValueError, match="route must be one of"):
        ab.run([(".", "gathre")], [2], [10], 1)


def test_host_ab_floor_reads_every_list_and_answers_both_routes():
    """``host_ab.py``'s ``floor`` (the least host work of a step): beside genback in one run on
    both routes; each query's list is read against the prompt (a list that does not start with
    the prompt's very objects is refused: the floor compares identities, as the trace's lists
    hold them), every query of a gathered step is answered with the row, a batch call with the
    first rows; it takes no route over contexts."""
    ab = _host_ab()
    rows = ab.main(["--side", ".:batch", "--side", "floor:gather", "--side", "floor:batch",
                    "--particles", "3", "--contexts", "20", "--steps", "3"])
    assert [(r["rev"], r["route"]) for r in rows] == [
        (".", "batch"), ("floor", "gather"), ("floor", "batch")]
    assert all(math.isfinite(r["query_us"]) and r["query_us"] > 0 for r in rows)
    prompt = [5, 6, 7]
    rows_in = torch.arange(8.0).reshape(2, 4)
    floor = ab.Floor(prompt, rows_in)

    async def step():
        got = await asyncio.gather(*(floor.next_token_logprobs(prompt + [t]) for t in (1, 2, 3)))
        assert all(r is floor.row for r in got) and not floor.futures
        assert torch.equal(await floor.batch_next_token_logprobs([prompt, prompt + [0]]), rows_in)
        with pytest.raises(ValueError, match="extends its prompt"):
            await floor.batch_next_token_logprobs([[5, 6, 8, 1]])
        with pytest.raises(ValueError, match="extends its prompt"):
            await floor.next_token_logprobs([5, 6])

    asyncio.run(step())
    with pytest.raises(ValueError, match="route must be one of"):
        ab.run([("floor", "batch-context")], [2], [10], 1)
