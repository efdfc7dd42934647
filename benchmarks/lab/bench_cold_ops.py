"""What a step's host operations cost right after a forward, against back to back.

A step's host work runs once per forward, between two forwards. Its operations are small (a
``torch.from_numpy``, a ``log_softmax`` of a few rows, a NumPy mask), and timed back to back, in
a loop, each costs a few microseconds; but between two forwards the forward's data has gone
through the core's caches since the operation last ran, so its code and data come back from
farther away. This script times one sequence of such operations (the kinds a decode step's host
work is made of) under four conditions, median over ``--repeats`` runs (µs per operation):

- ``back to back``: the sequence again right after itself (caches warm);
- ``after a 1-token forward``: right after the tiny model's forward of one row of one token;
- ``after a decode step``: right after its forward of ``R`` rows of one token each over a
  ``T``-token KV cache per row (a ``DynamicCache``, cropped back after each): an SMC step's
  forward;
- ``after a R x T forward``: right after its forward of ``R`` rows of ``T`` tokens (a prefill);
- ``after a sweep of S MiB``: right after adding 1 to every byte of an ``S``-MiB array (the
  caches' sizes, as a probe).

The model is ``bench_host.py``'s tiny Llama (:mod:`tiny_lm`), the forward plain transformers
(no genback), one thread; ``--device cuda`` runs the forwards on a GPU (each followed by a
synchronisation, as a step reads its logits), so that what is left is the host's own share of
the effect: the forward's Python and dispatcher code, not its compute. What it shows: how much of a step's host time on this machine is the
distance of its code and data after the forward, not the work (``benchmarks/RESULTS.md``).

Run: ``taskset -c 1 python benchmarks/lab/bench_cold_ops.py`` (``--device cuda`` on a GPU host).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks beside lab/
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # genback from a checkout
import tiny_lm  # noqa: E402

from genback.llm.hf.forward.tree_cache import cache_argument, returned_cache  # noqa: E402

OPS = ("inference_mode", "from_numpy", "from_numpy again", "empty", "log_softmax", "unbind",
       "NumPy mask", "dict of R")


def sequence(rows: int, vocab: int):
    """A function that runs :data:`OPS` once and returns each one's seconds."""
    ids = np.arange(rows, dtype=np.int64)
    logits = torch.zeros(rows, vocab)
    width = np.arange(101)
    clock = time.perf_counter

    def run() -> list[float]:
        t = [clock()]
        with torch.inference_mode():
            pass
        t.append(clock())
        torch.from_numpy(ids)
        t.append(clock())
        torch.from_numpy(ids)
        t.append(clock())
        torch.empty((2, 4, rows * 101, 16))
        t.append(clock())
        torch.log_softmax(logits, dim=-1)
        t.append(clock())
        logits.unbind(0)
        t.append(clock())
        width >= ids[:, None]  # noqa: B015 (timed, not used)
        t.append(clock())
        {i: i for i in range(rows)}  # noqa: B018 (timed, not used)
        t.append(clock())
        return np.diff(t).tolist()

    return run


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16, help="R: the rows of the forward and the ops")
    p.add_argument("--tokens", type=int, default=101, help="T: tokens per row of the forward")
    p.add_argument("--sweep-mib", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--device", default="cpu", help="where the forwards run (the ops: the CPU)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tok = tiny_lm.tiny_tokenizer()
    dev = torch.device(args.device)
    model = tiny_lm.tiny_model(len(tok)).eval().to(dev)
    run = sequence(args.rows, len(tok))
    wide = torch.zeros((args.rows, args.tokens), dtype=torch.long, device=dev)
    one = torch.zeros((1, 1), dtype=torch.long, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def forward(x):
        def before():
            with torch.inference_mode():
                model(input_ids=x)
            sync()
        return before

    def sweep(mib):
        data = np.zeros(mib << 20, dtype=np.uint8)

        def before():
            data.__iadd__(1)
        return before

    with torch.inference_mode():
        cache = returned_cache(model(input_ids=wide, use_cache=True))
    column, cached = wide[:, :1], cache_argument(model, cache)  # (the name by transformers')

    def decode():
        with torch.inference_mode():
            model(input_ids=column, use_cache=True, **cached)
        sync()
        cache.crop(-1)  # (the one token added)

    conditions = [("back to back", None), ("after a 1-token forward", forward(one)),
                  (f"after a decode step ({args.rows} rows, {args.tokens}-token cache)", decode),
                  (f"after a {args.rows} x {args.tokens} forward", forward(wide))]
    conditions += [(f"after a sweep of {m} MiB", sweep(m)) for m in args.sweep_mib]
    cells = []
    for name, before in conditions:
        times = []
        for _ in range(args.repeats):
            if before is not None:
                before()
            times.append(run())
        med = [statistics.median(col) * 1e6 for col in zip(*times)]
        cells.append({"condition": name, **dict(zip(OPS, med)), "sum": sum(med)})
    warm = cells[0]["sum"]
    print(f"tiny model, forwards on {dev}, R = {args.rows}, median of {args.repeats} runs, "
          "µs per operation\n")
    print("| condition | " + " | ".join(OPS) + " | sum | sum / back to back |")
    print("|---" * (len(OPS) + 3) + "|")
    for c in cells:
        print(f"| {c['condition']} | " + " | ".join(f"{c[o]:.1f}" for o in OPS)
              + f" | {c['sum']:.0f} | {c['sum'] / warm:.1f}x |")
    return cells


if __name__ == "__main__":
    main()
