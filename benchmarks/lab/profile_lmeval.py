"""Where ``GenbackLM``'s time goes on lm-eval's request mixes, thread by thread (issue 66).

On an H200 the 1B mixes were host-bound (pairs: ~0.13 s of compute in genback's 0.49 s), and
what bounds them there was not measured. This tool answers it in one run: for each mix of
``bench_lmeval_gpu.py`` (the same model, dtype, instances and options), genback's wall (best of
``--repeat``, caches cleared before each run), then one more run under yappi (CPU clock, every
thread), reported as each thread's CPU seconds against that run's wall -- the caller's thread
(lm-eval's side and genback's encoding), the engine's event loop thread ``genback-session`` (the
front, the batcher, and the batches it runs inline) and the batcher's worker ``genback-batcher``
(the runner: plans, forwards launched, results read back) -- and each of these threads' top
functions by own CPU time. A thread whose CPU is close to the wall bounds the mix (host-bound);
what is left of the wall is the device's, or waiting. HFLM is not run (``bench_lmeval_gpu.py``
compares the two).

Options are ``bench_lmeval_gpu.py``'s plus ``--top`` (functions a thread, default 25).

    python benchmarks/lab/profile_lmeval.py --shape llama-3.2-1b --mixes pairs,rolling,generate
    python benchmarks/lab/profile_lmeval.py --shape tiny --device cpu --mixes pairs,rolling \\
        --pairs 16 --texts 2          # the CPU smoke run

Needs ``yappi`` (the dev extra; on the GPU image from ``.whl``) and lm-eval.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_lmeval_gpu as B  # noqa: E402

# thread name (prefix) -> role in the report
ROLES = (("MainThread", "caller"), ("genback-session", "loop"), ("genback-batcher", "worker"))


def role(thread_name: str) -> str:
    """The report's name for a thread: caller, loop, worker or other."""
    return next((r for prefix, r in ROLES if thread_name.startswith(prefix)), "other")


def profiled(fn) -> tuple[float, dict, dict]:
    """``(wall seconds, CPU seconds by role, [(own CPU s, calls, function)] by role, most
    first)`` of ``fn()`` under yappi's CPU clock (every thread, those started during it too)."""
    import threading
    import time

    import yappi

    yappi.clear_stats()
    yappi.set_clock_type("cpu")
    yappi.start(builtins=True, profile_threads=True)
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        wall = time.perf_counter() - t0
        yappi.stop()
    cpu: dict[str, float] = {}
    names: dict[int, str] = {}
    alive = {t.ident: t.name for t in threading.enumerate()}  # (yappi names a thread's class)
    for t in yappi.get_thread_stats():
        r = role(alive.get(t.tid, t.name))
        names[t.id] = r
        cpu[r] = cpu.get(r, 0.0) + t.ttot
    top: dict[str, list] = {}
    for f in yappi.get_func_stats():
        r = names.get(f.ctx_id, "other")
        top.setdefault(r, []).append((f.tsub, f.ncall, f"{f.name} ({Path(f.module).name}:{f.lineno})"))
    for rows in top.values():
        rows.sort(key=lambda x: -x[0])
    yappi.clear_stats()
    return wall, cpu, top


def main(argv=None) -> dict:
    """Run the mixes; returns ``{mix: {"wall", "profiled_wall", "cpu": {role: s}, "top": {role:
    [(own s, calls, function)]}}}``."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--top", type=int, default=25)
    known, rest = pre.parse_known_args(argv)
    if {"-h", "--help"} & set(rest):  # (this tool's text, then the options it shares)
        print(__doc__)
    args = B.parse(rest)
    device, dtype = B.setup(args)

    from genback.engine import GenbackLM
    from genback.llm import AsyncTransformer

    model, tok, name = B.load(args, device, dtype)
    print(f"{name} ({dtype}) on {device}", flush=True)
    lm = AsyncTransformer(model, tok)
    gb = GenbackLM(lm=lm)
    text = B.Text(tok)
    out = {}
    try:
        for mix in args.mixes:
            reqs = B.make_instances(mix, text, args)
            B.call(gb, mix, reqs[:max(4, min(len(reqs), 64))])  # (warm-up)
            best = float("inf")
            for _ in range(args.repeat):
                lm.clear_cache()
                lm.clear_kv_cache()
                best = min(best, B.timed(device, lambda: B.call(gb, mix, reqs))[1])
            lm.clear_cache()
            lm.clear_kv_cache()
            wall, cpu, top = profiled(lambda: (B.call(gb, mix, reqs), B.G._sync(device)))
            out[mix] = {"requests": len(reqs), "wall": best, "profiled_wall": wall, "cpu": cpu,
                        "top": top}
            shares = ", ".join(f"{r} {s:.3f} s ({s / wall:.0%})" for r, s in sorted(
                cpu.items(), key=lambda kv: -kv[1]))
            print(f"\n## {mix}: {len(reqs)} requests, wall {best:.3f} s (profiled {wall:.3f} s);"
                  f" CPU {shares}", flush=True)
            for r in ("worker", "loop", "caller"):
                rows = top.get(r, [])[:known.top]
                if rows:
                    print(f"\n{r}: own CPU s, calls, function")
                    for own, calls, fn in rows:
                        print(f"  {own:8.4f} {calls:8d}  {fn}")
    finally:
        gb.close()
    return out


if __name__ == "__main__":
    main()
