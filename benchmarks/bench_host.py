"""Host cost per query: what genback spends around the model's forward, at SMC scale (issue 20).

**Part 1: SMC steps.** For each cell (N particles x context tokens) a fresh ``AsyncTransformer``
serves an SMC-shaped trace through the public API only:

- a shared prompt of ``context`` tokens; warm-up steps (not measured): every particle asks the
  prompt's next-token row (the prefill, so the KV tree holds the prompt), then ``--warmup``
  ordinary steps;
- ``--steps`` measured steps: ``await asyncio.gather(*(lm.next_token_logprobs(p) for p in
  particles))``; then (untimed) each particle samples its next token from its row (seeded) and
  every ``--resample`` steps the particles are resampled (multinomial on the sampled tokens'
  log-probs, seeded), so particles copy each other's contexts and the contexts repeat and branch.

Models: ``tiny`` is a random-weight ``LlamaForCausalLM`` (2 layers, hidden 64, 4 heads, 2 KV heads,
``max_position_embeddings`` 16,384) over a byte-level BPE vocabulary of ``--vocab`` (512) tokens that
``tiny_lm.py`` trains with the ``tokenizers`` library on standard-library docstrings (deterministic for a
Python version, offline), so the forward, the log-softmax and the row copies cost little and what is
left is host work. ``smollm2`` is SmolLM2-135M-Instruct in fp32 (its forward dominates).

What is measured, per measured step (``host_clocks.py``; all clocks are read on the caller's thread,
except the two hooks):

- ``wall``: ``time.perf_counter()`` around the ``gather`` (submit of the first query to resolution of
  the last future).
- ``forward``: the model's ``forward``, timed by a forward pre-hook and a forward hook on the top-level
  model module (``perf_counter`` wall and ``time.thread_time()`` CPU of the thread that runs it), summed
  over the calls in the step. Everything the model's forward runs is "inside", including genback's
  tree-attention function (it is called by the attention layers) and its head pre-hook.
- CPU time per thread: ``time.thread_time()`` of the caller's (event-loop) thread; for every other live
  thread, its CPU clock (``time.pthread_getcpuclockid``); the *worker* threads are those that ran a model
  forward (the hook records ``threading.get_ident()``); ``time.process_time()`` for the whole process.

Reported per query (µs, summed over measured steps and divided by N x steps):

- ``wall/q``; ``fwd/q`` (forward wall time);
- ``host/q`` = (wall - forward wall) / queries: everything that is not the model's forward, including
  time the batcher waits for its window (``batch_window``, 2 ms by default; a step whose callers
  are all back goes without it: the batcher's cohort rule) and time taken by other processes on a
  shared core;
- ``host/step ms``: the same per step (host/q x N): what a step's forward waits for on the host
  (issue 38's targets: <= 0.4 ms at 16 particles, <= 25 µs per query at 256);
- ``host/step med ms``: the median over the measured steps of each step's host time (wall less
  forward wall): the sums above take in whole every step that another process preempted (one
  10 ms preemption in 16 steps of 1.6 ms adds 40 % to host/step); the median does not;
- ``caller/q``: CPU time of the event-loop thread outside the model's forward (query submission,
  output cache, futures, asyncio; and a step's batch when it runs on the loop's thread, the
  batcher's ``inline_cohort``);
- ``worker/q``: CPU time of the worker thread(s) outside the model's forward (worker CPU minus forward
  CPU: batching, input checks, KV-tree matching, planning, row extraction, committing KV);
- ``gc/q``: wall time of Python's cyclic garbage collections during the step, whichever thread ran
  them (``gc.callbacks``); part of ``caller/q`` / ``worker/q``. genback freezes the heap of the
  loaded libraries at the first model (:mod:`genback.cpython`), so collections no longer walk torch
  and transformers, and it untracks every validated context tuple of at least 32 tokens
  (:func:`genback.cpython.untrack_ids`), so no collection walks those either;
- ``ctx-gc/q``: the caller's own cost of holding its contexts as lists, *not* part of ``host/q``.
  A list is never untracked, so every collection of its generation walks it item by item: 256 new
  16,000-token lists per step are ~4 million items. The trace collects them (``gc.collect(1)``,
  timed) between steps, outside the measured step, as an SMC loop would whenever its own
  allocations trigger a collection; without that, the first collection inside the step walks them
  and their cost lands in ``gc/q`` (``--caller-gc-inside``);
- ``other/q``: process CPU minus caller and worker CPU (other threads; ~0 expected);
- ``idle/q`` = host/q - caller/q - worker/q - other/q: wall time in which no thread of this process
  ran outside the forward: the batcher's window when a batch waits for it (2 ms per batch was
  ~125 µs/q at 16 particles before the cohort rule), thread hand-offs, and waiting for the core
  while other processes run on it (a shared machine);
- ``asyncio/q``: the caller's CPU per query of the same ``gather`` over bare futures, resolved
  together once all are in (:func:`asyncio_floor`, run after the cell): what any awaitable API
  costs this client at least (futures, ``gather``'s callbacks, wake-ups);
- ``own/q`` = caller/q + worker/q - asyncio/q: genback's own host work per query, the front on
  the caller's thread and the worker outside the forward (issue 31's "<= 15 µs" target);
- ``loop host/step ms`` and ``host vs loop``: the same trace shape served by a hand-written
  async step over plain transformers (:mod:`host_loop`: per-particle ``DynamicCache`` rows, one
  forward, ``log_softmax``, the futures; no checks, no KV tree, no output cache, no copies;
  resampling reorders its cache), timed with the same clocks right after genback's cell: its
  host time per step (in brackets the part that reordered its cache, every ``--resample``
  steps: what a loop without a prefix tree pays to resample, which grows with the context),
  and genback's host/q over the loop's (in brackets over the loop's without its reordering:
  the bare step, the host floor of any step; not run where the loop's KV would pass
  ``host_loop.MAX_LOOP_KV_BYTES``, or with ``--no-loop``);
- ``host %``: host/q over wall/q; ``fwd/step``: model forwards per step (``cache_info()["forwards"]``);
  ``err``: max abs difference between the last step's rows of two particles and an uncached fp32
  forward of their contexts.

CPU times are what genback costs on the host independently of other load on the machine; wall-based
numbers also include waits. Pin to one core (``taskset -c 1``) so that the two threads never overlap.

**Part 2: nested prefixes** (``--nested-len``, 256): ``lm.batch_next_token_logprobs([prompt + seq[:i]
for i in range(n)])`` (what genlm-control's ``PromptedLLM.log_probability`` sends) against
``lm.token_logprobs(prompt, seq)`` of the same sequence, each from a fresh model state
(``clear_cache()`` + ``clear_kv_cache()``): wall seconds, ``cache_info()["forwards"]`` of each, the
wall ratio, and the max abs difference between ``rows[i][seq[i]]`` and ``token_logprobs[i]``.

Run: ``taskset -c 1 python benchmarks/bench_host.py`` (tiny model, full grid), ``--model smollm2``
(a smaller default grid, 24 steps by default), ``--particles 16 256 --contexts 100 4000 --steps
8``, ``--quick`` (tiny model, smallest grid, a few seconds), ``--no-nested`` / ``--no-smc`` for
one part; ``--compare-worker K`` runs each cell K times in alternation with every batch on the
batcher's worker thread (as before a lockstep step ran on the event loop's thread) and prints the
medians of both: a paired comparison in one process, steadier on a shared machine than two
processes run one after the other; ``--compare-coroutine K`` the same against a coroutine around
each query (``--api coroutine``: a task per query, as before ``next_token_logprobs`` handed out
its future); ``--compare-context K`` against contexts held as ``lm.context(ids)`` objects and
extended by ``+`` (``--api context``: each step's check costs the added token, where a list is
compared with its parent item by item).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (its sibling, run from anywhere)
import host_loop  # noqa: E402
from host_clocks import ForwardTimer, GcClock, StepClock, as_rows, ask  # noqa: E402
from tiny_lm import load, text_ids  # noqa: E402

DEFAULT_GRID = {"tiny": ([16, 256, 1024], [100, 1000, 4000, 16000]),
                "smollm2": ([16, 256], [100, 1000, 4000])}
# measured steps by default: SmolLM2 runs 24, so that 256 particles fill the output cache (4,096
# rows; 8 steps never do) and the steady state is measured, with old rows dropped each step
# (a cost that 8 steps hid: the row blocks, benchmarks/RESULTS.md "fifth pass")
DEFAULT_STEPS = {"tiny": 8, "smollm2": 24}


# -- part 1: SMC steps -------------------------------------------------------------------------

def reference_rows(model, contexts) -> list[torch.Tensor]:
    """Uncached fp32 next-token log-prob rows of ``contexts`` (one forward each)."""
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([c])).logits[0, -1].float(), -1)
                for c in contexts]


async def asyncio_floor(n: int, steps: int, coroutines: bool = True) -> float:
    """The caller's CPU µs per query of the same ``gather`` with no genback in it: ``n``
    futures, all resolved together by a callback once the last one is in (as the batcher
    resolves a batch), each awaited by a coroutine of its own (``coroutines``: what a coroutine
    function per query costs, genlm-backend's shape and genback's since issue 67,
    :mod:`genback.batching.futures`; ``gather`` wraps each in a task, ~4 µs a query on this
    project's CPU) or gathered as they are (the floor of an API that hands out futures, which
    asyncio's ``wait`` cannot take together with ``create_task``): the futures, ``gather``'s
    callbacks and wake-ups that such an API costs this client at least."""
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future] = []

    def resolve():
        for f in futures:
            f.set_result(None)

    def one():
        f = loop.create_future()
        futures.append(f)
        if len(futures) == n:
            loop.call_soon(resolve)
        return f

    spent = 0.0
    for step in range(steps + 1):
        futures.clear()
        t = time.thread_time()
        if coroutines:
            await asyncio.gather(*(_awaiting(one()) for _ in range(n)))
        else:
            await asyncio.gather(*(one() for _ in range(n)))
        if step:  # (the first step warms up)
            spent += time.thread_time() - t
    return spent * 1e6 / (n * steps)


async def _awaiting(future):
    return await future


def smc_choice(rows, resample: bool, gen) -> tuple[list[int], list[int] | None]:
    """The trace's sampler between two steps: each particle's next token sampled from its row
    (``gen``, seeded) and, when ``resample``, the indices of the resampled particles
    (multinomial on the sampled tokens' log-probs, with replacement; else None)."""
    lps = torch.stack(rows)
    nxt = torch.multinomial(lps.exp(), 1, generator=gen)[:, 0]
    order = None
    if resample:
        logw = lps.gather(1, nxt[:, None])[:, 0]
        order = torch.multinomial(torch.softmax(logw, 0), len(rows), replacement=True,
                                  generator=gen).tolist()
    return nxt.tolist(), order


def smc_advance(parts: list[list[int]], rows, *, resample: bool, gen) -> list[list[int]]:
    """The particles' new contexts (new lists) after :func:`smc_choice`."""
    nxt, order = smc_choice(rows, resample, gen)
    parts = [p + [t] for p, t in zip(parts, nxt)]
    return parts if order is None else [parts[i] for i in order]


async def smc_cell(model, tok, n: int, context: int, *, steps: int, warmup: int = 2,
                   resample: int = 3, seed: int = 0, check: int = 2, lm_kwargs=None,
                   caller_gc_inside: bool = False, api: str = "gather",
                   worker: bool = False, loop: bool = True) -> dict:
    """One cell of part 1 on a fresh ``AsyncTransformer``; returns the per-query numbers, plus
    ``answered`` (rows returned by measured steps), ``rows_ok`` (each row a log-normalised
    vector of the logit width), ``err`` and ``info`` (``cache_info()`` at the end).
    ``worker``: every batch on the batcher's worker thread (its ``inline_cohort`` off).
    ``loop``: then the same trace through the hand-written loop (:mod:`host_loop`), its numbers
    as ``loop`` (None when not run, or when its KV would pass
    :data:`host_loop.MAX_LOOP_KV_BYTES`)."""
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(model, tok, **(lm_kwargs or {}))
    lm.scheduler.inline_cohort = not worker
    timer = ForwardTimer(model)
    gc_clock = GcClock()
    clock = StepClock(timer, lm, gc_clock, api)
    gen = torch.Generator().manual_seed(seed)
    width = model.get_output_embeddings().weight.shape[0]
    parts = [text_ids(tok, context)] * n
    if api in ("context", "batch-context"):  # (smc_advance's p + [t] extends them as lists)
        parts = [lm.context(parts[0])] * n
    answered, rows_ok = 0, True
    ctx_gc = 0.0
    try:
        for step in range(warmup + 1 + steps):
            if step <= warmup:  # the prompt's prefill, then warm-up steps: not measured
                rows = as_rows(await ask(lm, parts, api))
            else:
                rows = await clock.step(parts)
                answered += len(rows)
                for r in rows:
                    rows_ok &= (r.shape == (width,) and r.dtype == torch.float32 and
                                abs(float(torch.logsumexp(r.double(), 0))) < 1e-4)
            if step == warmup + steps:
                break
            parts = smc_advance(parts, rows, resample=(step + 1) % resample == 0, gen=gen)
            if step >= warmup and not caller_gc_inside:  # the caller's new lists (see ctx-gc/q)
                t0 = time.perf_counter()
                gc.collect(1)
                ctx_gc += time.perf_counter() - t0
        info = lm.cache_info()
    finally:
        timer.remove()
        gc_clock.remove()
        await lm.aclose()
    picked = [0, n - 1][:check]
    refs = reference_rows(model, [list(parts[i]) for i in picked])
    err = max((float((rows[i] - ref).abs().max()) for i, ref in zip(picked, refs)), default=0.0)
    distinct = len({tuple(p) for p in parts})
    floor = await asyncio_floor(n, steps, coroutines=not api.startswith("batch"))
    per = clock.per_query()
    hand = None
    if loop and host_loop.kv_bytes(model, n, context) <= host_loop.MAX_LOOP_KV_BYTES:
        timer = ForwardTimer(model)
        try:
            hand = await host_loop.loop_cell(
                model, text_ids(tok, context), n, steps=steps, warmup=warmup,
                resample=resample, seed=seed, timer=timer, choose=smc_choice,
                reference=reference_rows)
        finally:
            timer.remove()
    return dict(per, floor=floor, own=per["caller"] + per["worker"] - floor, loop=hand,
                n=n, context=context, steps=steps, answered=answered,
                ctx_gc=ctx_gc * 1e6 / max(clock.t["queries"], 1),
                rows_ok=rows_ok, err=err, info=info, distinct_last=distinct)


# -- part 2: nested prefixes ------------------------------------------------------------------

async def nested(model, tok, length: int = 256, prompt_len: int = 32) -> dict:
    """The ``length`` prefixes of one ``length``-token sequence as one batch, against
    ``token_logprobs`` of that sequence; fresh state before each side."""
    from genback.llm import AsyncTransformer

    ids = text_ids(tok, prompt_len + length + 500)
    prompt, seq = ids[:prompt_len], ids[500:500 + length]
    lm = AsyncTransformer(model, tok)
    try:
        await lm.next_token_logprobs(ids[-8:])  # warm the model and the worker, then forget it
        out = {}
        for side in ("batch", "token_logprobs"):
            lm.clear_cache()
            lm.clear_kv_cache()
            f0 = lm.cache_info()["forwards"]
            t = time.perf_counter()
            if side == "batch":
                rows = await lm.batch_next_token_logprobs([prompt + seq[:i] for i in range(length)])
            else:
                lps = await lm.token_logprobs(prompt, seq)
            out[side] = dict(wall=time.perf_counter() - t,
                             forwards=lm.cache_info()["forwards"] - f0)
    finally:
        await lm.aclose()
    picked = rows[torch.arange(length), torch.tensor(seq)]
    return dict(length=length, prompt=prompt_len, batch=out["batch"], score=out["token_logprobs"],
                ratio=out["batch"]["wall"] / out["token_logprobs"]["wall"],
                diff=float((picked - lps).abs().max()), rows=tuple(rows.shape))


# -- driver -----------------------------------------------------------------------------------

HEADER = ("| model | N | context | queries | wall/q µs | fwd/q µs | host/q µs | host/step ms | "
          "host/step med ms | "
          "caller/q µs | "
          "worker/q µs | gc/q µs | ctx-gc/q µs | other/q µs | idle/q µs | asyncio/q µs | "
          "own/q µs | host % | fwd/step | err | loop host/step ms (reorder) | "
          "host vs loop (bare) |")


def row_md(model: str, r: dict) -> str:
    return (f"| {model} | {r['n']} | {r['context']} | {r['queries']} | {r['wall']:.0f} | "
            f"{r['fwd']:.0f} | {r['host']:.0f} | {r['host'] * r['n'] / 1e3:.2f} | "
            f"{r['host_med']:.2f} | "
            f"{r['caller']:.0f} | {r['worker']:.0f} | "
            f"{r['gc']:.0f} | {r['ctx_gc']:.0f} | "
            f"{r['other']:.0f} | {r['idle']:.0f} | {r['floor']:.0f} | {r['own']:.0f} | "
            f"{100 * r['share']:.0f} | "
            f"{r['fwd_per_step']:.1f} | {r['err']:.1e} | {_vs_loop(r)} |")


def _vs_loop(r: dict) -> str:
    """The two loop columns: the hand-written loop's host/step (its reordering's part), and
    genback's host over it (over its bare step's)."""
    hand = r.get("loop")
    if not hand:
        return "— | —"
    per_step = r["n"] / 1e3
    return (f"{hand['host'] * per_step:.2f} ({hand['reorder'] * per_step:.2f}) | "
            f"{r['host'] / hand['host']:.1f}x "
            f"({r['host'] / (hand['host'] - hand['reorder']):.1f}x)")


def compare_md(pairs, labels: str = "inline / worker") -> str:
    """``--compare-worker``'s (``--compare-coroutine``'s, ``--compare-context``'s) table: per
    cell, the medians of host/q, host/step and own/q of the runs of the default route and of the
    other one (``labels``: theirs)."""
    med = statistics.median
    out = [f"\n| N | context | runs | host/q µs {labels} | host/step ms {labels} | "
           f"own/q µs {labels} |", "|---|---|---|---|---|---|"]
    for n, ctx, runs in pairs:
        a, b = runs[False], runs[True]
        out.append(f"| {n} | {ctx} | {len(a)} + {len(b)} | {med(r['host'] for r in a):.0f} / "
                   f"{med(r['host'] for r in b):.0f} | "
                   f"{med(r['host'] for r in a) * n / 1e3:.2f} / "
                   f"{med(r['host'] for r in b) * n / 1e3:.2f} | "
                   f"{med(r['own'] for r in a):.0f} / {med(r['own'] for r in b):.0f} |")
    return "\n".join(out)


def nested_md(model: str, r: dict) -> str:
    b, s = r["batch"], r["score"]
    return (f"| {model} | {r['length']} | {b['wall']:.2f} | {b['forwards']} | {s['wall']:.2f} | "
            f"{s['forwards']} | {r['ratio']:.1f} | {r['diff']:.1e} |")


def parse(argv=None):
    p = argparse.ArgumentParser(description=(
        "Host cost per query of SMC-shaped steps on a nearly free model: what genback spends around "
        "the forward (caller, worker, collector), against a hand-written async step over plain "
        "transformers on the same trace (host_loop.py, beside every cell; --no-loop skips it)."))
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--particles", type=int, nargs="+")
    p.add_argument("--contexts", type=int, nargs="+")
    p.add_argument("--steps", type=int, help="measured steps (default: 8 tiny, 24 smollm2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--resample", type=int, default=3)
    p.add_argument("--vocab", type=int, default=512, help="tiny model's BPE vocabulary")
    p.add_argument("--nested-len", type=int, default=256)
    p.add_argument("--no-nested", action="store_true")
    p.add_argument("--no-smc", action="store_true")
    p.add_argument("--caller-gc-inside", action="store_true",
                   help="do not collect the caller's new context lists between steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-loop", action="store_true",
                   help="skip the hand-written loop (host_loop.py) run after each cell")
    p.add_argument("--decode", default="auto", choices=["auto", "graphs", "eager", "off"],
                   help="AsyncTransformer's decode mode (default auto: the tree path on the CPU)")
    p.add_argument("--api", default="gather",
                   choices=["gather", "coroutine", "batch", "context", "batch-context"],
                   help="a step as a gather of next_token_logprobs calls (default), of a "
                        "coroutine around each, or one batch_next_token_logprobs call; context: "
                        "a gather over lm.context objects extended by +; batch-context: one "
                        "batch_next_token_logprobs call over lm.context objects")
    p.add_argument("--compare-worker", type=int, default=0, metavar="K",
                   help="run each cell K times in alternation with every batch on the worker "
                        "thread (the batcher's inline_cohort off, rows 'tiny/worker'; each route "
                        "first in every other pair), then the medians of both routes: a paired "
                        "comparison in one process")
    p.add_argument("--compare-coroutine", type=int, default=0, metavar="K",
                   help="the same, against a gather of one coroutine per query (--api "
                        "coroutine, rows 'tiny/coroutine'): the query's future handed out as "
                        "it is against a task per query")
    p.add_argument("--compare-context", type=int, default=0, metavar="K",
                   help="the same, against contexts held as lm.context objects (--api context, "
                        "rows 'tiny/context'): a list compared with its parent item by item "
                        "against a context object whose added token alone is checked")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, 16 particles x 100 and 1,000 tokens, 3 steps, 64 nested")
    args = p.parse_args(argv)
    if args.quick:
        args.model = "tiny"
        args.particles = args.particles or [16]
        args.contexts = args.contexts or [100, 1000]
        args.steps, args.warmup, args.nested_len = 3, 1, 64
    grid = DEFAULT_GRID[args.model]
    args.steps = args.steps or DEFAULT_STEPS[args.model]
    args.particles = args.particles or grid[0]
    args.contexts = args.contexts or grid[1]
    return args


def main(argv=None) -> dict:
    """Run the benchmark; print markdown tables as cells finish; return the results."""
    args = parse(argv)
    torch.set_num_threads(1)
    model, tok = load(args.model, args.vocab)
    print(f"model {args.model}: {sum(p.numel() for p in model.parameters()):,} params, "
          f"vocab {len(tok)}, torch threads {torch.get_num_threads()}, steps {args.steps} "
          f"(after {args.warmup} warm-up), resample every {args.resample}", flush=True)
    results = {"smc": [], "nested": None}
    if not args.no_smc:
        print("\n" + HEADER + "\n" + "|---" * (HEADER.count("|") - 1) + "|", flush=True)
        pairs = []
        other, k = (("worker", args.compare_worker) if args.compare_worker
                    else ("context", args.compare_context) if args.compare_context
                    else ("coroutine", args.compare_coroutine))
        for n in args.particles:
            for ctx in args.contexts:
                runs = {False: [], True: []}
                # (alternating, each route first in every other pair)
                order = [w for i in range(k) for w in (i % 2, 1 - i % 2)]
                for alt in map(bool, order or [0]):
                    r = asyncio.run(smc_cell(
                        model, tok, n, ctx, steps=args.steps, warmup=args.warmup,
                        resample=args.resample, seed=args.seed,
                        caller_gc_inside=args.caller_gc_inside,
                        api=other if alt and other in ("coroutine", "context") else args.api,
                        worker=alt and other == "worker", lm_kwargs={"decode": args.decode},
                        loop=not args.no_loop))
                    (results.setdefault(other, []) if alt else results["smc"]).append(r)
                    runs[alt].append(r)
                    print(row_md(args.model + (f"/{other}" if alt else ""), r), flush=True)
                pairs.append((n, ctx, runs))
        if k:
            print(compare_md(pairs, {"worker": "inline / worker", "context": "list / context"}
                             .get(other, "future / coroutine")), flush=True)
    if not args.no_nested:
        r = asyncio.run(nested(model, tok, args.nested_len))
        results["nested"] = r
        print("\n| model | prefixes | batch s | batch forwards | token_logprobs s | "
              "token_logprobs forwards | ratio | max diff |\n|---|---|---|---|---|---|---|---|")
        print(nested_md(args.model, r), flush=True)
    return results


if __name__ == "__main__":
    main()
