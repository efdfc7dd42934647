"""The ``genback`` command line: ``models``, ``logprobs``, ``chars``, ``sample``, ``eval``.

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


def _utf8_continuations(lead: int) -> int:
    """Continuation bytes after a UTF-8 lead byte; -1 for a byte that cannot start a character."""
    if lead < 0x80:
        return 0
    if 0xC2 <= lead < 0xE0:
        return 1
    if 0xE0 <= lead < 0xF0:
        return 2
    if 0xF0 <= lead < 0xF5:
        return 3
    return -1


def next_char_masses(trie, mass, whole_chars: bool = True) -> list[tuple[bytes, float, bool]]:
    """Probability of each next character from per-node token masses.

    Args:
        trie: ``TokenCharacterTrie`` of the vocabulary.
        mass: ``trie.weight_sum(probs)`` (``(num_nodes,)`` float64).
        whole_chars: descend below UTF-8 lead bytes to whole characters (by binary-search
            lookups of the continuation bytes 0x80-0xBF); ``False`` stops at the first byte.

    Returns:
        ``[(bytes, prob, complete)]``: the mass of all tokens whose bytes start with ``bytes``.
        ``complete`` is False for a first byte that is not a whole character: a byte that cannot
        start UTF-8, a lead byte with ``whole_chars=False``, or the mass of tokens that end
        inside the character (e.g. byte-fallback tokens); the entries partition the mass of
        all tokens with at least one byte.
    """
    out = []
    for b in range(256):
        node = trie.lookup(bytes([b]))
        if node is None:
            continue
        n = _utf8_continuations(b)
        if n <= 0 or not whole_chars:
            out.append((bytes([b]), float(mass[node]), n == 0))
            continue
        frontier = [(bytes([b]), node)]
        for _ in range(n):
            deeper = []
            for prefix, nd in frontier:
                below = 0.0
                for c in range(0x80, 0xC0):
                    child = trie.lookup(prefix + bytes([c]))
                    if child is not None:
                        deeper.append((prefix + bytes([c]), child))
                        below += float(mass[child])
                rest = float(mass[nd]) - below
                if rest > 1e-12 * max(float(mass[nd]), 1e-300):
                    out.append((prefix, rest, False))
            frontier = deeper
        out.extend((prefix, float(mass[nd]), True) for prefix, nd in frontier)
    return out


def cmd_chars(args) -> int:
    from .trie import TokenCharacterTrie

    lm = _load(args)
    ids = lm.tokenizer.encode(args.prompt, add_special_tokens=False)
    probs = lm.next_token_logprobs_sync(ids).double().exp().numpy()
    trie = TokenCharacterTrie(lm.byte_vocab)
    mass = trie.weight_sum(probs)
    rows = sorted(next_char_masses(trie, mass, whole_chars=not args.bytes), key=lambda r: -r[1])
    empty = float(probs[[len(t) == 0 for t in lm.byte_vocab]].sum()) if len(probs) else 0.0
    unit = "first byte" if args.bytes else "first character (UTF-8; multi-byte characters by descending the trie)"
    print(f"prompt: {args.prompt!r} ({len(ids)} tokens)")
    print(f"next {unit}: probability = total next-token probability of the tokens whose bytes start with it")
    print(f"{'rank':>4}  {'prob':>8}  {'logprob':>9}  char")
    for rank, (key, p, complete) in enumerate(rows[: args.top_k], 1):
        if complete:
            label = repr(key.decode("utf-8"))
        else:
            label = f"{key!r} (byte{'s' if len(key) > 1 else ''}, not a whole character)"
        lp = math.log(p) if p > 0 else -math.inf
        print(f"{rank:>4}  {p:>8.4f}  {lp:>9.4f}  {label}")
    shown = sum(r[1] for r in rows[: args.top_k])
    print(f"shown {min(args.top_k, len(rows))} of {len(rows)}, mass {shown:.4f}; "
          f"all characters {sum(r[1] for r in rows):.4f}; tokens with no bytes {empty:.4f}")
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


def cmd_eval(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    from .engine import GenbackEngine
    from .engine.tasks import load_task, run_task, write_records

    try:
        kind, rows = load_task(args.task_file, kind=args.kind, limit=args.limit)
    except (OSError, ValueError) as exc:
        print(f"genback eval: error: {exc}", file=sys.stderr)
        return 2
    print(f"task {args.task_file}: {kind}, {len(rows)} lines", file=sys.stderr, flush=True)
    print(f"loading {args.model} ({args.backend}) ...", file=sys.stderr, flush=True)
    engine = GenbackEngine(backend=args.backend, max_length=args.max_length)
    with engine.build(args.model) as session:
        start = time.perf_counter()
        summary, records = run_task(session, kind, rows, max_new_tokens=args.max_new_tokens,
                                    progress=not args.no_progress)
        wall = time.perf_counter() - start
        info = session.lm.cache_info()
    print(f"results: {args.task_file} ({kind}) on {args.model} [{args.backend}]")
    for key, value in summary.items():
        text = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"  {key:<18} {text}")
    print(f"  {'wall_s':<18} {wall:.2f} (model load excluded)")
    if "tokens_forwarded" in info:
        print(f"  {'tokens_forwarded':<18} {info['tokens_forwarded']} "
              f"(tokens in all queries {info['tokens_queried']})")
    if args.output:
        write_records(args.output, summary, records)
        print(f"  per-line records written to {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genback", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def model_opts(p):
        p.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"embedded alias, local HF folder or Hub id (default {DEFAULT_MODEL})")
        p.add_argument("--backend", default="hf", choices=["hf", "vllm", "mock"],
                       help="model backend (default hf)")
        p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")

    sub.add_parser("models", help="list the embedded model aliases and whether each is ready")
    p = sub.add_parser("logprobs", help="top next tokens after a prompt")
    p.add_argument("prompt")
    p.add_argument("--top-k", type=int, default=10)
    model_opts(p)
    p = sub.add_parser("chars", help="next-character distribution implied by the next-token distribution")
    p.add_argument("prompt")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--bytes", action="store_true", help="group by first byte instead of whole UTF-8 characters")
    model_opts(p)
    p = sub.add_parser("sample", help="run concurrent samplers and print batching statistics")
    p.add_argument("prompt")
    p.add_argument("--particles", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="particle i uses seed + i (default 0)")
    model_opts(p)
    p = sub.add_parser("eval", help="run a multiple-choice, perplexity or generation task from a JSONL file")
    p.add_argument("task_file", help="JSONL task (formats: see genback.engine.tasks)")
    p.add_argument("--kind", choices=["multiple_choice", "perplexity", "generation"],
                   help="task kind (default: from the keys of the lines)")
    p.add_argument("--limit", type=int, default=None, help="use the first N lines")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="generation: default most new tokens per prompt (default 64)")
    p.add_argument("--max-length", type=int, default=None,
                   help="model window in tokens (default: the model's)")
    p.add_argument("--output", default=None, help="write per-line results as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    model_opts(p)
    return parser


COMMANDS = {"models": cmd_models, "logprobs": cmd_logprobs, "chars": cmd_chars, "sample": cmd_sample,
            "eval": cmd_eval}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
