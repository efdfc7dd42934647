"""A step's host time, several versions of genback side by side in one process, step by step.

``bench_host.py`` runs one version per process; on this project's shared VMs the machine's speed
moves up to 2x within minutes (its absolute figures between two runs differ more than the
changes they are meant to compare). Here each version is a copy of genback's package at a git
revision (``git archive``), imported under a name of its own (``gb_<k>``; its backend table's
module path and its attention functions' registered names renamed with it), and every version
runs its own SMC trace on the one tiny model (``tiny_lm.py``: a nearly free forward) with their
steps interleaved, in alternating order, so a drift of the machine hits each alike. The
working tree itself is the version ``.`` (imported as ``genback``).

The trace is ``bench_host.py``'s: one shared prompt, each particle samples its next token from
its row, resampling every 3 steps; a version's route is one of ``host_clocks.ask``'s (``gather``
of per-particle ``next_token_logprobs`` over lists, ``context`` the same over ``lm.context``
objects, ``batch`` one ``batch_next_token_logprobs`` call a step over lists, ``batch-context``
over contexts). A step's host time is its wall time minus the model's forward (hooks on the
model: the forward's own host work, tree attention's included, counts as the forward); the
sampling after the step is outside it. Printed per version: the median host time a step and a
query, and against the first version the ratio of medians and the median of the per-step
ratios (steps of one index, paired).

The version ``floor`` is no genback but the least a step's host can do in Python
(:class:`Floor`): each list read once (its prompt's item pointers compared with the prompt's,
in C: :func:`genback.cpython.same_items`; exactness needs every list read, as its items may have
changed since the last step) and the rows handed out from a fixed tensor; on ``gather`` each
query is also a coroutine awaiting a future, all of a step's resolved by one callback (the
asyncio ``Task`` a per-particle ``await`` costs any library whose method is a coroutine
function, genlm-backend's too). Its ratios to the first side are the lowest any version can
reach on this machine.

Run: ``taskset -c 1 python benchmarks/lab/host_ab.py --side a7a7700:gather --side .:batch-context
--particles 256 --contexts 100`` (``--side floor:gather --side floor:batch`` beside them).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

from host_clocks import ask  # noqa: E402
from tiny_lm import load, text_ids  # noqa: E402

from genback.cpython import same_items  # noqa: E402

ROUTES = ("gather", "context", "batch", "batch-context")
FLOOR_ROUTES = ("gather", "batch")  # (the floor's: over lists)
# registered names that one process can hold once per package (transformers' attention
# functions by name): renamed in each copy
_NAMES = ("genback_tree", "genback_decode")


def package_of(rev: str, k: int, root: Path, repo: Path) -> str:
    """The importable name of genback at git revision ``rev`` (``"."``: the working tree's
    ``genback``): its package extracted under ``root`` as ``gb_<k>``, renamed throughout.

    Raises:
        subprocess.CalledProcessError: ``rev`` is not a revision of ``repo``.
    """
    if rev == ".":
        return "genback"
    if rev == "floor":  # (no package: :class:`Floor`)
        return rev
    name = f"gb_{k}"
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "genback"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    (root / "genback").rename(root / name)
    for path in (root / name).rglob("*.py"):
        text = path.read_text()
        new = text.replace('return f"genback.', f'return f"{name}.')  # (backends' module paths)
        for old in _NAMES:
            new = new.replace(old, old.replace("genback", name))
        if new != text:
            path.write_text(new)
    return name


class Floor:
    """The least host work of a step in Python (see the module's doc), in place of a model:
    ``next_token_logprobs`` / ``batch_next_token_logprobs`` over lists that start with
    ``prompt``'s very int objects (as the trace's do), answered with rows of ``rows``
    (``[N, V]``, made once)."""

    def __init__(self, prompt: list, rows: torch.Tensor):
        self.prompt, self.rows, self.row = tuple(prompt), rows, rows[0]
        self.futures: list = []

    def context(self, ids):
        return list(ids)

    def _read(self, ids) -> None:
        if not same_items(ids, self.prompt, len(self.prompt)):
            raise ValueError("the floor's trace extends its prompt")

    async def next_token_logprobs(self, ids):
        self._read(ids)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self.futures:  # (the step's first query: one callback answers them all)
            loop.call_soon(self._answer)
        self.futures.append(fut)
        return await fut

    def _answer(self) -> None:
        futures, self.futures, row = self.futures, [], self.row
        for fut in futures:
            fut.set_result(row)

    async def batch_next_token_logprobs(self, contexts):
        for ids in contexts:
            self._read(ids)
        return self.rows[:len(contexts)]

    async def aclose(self) -> None:
        pass


async def _trace(model, tok, sides: list[tuple[str, str]], n: int, context: int, steps: int,
                 warmup: int = 3, resample: int = 3, decode: str = "auto") -> list[list[float]]:
    """Each side's host seconds of each measured step (see the module's docstring)."""
    fwd = [0.0, 0.0]  # (time in forwards, the running forward's start)
    hooks = [model.register_forward_pre_hook(lambda m, a: fwd.__setitem__(1, time.perf_counter())),
             model.register_forward_hook(
                 lambda m, a, o: fwd.__setitem__(0, fwd[0] + time.perf_counter() - fwd[1]))]
    lms, parts, gens = [], [], []
    try:
        for pkg, route in sides:
            prompt = text_ids(tok, context)
            if pkg == "floor":
                lm = Floor(prompt, torch.log_softmax(torch.zeros(n, model.config.vocab_size), -1))
            else:
                lm = importlib.import_module(pkg + ".llm").AsyncTransformer(model, tok,
                                                                             decode=decode)
            lms.append(lm)
            parts.append([lm.context(prompt) if "context" in route else prompt] * n)
            gens.append(torch.Generator().manual_seed(0))
        host: list[list[float]] = [[] for _ in sides]
        for step in range(warmup + steps):
            order = range(len(sides)) if step % 2 == 0 else reversed(range(len(sides)))
            for k in order:
                gc.collect(1)  # (the last step's garbage: every side's step starts alike)
                fwd[0] = 0.0
                t = time.perf_counter()
                rows = await ask(lms[k], parts[k], sides[k][1])
                wall = time.perf_counter() - t
                if step >= warmup:
                    host[k].append(wall - fwd[0])
                probs = (rows if isinstance(rows, torch.Tensor) else torch.stack(rows)).exp()
                nxt = torch.multinomial(probs, 1, generator=gens[k])[:, 0].tolist()
                new = [p + [t] for p, t in zip(parts[k], nxt)]
                if (step + 1) % resample == 0:
                    pick = torch.randint(0, n, (n,), generator=gens[k]).tolist()
                    new = [new[i] for i in pick]
                parts[k] = new
        return host
    finally:
        for h in hooks:
            h.remove()
        for lm in lms:
            await lm.aclose()


def run(sides: list[tuple[str, str]], particles: list[int], contexts: list[int], steps: int,
        repo: Path = BENCH.parent, decode: str = "auto") -> list[dict]:
    """One row per version and cell: ``rev``, ``route``, ``n``, ``context``, ``step_ms`` and
    ``query_us`` (medians of the host time), ``x`` and ``paired`` (against the first side).

    Raises:
        ValueError: an unknown route. subprocess.CalledProcessError: an unknown revision.
    """
    for rev, route in sides:
        if route not in (FLOOR_ROUTES if rev == "floor" else ROUTES):
            raise ValueError(f"route must be one of {ROUTES} (floor: {FLOOR_ROUTES}), got "
                             f"{rev}:{route}")
    torch.set_num_threads(1)
    model, tok = load("tiny")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, tmp)
        try:
            pkgs = [(package_of(rev, k, Path(tmp), repo), route)
                    for k, (rev, route) in enumerate(sides)]
            for n in particles:
                for context in contexts:
                    host = asyncio.run(_trace(model, tok, pkgs, n, context, steps,
                                              decode=decode))
                    first = statistics.median(host[0])
                    for (rev, route), h in zip(sides, host):
                        med = statistics.median(h)
                        out.append(dict(rev=rev, route=route, n=n, context=context,
                                        step_ms=med * 1e3, query_us=med / n * 1e6,
                                        x=med / first, paired=statistics.median(
                                            [a / b for a, b in zip(h, host[0])])))
        finally:
            sys.path.remove(tmp)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| N | context | version | route | host/step ms | host/query µs | x first | "
             "paired x |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['context']} | {r['rev']} | {r['route']} | "
                     f"{r['step_ms']:.2f} | {r['query_us']:.1f} | {r['x']:.2f} | "
                     f"{r['paired']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--side", action="append", required=True, metavar="REV:ROUTE",
                    help="a git revision ('.': the working tree) and a route "
                         f"({', '.join(ROUTES)}); the first is the baseline")
    ap.add_argument("--particles", type=int, nargs="+", default=[256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[100])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--decode", default="auto",
                    help="every side's AsyncTransformer(decode=...): auto (on the CPU the tree "
                         "forward) or eager (the decode step a GPU replays as graphs, eagerly)")
    args = ap.parse_args(argv)
    sides = [tuple(s.rsplit(":", 1)) for s in args.side]
    if any(len(s) != 2 for s in sides):
        ap.error(f"--side takes REV:ROUTE, got {args.side}")
    rows = run(sides, args.particles, args.contexts, args.steps, decode=args.decode)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
