"""LoRA on AsyncTransformer: rows/s with and without an adapter, on an SMC-like replay.

The trace (``bench_smc_replay.make_trace``): P particles extend one ~40-token prompt for S steps;
every step asks all particles' full prefixes concurrently. It is replayed on one
AsyncTransformer over SmolLM2 with two peft adapters registered (made here, random non-zero
weights: ``small`` = rank 8 on q/v, ``wide`` = rank 16 on q/k/v/o/gate/up/down), under:

* ``base``: ``lora_name=None``;
* ``small`` / ``wide``: every query under that adapter;
* ``mixed``: half the particles under ``small``, half base (one batch, one forward per adapter).

Each run starts from empty caches. Prints wall seconds, rows/s, forwards and tokens forwarded,
and the adapter's cost per row relative to base, and checks the last step's rows of ``small``
against an uncached forward of the merged model.

Run: ``python benchmarks/bench_lora.py`` (``--particles``, ``--steps``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import torch


def make_adapter(model_path: str, folder: str, targets: list[str], rank: int, seed: int) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)
    return folder


async def replay(lm, trace, names):
    last = None
    for contexts in trace:
        last = await asyncio.gather(*(lm.next_token_logprobs(c, lora_name=n)
                                      for c, n in zip(contexts, names)))
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_smc_replay import make_trace
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genback.llm import AsyncTransformer
    from genback.registry import resolve

    path = resolve("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _, trace = make_trace(model, tok, args.particles, args.steps)
    rows_total = args.particles * args.steps
    tmp = tempfile.mkdtemp(prefix="genback-lora-bench-")
    small = make_adapter(path, os.path.join(tmp, "small"), ["q_proj", "v_proj"], 8, 1)
    wide = make_adapter(path, os.path.join(tmp, "wide"), ["q_proj", "k_proj", "v_proj", "o_proj",
                                                          "gate_proj", "up_proj", "down_proj"], 16, 2)
    lm = AsyncTransformer(model, tok)
    lm.add_new_lora(small, "small")
    lm.add_new_lora(wide, "wide")
    half = args.particles // 2
    runs = {
        "base": [None] * args.particles,
        "small": ["small"] * args.particles,
        "wide": ["wide"] * args.particles,
        "mixed": ["small"] * half + [None] * (args.particles - half),
    }
    print(f"SmolLM2 fp32 CPU, {args.particles} particles x {args.steps} steps = {rows_total} rows")
    print(f"{'adapter':8} {'wall s':>8} {'rows/s':>8} {'vs base':>8} {'forwards':>9} {'tokens':>7}")
    results = {}
    for label, names in runs.items():
        lm.clear_cache()
        lm.clear_kv_cache()
        before = lm.cache_info()
        start = time.perf_counter()
        rows = asyncio.run(replay(lm, trace, names))
        wall = time.perf_counter() - start
        info = lm.cache_info()
        results[label] = (wall, rows)
        ratio = wall / results["base"][0]
        print(f"{label:8} {wall:8.2f} {rows_total / wall:8.1f} {ratio:7.2f}x "
              f"{info['forwards'] - before['forwards']:9d} "
              f"{info['tokens_forwarded'] - before['tokens_forwarded']:7d}")
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), small).merge_and_unload()
    with torch.inference_mode():
        err = max((torch.log_softmax(merged(torch.tensor([c])).logits[0, -1], -1) - r).abs().max()
                  .item() for c, r in zip(trace[-1], results["small"][1]))
    print(f"max abs err of the last step's 'small' rows vs the merged model uncached: {err:.2g}")
    lm.close()


if __name__ == "__main__":
    main()
