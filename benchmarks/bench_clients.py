"""Client programs on genback (through the alias) vs on genlm-backend 0.3.1, one run.

The programs are the client tests' own (``tests/clients/``): an llamppl SMC lipogram with a cached
prompt run in two event loops, genlm-control's eager / top-k trie samplers and AWRS under a regular
expression, and a genlm-bytes ``ByteLLM`` byte-level log-probability, all on the real SmolLM2-135M
(fp32, CPU, one torch thread). Each program runs in a fresh process per backend, the two backends
alternating, ``--repeat`` times; the table gives medians of

* ``client s``: the program's client work (SMC runs, samplers, ByteLLM queries; trie builds happen
  inside these phases), i.e. everything after the model is loaded;
* ``startup s``: importing the client (and with it ``genlm.backend``) and loading the model;
* ``process s``: the whole process, wall clock.

It also reports whether both backends drew the same samples (the tests check this in detail).

Needs ``pip install --no-deps -r ci/clients.txt && pip install -r ci/clients-deps.txt``.
Run: ``python benchmarks/bench_clients.py [--repeat 3] [--programs llamppl_smc,...] [--scale 4]``
(``--scale N`` multiplies the programs' particles, and llamppl's tokens, by N).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLIENTS = REPO / "tests" / "clients"
PROGRAMS = ("llamppl_smc", "control_samplers", "bytes_bytellm")
STARTUP = ("setup", "import", "load")


def run(program: str, backend: str, scale: int = 1) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(CLIENTS / f"{program}.py"), "--backend", backend,
                           "--scale", str(scale)],
                          capture_output=True, text=True, cwd=REPO, env=env)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{program} --backend {backend} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    t = result["timings"]
    result["_client"] = sum(v for k, v in t.items() if k not in STARTUP)
    result["_startup"] = sum(t.get(k, 0.0) for k in STARTUP)
    result["_process"] = wall
    return result


def samples(result: dict):
    """The drawn samples of a program's result (what must agree across backends)."""
    if result["program"] == "llamppl_smc":
        return [r["tokens"] for r in result["runs"]]
    if result["program"] == "control_samplers":
        return {k: v["texts"] for k, v in result["samplers"].items()}
    return [t for t, _ in result["next_top"]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--scale", type=int, default=1,
                        help="multiply particles (and llamppl's tokens); 1 = the tests' programs")
    args = parser.parse_args()
    programs = [p for p in args.programs.split(",") if p]
    print(f"command: python benchmarks/bench_clients.py --repeat {args.repeat} "
          f"--programs {','.join(programs)} --scale {args.scale}")
    print(f"python {sys.version.split()[0]}, torch threads 1 (set in each program), cpu count {os.cpu_count()}")
    rows = []
    for program in programs:
        res = {"genback": [], "genlm": []}
        for i in range(args.repeat):
            order = ("genback", "genlm") if i % 2 == 0 else ("genlm", "genback")
            for backend in order:
                res[backend].append(run(program, backend, args.scale))
                r = res[backend][-1]
                print(f"  {program:17s} {backend:8s} run {i}: client {r['_client']:6.2f}s "
                      f"startup {r['_startup']:5.2f}s process {r['_process']:6.2f}s  {r['timings']}",
                      flush=True)
        same = all(samples(a) == samples(b) for a, b in zip(res["genback"], res["genlm"]))
        med = {b: {k: statistics.median(r[f"_{k}"] for r in res[b]) for k in ("client", "startup", "process")}
               for b in res}
        rows.append((program, med, same))
    print()
    print("| program | genlm-backend client s | genback client s | speedup | genlm-backend startup s "
          "| genback startup s | genlm-backend process s | genback process s | same samples |")
    print("|---|---|---|---|---|---|---|---|---|")
    tot = {b: {"client": 0.0, "process": 0.0} for b in ("genback", "genlm")}
    for program, med, same in rows:
        g, o = med["genlm"], med["genback"]
        for b in tot:
            tot[b]["client"] += med[b]["client"]
            tot[b]["process"] += med[b]["process"]
        print(f"| {program} | {g['client']:.2f} | {o['client']:.2f} | {g['client'] / o['client']:.2f}x "
              f"| {g['startup']:.2f} | {o['startup']:.2f} | {g['process']:.2f} | {o['process']:.2f} "
              f"| {'yes' if same else 'NO'} |")
    g, o = tot["genlm"], tot["genback"]
    print(f"| all | {g['client']:.2f} | {o['client']:.2f} | {g['client'] / o['client']:.2f}x | | "
          f"| {g['process']:.2f} | {o['process']:.2f} | |")


if __name__ == "__main__":
    main()
