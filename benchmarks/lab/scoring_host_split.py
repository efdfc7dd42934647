"""genback's host CPU per scoring request, split into the runner's part (``HFRunner.run`` less
the model's own forward calls) and the rest (tokenizer, engine, front, batcher, asyncio), for
``bench_loglikelihood.py``'s mixes on the tiny random model (issue 66, session 66).

``--packed`` plans forwards as on CUDA (the varlen budget, ``varlen.FORCE = "reference"``: the
GPU's forward counts; the reference kernel's time is inside the forwards, so not counted).
Host CPU = process CPU time less the forwards' thread CPU time; each mix's best of ``--reps``
runs after a warm-up, caches cleared before each run.

    PYTHONPATH=. taskset -c 1 python benchmarks/lab/scoring_host_split.py --packed --reps 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_loglikelihood as B  # noqa: E402
import tiny_lm  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mixes", default="multiple_choice,pairs,rolling")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--packed", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    from genback.engine import GenbackLM
    from genback.llm import AsyncTransformer
    from genback.llm.hf import runner as R
    from genback.llm.hf.forward import varlen

    if a.packed:
        varlen.FORCE = "reference"
    args = argparse.Namespace(questions=200, pairs=400, texts=80, prompts=8)
    model, tok = tiny_lm.load("tiny")
    lm = AsyncTransformer(model, tok)
    gb = GenbackLM(lm=lm)
    clock = B.ForwardClock(model)
    spent = [0.0]
    run = R.HFRunner.run

    def timed_run(self, queries):
        c0 = time.thread_time()
        try:
            return run(self, queries)
        finally:
            spent[0] += time.thread_time() - c0

    R.HFRunner.run = timed_run
    for mix in a.mixes.split(","):
        reqs = B.instances(mix, args)
        best = None
        for i in range(a.reps + 1):  # (the first run warms up)
            lm.clear_cache()
            lm.clear_kv_cache()
            spent[0], f0, before = 0.0, clock.cpu, lm.cache_info()
            _, wall, _, cpu = clock.timed(lambda: B.run(gb, mix, reqs))
            forward = clock.cpu - f0
            row = (cpu, spent[0] - forward, wall)
            if i and (best is None or cpu < best[0]):
                best = row
            info = lm.cache_info()
        n = len(reqs)
        cpu, runner, wall = best
        print(f"{mix}: {n} requests, host CPU {cpu / n * 1e6:.0f} us/request = runner "
              f"{runner / n * 1e6:.0f} + rest {(cpu - runner) / n * 1e6:.0f}; wall {wall:.2f} s; "
              f"forwards {info['forwards'] - before['forwards']}", flush=True)
    R.HFRunner.run = run
    gb.close()


if __name__ == "__main__":
    main()
