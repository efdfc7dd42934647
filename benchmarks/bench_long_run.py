"""A long SMC run on the host-cost benchmark's tiny model: does a step's cost grow with the run?

The trace of ``bench_host.py`` (every particle asks its next-token row, samples its token,
resampling every ``--resample`` steps), run for many steps on one ``AsyncTransformer``. Per window
of ``--window`` steps it prints the median step wall time, the median host time of a step (wall
minus the model's forward, timed by hooks on the model) and the KV bytes the step's attention
read (``cache_info()["kv_bytes_read"]``, counted: independent of the machine's load); at the end
the forwards, tokens forwarded and KV nodes. Compare two trees by running it in each
(``PYTHONPATH=<worktree>``).

Run: ``taskset -c 1 python benchmarks/bench_long_run.py --particles 16 --context 100 --steps
1000 --window 200``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time

import torch

from bench_host import load, smc_advance, text_ids


async def run(model, tok, n: int, context: int, steps: int, resample: int, seed: int) -> dict:
    """``{"wall", "host", "read"}`` per step (seconds, seconds, bytes) and the final
    ``cache_info()``."""
    from genback.llm import AsyncTransformer

    forward: list[float] = []
    hooks = [model.register_forward_pre_hook(lambda m, a: forward.append(-time.perf_counter())),
             model.register_forward_hook(lambda m, a, o: forward.__setitem__(
                 -1, forward[-1] + time.perf_counter()))]
    lm = AsyncTransformer(model, tok)
    gen = torch.Generator().manual_seed(seed)
    parts = [text_ids(tok, context)] * n
    out: dict = {"wall": [], "host": [], "read": []}
    try:
        for step in range(steps + 1):  # (step 0: the prompt's prefill, not reported)
            read0 = lm.cache_info()["kv_bytes_read"]
            forward.clear()
            t0 = time.perf_counter()
            rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in parts))
            wall = time.perf_counter() - t0
            if step:
                out["wall"].append(wall)
                out["host"].append(wall - sum(forward))
                out["read"].append(lm.cache_info()["kv_bytes_read"] - read0)
            parts = smc_advance(parts, rows, resample=(step + 1) % resample == 0, gen=gen)
            gc.collect(1)  # (the caller's new lists, between steps: see bench_host's ctx-gc)
        out["info"] = lm.cache_info()
    finally:
        for h in hooks:
            h.remove()
        await lm.aclose()
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=(
        "A long SMC run on the tiny model: per window of steps, the step's wall and host time and the KV "
        "bytes read, against the run's first window (does a step grow with the run?); run it in two "
        "trees (PYTHONPATH) to compare them."))
    p.add_argument("--particles", type=int, default=16)
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--window", type=int, default=200)
    p.add_argument("--resample", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = load("tiny")
    r = asyncio.run(run(model, tok, args.particles, args.context, args.steps, args.resample,
                        args.seed))
    print("| steps | step wall ms (median) | host ms (median) | KV read per step kB (mean) |\n"
          "|---|---|---|---|")
    for a in range(0, args.steps, args.window):
        w = slice(a, a + args.window)
        print(f"| {a}-{min(a + args.window, args.steps)} | "
              f"{statistics.median(r['wall'][w]) * 1e3:.2f} | "
              f"{statistics.median(r['host'][w]) * 1e3:.2f} | "
              f"{statistics.mean(r['read'][w]) / 1e3:,.1f} |")
    info = r["info"]
    print(f"\nforwards {info['forwards']}, tokens forwarded {info['tokens_forwarded']}, "
          f"KV nodes {info['kv_nodes']}")
    return r


if __name__ == "__main__":
    main()
