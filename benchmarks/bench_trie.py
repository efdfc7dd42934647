"""Trie benchmark: genback vs genlm-backend 0.3.1 in the same process.

    python benchmarks/bench_trie.py [--vocabs smollm2,gpt2,gemma3] [--repeat 7] [--no-genlm]

Measures, per vocabulary: build time; per-row ``weight_sum`` / ``weight_max`` at B=1 (single
calls) and B=32 (``batch_weight_*`` divided by 32) for genback's ``TokenCharacterTrie`` and
``ParallelTokenCharacterTrie(device="cpu")`` and genlm-backend's ``TokenCharacterTrie`` and
``ParallelTokenCharacterTrie`` (needs ``numba``); and three floors (no reduction at all):

    read floor   = ``np.multiply(ws.sum(), 1.0, out=node_buf)``: one contiguous read of the V
                   weights and one write of N values. Too optimistic: it reads the weights in
                   token-id order, but every node's tokens are scattered in that order.
    write floor  = ``np.take(ws, order, mode="clip")`` (the V weights gathered into leaf order, as
                   any slice-based method must) + ``node_buf.fill(0)`` (write N values).
    gather floor = the same gather of V + ``np.take(buf, node_src, out=node_buf, mode="clip")``:
                   writing N node values from the <= 2V distinct ones (chains of single-child
                   nodes share a value), the output step of any method that reduces each
                   distinct slice once. This is the fair floor: it is the data movement of the
                   reduction minus the reduction itself.
    B=32 gather floor = the same per row into a freshly allocated ``(32, N)`` result (fresh
                   pages and a 38 MB result that does not stay in cache), divided by 32.

Times are the minimum over ``--repeat`` runs (each run times a loop of calls) with
``torch.set_num_threads(1)``. genlm-backend tries get ``genlm.backend.tokenization.Token`` items.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _vocab_fixtures as F  # noqa: E402
from genback.trie import ParallelTokenCharacterTrie, TokenCharacterTrie  # noqa: E402

torch.set_num_threads(1)


def best(fn, repeat: int, inner: int = 1) -> float:
    """Minimum seconds per call of ``fn`` over ``repeat`` runs of ``inner`` calls."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return min(times)


def timed_build(cls, vocab, repeat, **kw):
    out = None
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = cls(vocab, **kw)
        times.append(time.perf_counter() - t0)
    return out, min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=(
        "Token-character trie on the CPU: genback's build and weight_sum / weight_max (B=1, B=32) "
        "against genlm-backend 0.3.1's trie in the same process, and against floors that reduce nothing."))
    ap.add_argument("--vocabs", default="smollm2,gpt2,gemma3")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-genlm", action="store_true")
    args = ap.parse_args(argv)
    genlm = None
    if not args.no_genlm:
        try:
            from genlm.backend.tokenization import Token as GToken
            from genlm.backend.trie import ParallelTokenCharacterTrie as GPar
            from genlm.backend.trie import TokenCharacterTrie as GSeq

            genlm = (GToken, GSeq, GPar)
        except ImportError as e:
            print(f"genlm-backend unavailable ({e}); genback only")
    rows = []
    for name in args.vocabs.split(","):
        vocab = F.byte_vocab(name)
        if vocab is None:
            print(f"skip {name}: {F.MISSING[name]}")
            continue
        V = len(vocab)
        rng = np.random.default_rng(0)
        W = rng.dirichlet(np.full(V, 0.3), size=32)
        w = W[0]
        rep = args.repeat
        gb, gb_build = timed_build(TokenCharacterTrie, vocab, rep)
        gp, gp_build = timed_build(ParallelTokenCharacterTrie, vocab, max(1, rep // 2), device="cpu")
        N = gb.num_nodes
        buf = np.empty(N)
        order, node_src = gb._blocks.order, gb._blocks.node_src
        vbuf = np.empty(gb._blocks.tree_size + gb._blocks.num_segments)
        floor = best(lambda: np.multiply(w.sum(), 1.0, out=buf), rep, 20)
        wfloor = best(lambda: (np.take(w, order, out=vbuf[:V], mode="clip"), buf.fill(0.0)), rep, 20)
        gfloor = best(lambda: (np.take(w, order, out=vbuf[:V], mode="clip"),
                               np.take(vbuf, node_src, out=buf, mode="clip")), rep, 20)

        def gather32():
            out = np.empty((32, N))
            for b in range(32):
                np.take(W[b], order, out=vbuf[:V], mode="clip")
                np.take(vbuf, node_src, out=out[b], mode="clip")

        g32 = best(gather32, max(2, rep // 2)) / 32
        res = {"vocab": name, "V": V, "N": N, "floor_us": floor * 1e6, "wfloor_us": wfloor * 1e6,
               "gfloor_us": gfloor * 1e6, "gfloor32_us": g32 * 1e6}
        impls = {"genback": gb, "genback-par": gp}
        res["build_genback"] = gb_build
        res["build_genback-par"] = gp_build
        if genlm is not None:
            GToken, GSeq, GPar = genlm
            gv = [GToken(t.token_id, t.byte_string) for t in vocab]
            impls["genlm"], res["build_genlm"] = timed_build(GSeq, gv, min(3, rep))
            impls["genlm-par"], res["build_genlm-par"] = timed_build(GPar, gv, 1, device="cpu")
        for key, trie in impls.items():
            inner = 5 if "genlm" in key or name == "gemma3" else 20
            res[f"sum1_{key}"] = best(lambda: trie.weight_sum(w), rep, inner) * 1e6
            res[f"max1_{key}"] = best(lambda: trie.weight_max(w), rep, inner) * 1e6
            Wb = torch.tensor(W) if key.endswith("par") else W
            res[f"sum32_{key}"] = best(lambda: trie.batch_weight_sum(Wb), max(2, rep // 2)) * 1e6 / 32
            res[f"max32_{key}"] = best(lambda: trie.batch_weight_max(Wb), max(2, rep // 2)) * 1e6 / 32
        rows.append(res)
        report(res)
    return rows


def report(r):
    print(f"\n== {r['vocab']}: V={r['V']}, nodes={r['N']}, floors us/row: read={r['floor_us']:.0f} "
          f"write={r['wfloor_us']:.0f} gather={r['gfloor_us']:.0f} gather(B=32)={r['gfloor32_us']:.0f}")
    keys = [k for k in ("genback", "genback-par", "genlm", "genlm-par") if f"build_{k}" in r]
    print("build s:   " + "  ".join(f"{k}={r['build_' + k]:.3f}" for k in keys))
    if "build_genlm" in r:
        print(f"build speedup vs genlm: {r['build_genlm'] / r['build_genback']:.0f}x (seq), "
              f"{r['build_genlm-par'] / r['build_genback-par']:.0f}x (par)")
    for op in ("sum1", "max1", "sum32", "max32"):
        line = f"{op:6s} us/row: " + "  ".join(f"{k}={r[f'{op}_{k}']:.0f}" for k in keys)
        g = r["gfloor_us"] if op.endswith("1") else r["gfloor32_us"]
        line += (f"  | genback/gather floor={r[f'{op}_genback'] / g:.1f}x"
                 f" /write floor={r[f'{op}_genback'] / r['wfloor_us']:.1f}x")
        if "build_genlm" in r:
            line += f"  genlm/genback={r[f'{op}_genlm'] / r[f'{op}_genback']:.1f}x"
        print(line)


if __name__ == "__main__":
    main()
