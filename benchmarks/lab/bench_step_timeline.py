"""Where a step's host time goes between the caller and the worker: one SMC step's timeline.

``bench_host.py`` splits a step's host time by thread (caller, worker, idle); this script splits
it in time, at the hand-offs, for the same trace (its tiny model, one shared prompt, each particle
sampling its next token, resampling every 3 steps), median over the measured steps (µs):

- ``caller -> dispatch``: from the start of the caller's ``gather`` (or its one
  ``batch_next_token_logprobs`` call, ``--api batch``) to the batch's dispatch: its hand-off to
  the worker thread, or (the batcher's default for a step whose cohort is in) its run on the
  loop's own thread: every caller's query built and checked (the front), the batcher's enqueue,
  the tasks ``gather`` makes and the loop's turns until the cohort is in;
- ``dispatch -> compute``: until the batch's compute starts (on the worker: waking it);
- ``compute``: the front's compute step (the model's forward included; ``fwd`` is the forward
  alone, timed by hooks on the model);
- ``compute -> finish``: until the loop's thread answers the batch's callers (from the worker:
  the ``call_soon_threadsafe`` wake-up);
- ``finish``: the batcher setting every caller's result;
- ``finish -> caller``: until the caller's ``gather`` returns (its tasks woken, in turn);
- ``host``: the step's wall time minus the forward's.

and the compute step's own parts (summed over the step's calls of each; ``compute`` holds them;
means over the measured steps, not medians: a step chain commits once in several steps, and
its commit's median would be 0):

- ``plan``: the runner's plan of the step (``plan_step``; its general plan is not timed; a
  step of a step chain, ``genback.llm.hf.chain``, has none: its checks are not timed);
- ``fwd host``: the forward's host work outside the model (the tree forward, planned or a
  chain's step, or the decode step, minus ``fwd``): the inputs, the attention layout, the
  logits' rows;
- ``commit``: the new KV put into the KV tree and the contexts' ends noted (a step chain's
  commit too, ``HFRunner._settle``); ``evict``: the tree's compaction and eviction after the
  batch;
- ``store``: the rows put into the output cache (its ``put_many``); ``copies``: the copies of
  the rows made in blocks (host rows: the cache's, :func:`genback.queries.rows.kept_copies`; rows on an
  accelerator: the callers', :func:`genback.queries.rows.owned_copies`).

The clocks are read by wrapping genback's private hand-off points (the worker pool's ``submit``,
``Batcher._run_inline``, ``Front._compute_owned``, ``Batcher._finish``): a measurement tool, not
an API.

Run: ``taskset -c 1 python benchmarks/lab/bench_step_timeline.py --particles 1 16 256`` (``--worker``:
every batch on the worker thread, the batcher's ``inline_cohort`` off).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks beside lab/
import bench_host as bh  # noqa: E402

PHASES = ("caller -> dispatch", "dispatch -> compute", "compute", "fwd", "compute -> finish",
          "finish", "finish -> caller", "host")
PARTS = ("plan", "fwd host", "commit", "evict", "store", "copies")


class Clocks:
    """Wraps the hand-off points and keeps the last step's times (``perf_counter`` s)."""

    def __init__(self):
        from genback.batching import batcher
        from genback.core import compute, front
        from genback.core.output_cache import OutputCache
        from genback.llm.hf import execute, runner
        from genback.llm.hf.chain import StepChain
        from genback.llm.hf.decode.step import DecodeStep
        from genback.llm.hf.forward.tree import TreeForward

        self.t: dict[str, float] = {}
        self.parts = dict.fromkeys(PARTS, 0.0)  # (seconds this step, summed over calls)
        points = [(concurrent.futures.ThreadPoolExecutor, "submit"),
                  (batcher.Batcher, "_run_inline"), (front.Front, "_compute_owned"),
                  (batcher.Batcher, "_finish")]
        # (a chained step's plan: its StepChain.step less the forward within it, "chain fwd")
        parts = [(execute, "plan_step", "plan"), (TreeForward, "run", "fwd host"),
                 (StepChain, "step", "plan"), (TreeForward, "step", "fwd host", "chain fwd"),
                 (runner.HFRunner, "_settle", "commit"),
                 (DecodeStep, "run", "fwd host"), (runner.HFRunner, "_commit", "commit"),
                 (runner.HFRunner, "_commit_step", "commit"),
                 (runner.HFRunner, "_evict", "evict"), (OutputCache, "put_many", "store"),
                 (compute, "kept_copies", "copies"), (compute, "owned_copies", "copies")]
        self.saved = [(owner, name, getattr(owner, name)) for owner, name in points] + [
            (owner, name, getattr(owner, name)) for owner, name, *_ in parts]
        for owner, name in points:
            setattr(owner, name, self._wrap(getattr(owner, name), name))
        for owner, name, *part in parts:
            setattr(owner, name, self._summed(getattr(owner, name), *part))

    def _wrap(self, fn, name):
        t = self.t

        def timed(*args, **kwargs):
            t[name + "0"] = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t[name + "1"] = time.perf_counter()
        return timed

    def _summed(self, fn, part, also=None):
        parts = self.parts

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[part] += time.perf_counter() - t0
                if also is not None:
                    parts[also] = parts.get(also, 0.0) + time.perf_counter() - t0
        return timed

    def remove(self):
        for owner, name, fn in reversed(self.saved):
            setattr(owner, name, fn)


