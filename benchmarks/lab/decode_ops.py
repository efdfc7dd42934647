"""Operators a captured decode step launches, counted on the CPU: what a GPU's graph holds.

A captured step on a GPU at small row counts is bound by its many small kernels and the host's
launch of the graph's nodes (``RESULTS.md``, issue 38). This script counts, without a GPU, the
operators one decode step's forward dispatches (``TorchDispatchMode``; views, which launch no
kernel, left out), run eagerly on the CPU with the decode step's CUDA defaults and with each
of them off in turn, over a random Llama with a real shape's layers and heads and small widths
(the count does not depend on the widths): ``--shape llama-3.1-8b`` (32 layers, 32 query heads
over 8 KV heads) or ``llama-3.2-1b`` (16 layers, 32 over 8).

    python benchmarks/decode_ops.py --shape llama-3.1-8b

Each row: the options, operators a step (a CUDA kernel each, roughly: a matrix product may add
a split-K reduction), and the matrix products, products, sums and rolls among them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

SHAPES = {"llama-3.1-8b": (32, 32, 8), "llama-3.2-1b": (16, 32, 8)}  # layers, heads, KV heads
VIEWS = {"view", "unsqueeze", "slice", "as_strided", "transpose", "expand", "select", "narrow",
         "alias", "_unsafe_view", "t", "permute", "split", "detach", "squeeze", "reshape",
         "lift_fresh", "split_with_sizes", "unbind", "empty"}
DEFAULTS = ("norm_op", "rope_op", "keep_level0", "fuse_projections")  # CUDA's, all True


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count(model, tok, options: dict, rows: int, prompt: int) -> Counter:
    """The operators of the last step of a 4-step SMC trace through the eager decode step."""
    from genback.llm import AsyncTransformer
    from test_llm_tree import _smc_trace

    lm = AsyncTransformer(model, tok, batch_window=0.05, row_cache_size=0, decode="eager")
    step = lm.runner.decode_step
    for name, value in options.items():
        setattr(step, name, value)
    trace = _smc_trace(random.Random(4), prompt, rows, 4, 2, 400)
    lm.cache_kv(trace[0][0][:-1])
    counts = []
    forward = step._forward

    def counted(buf):
        with _Count() as c:
            forward(buf)
        counts.append(c.ops)
    step._forward = counted

    async def run():
        for contexts in trace:
            await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    try:
        asyncio.run(run())
    finally:
        lm.close()
    return counts[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=300)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import gpt2_tokenizer

    tok = gpt2_tokenizer()
    layers, heads, kv_heads = SHAPES[args.shape]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=8 * heads, intermediate_size=28 * heads,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096)).eval()
    print(f"{args.shape} layers and heads ({layers} layers, {heads} heads over {kv_heads}), "
          f"{args.rows} rows, {args.prompt}-token prompt; operators of one decode step\n")
    print("| options | operators | matrix products | products (mul) | sums (add) | roll |")
    print("|---|---|---|---|---|---|")
    base = dict.fromkeys(DEFAULTS, True)
    for label, off in [("CUDA's defaults", None)] + [(f"{d} off", d) for d in DEFAULTS] + \
            [("all off", "all")]:
        options = dict.fromkeys(DEFAULTS, False) if off == "all" else {**base, **(
            {off: False} if off else {})}
        c = count(model, tok, options, args.rows, args.prompt)
        print(f"| {label} | {sum(c.values())} | {c['linear']} | {c['mul']} | {c['add']} | "
              f"{c['roll']} |")


if __name__ == "__main__":
    main()
