"""SMC-like replay on SmolLM2: genback vs genlm-backend 0.3.1 vs a hand-written floor, one run.

The trace: 16 particles extend one ~40-token prompt for 24 steps (tokens sampled once, up
front); at every step all particles' full prefixes are asked concurrently, as an SMC sampler does.

* genback: ``AsyncTransformer`` (auto-batching + KV prefix tree), a fresh instance.
* genlm-backend 0.3.1: its ``AsyncTransformer`` on the same local HF folder
  (``hf_opts={"device_map": None}``), a fresh instance; skipped if not installed
  (``pip install --no-deps genlm-backend==0.3.1``).
* floor: plain transformers by hand — prefill the prompt once, copy its KV to 16 rows, then one
  batched one-token forward per step over the per-particle KV caches, with log-normalised rows.

Prints wall times, ratios, tokens forwarded, and the max abs error of every returned row of the
last step against an uncached batch-1 forward.

Run: ``python benchmarks/bench_smc_replay.py`` (add ``--steps``/``--particles`` to change the trace).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch


def make_trace(model, tokenizer, particles, steps, seed=0):
    prompt_text = (
        "The old lighthouse keeper climbed the narrow spiral stairs of the tower every single "
        "evening, carefully counting the steps "
        "and listening to the waves that broke against the rocks below, until one night"
    )
    prompt = tokenizer.encode(prompt_text)
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        cache = out.past_key_values
        cache.batch_repeat_interleave(particles)
        logits = out.logits[:, -1].repeat(particles, 1)
        tokens = []
        for _ in range(steps):
            nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen)
            tokens.append(nxt[:, 0].tolist())
            out = model(nxt, past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
    particles_tokens = [[prompt + [tokens[s][p] for s in range(k)] for p in range(particles)]
                        for k in range(1, steps + 1)]
    return prompt, particles_tokens  # particles_tokens[step][particle] = full prefix


async def replay(lm, trace):
    last = None
    for contexts in trace:
        last = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    return last


def run_genback(model, tokenizer, trace):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(model, tokenizer)
    start = time.perf_counter()
    rows = asyncio.run(replay(lm, trace))
    wall = time.perf_counter() - start
    info = lm.cache_info()
    lm.close()
    return wall, rows, info["tokens_forwarded"]


def run_genlm(path, trace):
    try:
        from genlm.backend.llm import AsyncTransformer as GenlmTransformer
    except ImportError as exc:
        print(f"genlm-backend not installed ({exc}); skipping it")
        return None
    lm = GenlmTransformer.from_name(path, hf_opts={"device_map": None, "dtype": torch.float32})
    start = time.perf_counter()
    rows = asyncio.run(replay(lm, trace))
    wall = time.perf_counter() - start
    tokens = sum(len(c) for contexts in trace for c in contexts)  # it recomputes every prefix
    return wall, rows, tokens


def run_floor(model, prompt, trace):
    """One batched one-token forward per step over per-particle KV; every step's rows are
    log-normalised, as the replay's callers receive them."""
    particles = len(trace[0])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        cache = out.past_key_values
        cache.batch_repeat_interleave(particles)
        for step in range(len(trace)):
            nxt = torch.tensor([[c[-1]] for c in trace[step]])
            out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            rows = list(torch.log_softmax(out.logits[:, -1].float(), -1))
    wall = time.perf_counter() - start
    tokens = len(prompt) + particles * len(trace)
    return wall, rows, tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--skip-genlm", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genback.registry import resolve

    path = resolve(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt, trace = make_trace(model, tokenizer, args.particles, args.steps)
    print(f"trace: {args.particles} particles x {args.steps} steps, prompt {len(prompt)} tokens, "
          f"{sum(len(c) for cs in trace for c in cs)} tokens in all queries")

    with torch.inference_mode():
        refs = [torch.log_softmax(model(torch.tensor([c])).logits[0, -1].float(), -1)
                for c in trace[-1]]

    def err(rows):
        return max(float((r - ref).abs().max()) for r, ref in zip(rows, refs))

    results = {}
    results["floor (hand-written KV)"] = run_floor(model, prompt, trace)
    results["genback AsyncTransformer"] = run_genback(model, tokenizer, trace)
    if not args.skip_genlm:
        r = run_genlm(path, trace)
        if r is not None:
            results["genlm-backend 0.3.1 AsyncTransformer"] = r

    floor = results["floor (hand-written KV)"][0]
    ours = results["genback AsyncTransformer"][0]
    print(f"\n{'system':<38} {'wall s':>8} {'vs floor':>9} {'tokens fwd':>11} {'max abs err':>12}")
    for name, (wall, rows, tokens) in results.items():
        print(f"{name:<38} {wall:>8.2f} {wall / floor:>8.2f}x {tokens:>11} {err(rows):>12.2e}")
    if "genlm-backend 0.3.1 AsyncTransformer" in results:
        theirs = results["genlm-backend 0.3.1 AsyncTransformer"][0]
        print(f"\ngenback speedup over genlm-backend: {theirs / ours:.1f}x")
    print(f"genback / floor: {ours / floor:.2f}x")


if __name__ == "__main__":
    main()
