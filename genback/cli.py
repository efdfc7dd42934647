"""The ``genback`` command line: ``models``, ``logprobs``, ``sample``.

Everything runs offline on the embedded default model unless ``--model`` names another.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time

from .registry import DEFAULT_MODEL, EMBEDDED_MODELS, is_ready, model_dir


def _load(args):
    import torch

    torch.set_num_threads(args.threads)
    from .llm import load_model_by_name

    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    return load_model_by_name(args.model, backend=args.backend)


def cmd_models(args) -> int:
    print(f"{'alias':<16} {'ready':<6} {'package':<14} description")
    for alias, m in EMBEDDED_MODELS.items():
        ready = "yes" if is_ready(alias) else "no"
        print(f"{alias:<16} {ready:<6} {m.package:<14} {m.description}")
        print(f"{'':<16} cache: {model_dir(alias)}")
    return 0


def cmd_logprobs(args) -> int:
    lm = _load(args)
    ids = lm.tokenizer.encode(args.prompt, add_special_tokens=False)
    row = lm.next_token_logprobs_sync(ids)
    values, indices = row.topk(args.top_k)
    print(f"prompt: {args.prompt!r} ({len(ids)} tokens)")
    print(f"{'rank':>4}  {'token id':>8}  {'prob':>8}  {'logprob':>9}  token")
    for rank, (lp, tid) in enumerate(zip(values.tolist(), indices.tolist()), 1):
        token = lm.tokenizer.decode([tid])
        print(f"{rank:>4}  {tid:>8}  {math.exp(lp):>8.4f}  {lp:>9.4f}  {token!r}")
    lm.close()
    return 0


def cmd_sample(args) -> int:
    lm = _load(args)
    ids = lm.tokenizer.encode(args.prompt, add_special_tokens=False)
    eos = [lm.tokenizer.eos_token_id] if lm.tokenizer.eos_token_id is not None else []
    seed = args.seed

    async def run():
        return await lm.batch_sample(
            [ids] * args.particles, args.max_tokens, eos, temperature=args.temperature, seed=seed
        )

    start = time.perf_counter()
    completions = asyncio.run(run())
    wall = time.perf_counter() - start
    for i, tokens in enumerate(completions):
        text = (args.prompt + lm.tokenizer.decode(tokens)).replace("\n", "\\n")
        print(f"[{i:>2}] {text}")
    info = lm.cache_info()
    print()
    print(f"particles {args.particles}, max tokens {args.max_tokens}, wall time {wall:.2f} s")
    print(f"queries {info['queries']} (row hits {info['row_hits']}), batches {info['batches']}, "
          f"forwards {info.get('forwards', 'n/a')}, "
          f"mean batch size {info['batched_queries'] / max(1, info['batches']):.1f}")
    if "tokens_forwarded" in info:
        print(f"tokens forwarded {info['tokens_forwarded']} vs tokens in all queries "
              f"{info['tokens_queried']} ({info['tokens_queried'] / max(1, info['tokens_forwarded']):.1f}x "
              f"saved by the KV prefix tree), KV held {info['kv_bytes'] / 2**20:.1f} MiB")
    lm.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genback", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def model_opts(p):
        p.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"embedded alias, local HF folder or Hub id (default {DEFAULT_MODEL})")
        p.add_argument("--backend", default="hf", choices=["hf", "mock"],
                       help="model backend (default hf)")
        p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")

    sub.add_parser("models", help="list the embedded model aliases and whether each is ready")
    p = sub.add_parser("logprobs", help="top next tokens after a prompt")
    p.add_argument("prompt")
    p.add_argument("--top-k", type=int, default=10)
    model_opts(p)
    p = sub.add_parser("sample", help="run concurrent samplers and print batching statistics")
    p.add_argument("prompt")
    p.add_argument("--particles", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="particle i uses seed + i (default 0)")
    model_opts(p)
    return parser


COMMANDS = {"models": cmd_models, "logprobs": cmd_logprobs, "sample": cmd_sample}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