async def cell(model, tok, n: int, context: int, steps: int, api: str, seed: int = 0,
               worker: bool = False) -> dict:
    from genback.llm import AsyncTransformer

    clocks, timer = Clocks(), bh.ForwardTimer(model)
    lm = AsyncTransformer(model, tok)
    lm.scheduler.inline_cohort = not worker
    gen = torch.Generator().manual_seed(seed)
    parts = [bh.text_ids(tok, context)] * n
    times = {p: [] for p in PHASES + PARTS}
    t, summed = clocks.t, clocks.parts
    try:
        for step in range(steps + 3):
            fwd0 = timer.wall
            t.clear()
            summed.update(dict.fromkeys(PARTS + ("chain fwd",), 0.0))
            t0 = time.perf_counter()
            rows = await bh.ask(lm, parts, api)
            t1 = time.perf_counter()
            rows = bh.as_rows(rows)  # (the trace's, after the clock)
            if step >= 3:  # (the prefill and two warm-up steps are not measured)
                fwd = timer.wall - fwd0
                dispatch = t.get("_run_inline0", t.get("submit0"))  # (this step's)
                for name, value in (
                        ("caller -> dispatch", dispatch - t0),
                        ("dispatch -> compute", t["_compute_owned0"] - dispatch),
                        ("compute", t["_compute_owned1"] - t["_compute_owned0"]),
                        ("fwd", fwd),
                        ("compute -> finish", t["_finish0"] - t["_compute_owned1"]),
                        ("finish", t["_finish1"] - t["_finish0"]),
                        ("finish -> caller", t1 - t["_finish1"]),
                        ("host", t1 - t0 - fwd),
                        *((part, summed[part] - (fwd if part == "fwd host" else 0.0)
                           - (summed["chain fwd"] if part == "plan" else 0.0))
                          for part in PARTS)):
                    times[name].append(value * 1e6)
            parts = bh.smc_advance(parts, rows, resample=(step + 1) % 3 == 0, gen=gen)
            gc.collect(1)
    finally:
        clocks.remove()
        timer.remove()
        await lm.aclose()
    # (a part is a mean: a step chain commits once in several steps, and its median would be 0)
    return {name: (statistics.fmean if name in PARTS else statistics.median)(v)
            for name, v in times.items()}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--particles", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--api", default="gather", choices=["gather", "batch"])
    p.add_argument("--worker", action="store_true",
                   help="every batch on the worker thread (the batcher's inline_cohort off)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = bh.load("tiny")
    print(f"tiny model, context {args.context}, {args.steps} steps, api {args.api}"
          f"{', every batch on the worker' if args.worker else ''}; median µs per step (parts: mean)\n")
    print("| particles | " + " | ".join(PHASES + PARTS) + " |\n"
          + "|---" * (len(PHASES + PARTS) + 1) + "|")
    out = []
    for n in args.particles:
        r = asyncio.run(cell(model, tok, n, args.context, args.steps, args.api,
                             worker=args.worker))
        out.append(dict(r, particles=n))
        print(f"| {n} | " + " | ".join(f"{r[name]:.0f}" for name in PHASES + PARTS) + " |",
              flush=True)
    return out


if __name__ == "__main__":
    main()
