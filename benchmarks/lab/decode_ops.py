"""Operators a captured decode step launches, counted on the CPU: what a GPU's graph holds.

A captured step on a GPU at small row counts is bound by its many small kernels and the host's
launch of the graph's nodes (``RESULTS.md``, issue 38). This script counts, without a GPU, the
operators one decode step's forward dispatches (``TorchDispatchMode``; views, which launch no
kernel, left out), run eagerly on the CPU with the decode step's CUDA defaults and with each
of them off in turn, over a random Llama with a real shape's layers and heads and small widths
(the count does not depend on the widths): ``--shape llama-3.1-8b`` (32 layers, 32 query heads
over 8 KV heads) or ``llama-3.2-1b`` (16 layers, 32 over 8).

    python benchmarks/lab/decode_ops.py --shape llama-3.1-8b

Each row: the options, operators a step (a CUDA kernel each, roughly: a matrix product may add
a split-K reduction), and the matrix products, products, sums and rolls among them. With
``--compile`` a last row has CUDA's defaults and ``compile`` (``decode/compiled.py``): a call of
a compiled function counts as the kernels its generated code launches (inductor's C++ on this
CPU: a GPU's Triton code may fuse differently), under ``compiled`` (a dispatch mode cannot see
inside).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # genback from a checkout

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


_KERNELS: dict[str, int] = {}  # compiled function -> kernels its code launches (last compile)
_ACTIVE: list = []  # the counting mode now entered


# a kernel's launch in inductor's generated ``call``: its own (C++ or Triton) or an operator's
_LAUNCH = re.compile(r"^\s+(cpp_fused_\w+\(|triton_\w+\.run\(|extern_kernels\.\w+\("
                     r"|aten\.\w+(\.\w+)?\(|torch\.ops\.aten\.\w+(\.\w+)?\()")


def _launches(code: str) -> int:
    """Kernel launches in the ``call`` function of inductor's generated module ``code``."""
    body = code[code.find("def call("):]
    return sum(1 for line in body.splitlines() if _LAUNCH.match(line)
               and "empty_strided" not in line and "reinterpret_tensor" not in line)


def _counting(name: str, fn):
    """``fn`` (compiled) run outside the counting mode, counted as the kernels its generated
    code launches (found at its last compilation)."""
    from torch._inductor.utils import run_and_get_code
    from torch.utils._python_dispatch import _disable_current_modes

    def wrapper(*args):
        with _disable_current_modes():
            if name in _KERNELS:
                out = fn(*args)
            else:  # (compiled anew, its code kept: once)
                out, codes = run_and_get_code(fn, *args)
                _KERNELS[name] = _launches(codes[-1]) if codes else 1
        if _ACTIVE:
            _ACTIVE[-1].ops["compiled"] += _KERNELS.get(name, 1)
        return out
    return wrapper


def _count_compiled() -> None:
    """Wrap the decode step's compiled functions (``decode/compiled.py``, the cascade's
    merge) with :func:`_counting`."""
    from genback.llm.hf.decode import cascade, compiled

    for name in ("rms_norm", "add_rms_norm", "silu_mul", "rotate"):
        compiled._COMPILED[name] = _counting(name, compiled.compiled(name))
    cascade._MERGE = _counting("merge", cascade._compiled_merge())


def count(model, tok, options: dict, rows: int, prompt: int) -> Counter:
    """The operators of the last step of a 4-step SMC trace through the eager decode step."""
    from genback.llm import AsyncTransformer
    from test_llm_tree import _smc_trace

    if options.get("compile"):
        _count_compiled()

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
            _ACTIVE.append(c)
            try:
                forward(buf)
            finally:
                _ACTIVE.pop()
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
    ap.add_argument("--compile", action="store_true",
                    help="a last row: CUDA's defaults and the compiled glue (DecodeStep.compile)")
    ap.add_argument("--defaults-only", action="store_true",
                    help="no rows with an option off")
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
    rows = [("CUDA's defaults", None)]
    if not args.defaults_only:
        rows += [(f"{d} off", d) for d in DEFAULTS] + [("all off", "all")]
    if args.compile:
        rows.append(("CUDA's defaults + compile", "compile"))
    for label, off in rows:
        options = (dict.fromkeys(DEFAULTS, False) if off == "all" else
                   {**base, "compile": True} if off == "compile" else
                   {**base, **({off: False} if off else {})})
        c = count(model, tok, options, args.rows, args.prompt)
        print(f"| {label} | {sum(c.values())} | {c['linear']} | {c['mul']} | {c['add']} | "
              f"{c['roll']} |" + (f" (compiled kernels {c['compiled']}: "
                                  f"{dict(sorted(_KERNELS.items()))})" if c['compiled'] else ""))


if __name__ == "__main__":
    main()
