"""SMC replay on AsyncMlxLM (mlx-lm, MLX's CPU backend here) vs AsyncTransformer, fp32.

The trace is ``bench_smc_replay.make_trace``: P particles extend one ~40-token prompt for S
steps; every step asks all particles' full prefixes concurrently. Each backend replays it from
empty caches; prints wall seconds, rows/s, forwards, tokens forwarded, and the largest
difference between the two backends' rows of the last step.

On Apple silicon MLX runs on the GPU; on Linux ``mlx[cpu]``'s kernels are far slower than
torch's, so the default trace is small.

Run: ``python benchmarks/bench_mlx.py`` (``--particles``, ``--steps``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_smc_replay import make_trace, replay
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genback.llm import AsyncMlxLM, AsyncTransformer
    from genback.registry import resolve

    path = resolve("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _, trace = make_trace(model, tok, args.particles, args.steps)
    n_rows = args.particles * args.steps
    print(f"SmolLM2 fp32, CPU, {args.particles} particles x {args.steps} steps = {n_rows} rows")
    print(f"{'backend':18} {'wall s':>8} {'rows/s':>8} {'forwards':>9} {'tokens':>7}")
    last = {}
    for label, make in (("AsyncTransformer", lambda: AsyncTransformer(model, tok)),
                        ("AsyncMlxLM", lambda: AsyncMlxLM.from_name(path))):
        lm = make()
        start = time.perf_counter()
        rows = asyncio.run(replay(lm, trace))
        wall = time.perf_counter() - start
        info = lm.cache_info()
        last[label] = torch.stack(rows)
        print(f"{label:18} {wall:8.2f} {n_rows / wall:8.1f} {info['forwards']:9d} "
              f"{info['tokens_forwarded']:7d}")
        lm.close()
    diff = (last["AsyncTransformer"] - last["AsyncMlxLM"]).abs().max().item()
    print(f"max abs difference of the last step's rows (MLX vs HF, fp32): {diff:.2g}")


if __name__ == "__main__":
    main()
