"""Scoring forwards on a GPU (issue 66 items 1-2): the packed varlen private attention against the
masked path it replaces, and a padded batch of the model's own forward (what ``HFLM`` runs).

A multiple-choice-like mix: ``--questions`` contexts of 40-120 random tokens, 4 continuations of
1-20 tokens each, every continuation scored (``AsyncTransformer.token_logprobs``, all at once).
Each genback mode runs on a fresh model object (empty KV tree): ``packed`` (the default on CUDA:
:mod:`genback.llm.hf.forward.varlen`), ``masked`` (``varlen.FORCE = "masked"``: the padded
layout and masked SDPA of before, sized by the old budget). ``hf``: right-padded batches of
``--hf-batch`` (context + continuation) rows through ``model(...)``, log-softmax gathered. Prints
wall seconds (best of ``--repeat``), forwards, tokens and padded tokens, and the largest
difference of genback's scores from the first mode's.

    python benchmarks/bench_scoring_gpu.py --shape llama-3.2-1b --dtype bf16 [--questions 200]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_models as G  # noqa: E402


def requests(questions: int, vocab: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(questions):
        ctx = [rng.randrange(vocab) for _ in range(rng.randrange(40, 121))]
        out.extend((ctx, [rng.randrange(vocab) for _ in range(rng.randrange(1, 21))])
                   for _ in range(4))
    return out


def run_genback(model, tok, reqs, mode: str, device) -> tuple[float, dict, list]:
    from genback.llm import AsyncTransformer
    from genback.llm.hf.forward import varlen

    varlen.FORCE = "masked" if mode == "masked" else None
    lm = AsyncTransformer(model, tok, batch_window=0.05)
    try:
        async def run():
            return await asyncio.gather(*(lm.token_logprobs(c, t) for c, t in reqs))
        G._sync(device)
        t0 = time.perf_counter()
        got = asyncio.run(run())
        G._sync(device)
        wall = time.perf_counter() - t0
        info = lm.cache_info()
    finally:
        lm.close()
        varlen.FORCE = None
    return wall, info, got


@torch.inference_mode()
def run_hf(model, reqs, batch: int, device) -> tuple[float, int]:
    """Right-padded batches of whole (context + continuation) rows, longest first, as HFLM."""
    order = sorted(reqs, key=lambda r: -(len(r[0]) + len(r[1])))
    G._sync(device)
    t0 = time.perf_counter()
    forwards = 0
    for i in range(0, len(order), batch):
        rows = [c + t for c, t in order[i:i + batch]]
        L = max(map(len, rows))
        ids = torch.zeros((len(rows), L), dtype=torch.long)
        mask = torch.zeros((len(rows), L), dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, :len(row)] = torch.tensor(row)
            mask[r, :len(row)] = 1
        logits = model(ids.to(device), attention_mask=mask.to(device)).logits
        for r, (c, t) in enumerate(order[i:i + batch]):
            lp = torch.log_softmax(logits[r, len(c) - 1:len(c) + len(t) - 1].float(), -1)
            lp.gather(1, torch.tensor(t, device=device)[:, None]).cpu()
        forwards += 1
    G._sync(device)
    return time.perf_counter() - t0, forwards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--hf-batch", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--modes", default="packed,masked,hf")
    a = p.parse_args()
    from _vocab_fixtures import gpt2_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    tok = gpt2_tokenizer()
    model = G.build_model(a.shape, device, dtype)
    reqs = requests(a.questions, len(tok))
    print(f"{a.shape} {a.dtype} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
          f": {len(reqs)} scoring requests, {sum(len(c) + len(t) for c, t in reqs)} tokens")
    first = None
    for mode in a.modes.split(","):
        best = None
        for _ in range(a.repeat):
            if mode == "hf":
                wall, fw = run_hf(model, reqs, a.hf_batch, device)
                line = f"forwards {fw}"
            else:
                wall, info, got = run_genback(model, tok, reqs, mode, device)
                diff = 0.0 if first is None else max(
                    float((x - y).abs().max()) for x, y in zip(got, first))
                line = (f"forwards {info['forwards']}, tokens {info['tokens_forwarded']}, "
                        f"padded {info['padded_tokens_forwarded']}, max |diff| {diff:.2e}")
            best = wall if best is None else min(best, wall)
        if mode != "hf" and first is None:
            first = got
        print(f"  {mode:7s} {best:8.3f} s  {line}", flush=True)


if __name__ == "__main__":
    main()
