"""Where a batch of scoring requests spends its host time on a GPU (issue 66): the runner's
worker thread under cProfile while ``bench_scoring_gpu.py``'s multiple-choice mix runs packed.

    python benchmarks/lab/profile_scoring.py --shape llama-3.2-1b [--questions 200] [--top 40]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench_scoring_gpu as B  # noqa: E402
import gpu_models as G  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    from _vocab_fixtures import gpt2_tokenizer

    from genback.llm import AsyncTransformer
    from genback.llm.hf import runner as R

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = gpt2_tokenizer()
    model = G.build_model(a.shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    reqs = B.requests(a.questions, len(tok))
    prof = cProfile.Profile()
    cls = R.HFRunner
    run = cls.run

    def profiled(self, queries):
        prof.enable()
        try:
            return run(self, queries)
        finally:
            prof.disable()

    for label, window in (("warm-up", 0.05), ("profiled", 0.05), ("window 0.002", 0.002)):
        lm = AsyncTransformer(model, tok, batch_window=window)
        cls.run = profiled if label == "profiled" else run

        async def go():
            return await asyncio.gather(*(lm.token_logprobs(c, t) for c, t in reqs))

        G._sync(device)
        t0 = time.perf_counter()
        asyncio.run(go())
        G._sync(device)
        info = lm.cache_info()
        print(f"{label}: {time.perf_counter() - t0:.3f} s, forwards {info['forwards']}, "
              f"batches {info.get('batches')}", flush=True)
        lm.close()
    cls.run = run
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.top)
        print(s.getvalue())


if __name__ == "__main__":
    main()
