"""``genback sample``: concurrent samplers over one model, their batching statistics, a progress
bar on standard error, and the KV tree's picture (``--tree``)."""

from __future__ import annotations

import asyncio
import sys
import time

from .model import UsageError, _encode, _load


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
    (the rule of :meth:`genback.core.decoding.Decoding.room`), before any sampling."""
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

    from ..llm.backends import BACKENDS, backend_class

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
