"""SMC at scale on SmolLM2: genback vs a hand-written KV loop (and genlm-backend), over a grid.

For each cell (particles x prompt tokens, 32 steps):

1. **genback (live SMC)**: a fresh ``AsyncTransformer`` runs a real SMC sampler: every step asks
   the next-token rows of all particles concurrently, samples each particle's next token from its
   row (seeded), and every ``--resample`` steps resamples the particles (multinomial on the
   sampled tokens' log-probs, seeded). The contexts of every step are recorded: that is the
   trace. Timed: the queries only (the sampler's own sampling/resampling time is excluded). Particles start
   from one prompt and sample at temperature 1, so early steps hold few distinct contexts.
2. **hand-written loop**: replays the trace with plain transformers: the prompt is prefilled
   once; each step forwards only that step's *distinct* contexts, one token each, in one batch,
   over per-particle KV (each distinct context's KV row is its parent's row, selected with
   ``index_select``, extended by the forward). Skipped where its per-particle KV cannot fit in
   memory (it says how much it would need).
3. **genlm-backend 0.3.1** (smallest cell only, if installed): its ``AsyncTransformer`` replays
   the trace.

Each system runs in its own process, so peak RSS is its own. Reported per cell: wall time of
the queries (prefill included), ratio to the hand-written loop, the prefill's and the decode
steps' times, decode tokens/s (distinct tokens forwarded per second of decode steps), achieved
bandwidth of the decode steps (weights + KV bytes read per second, as gpt-fast reports it) and
achieved compute (GFLOP/s, counted from the trace: see :func:`decode_flops`) — small batches are
bound by the bytes read, large ones by arithmetic — peak RSS while querying, the RSS right after the model
loaded (Python, torch and the weights, before any query), KV held by the tree, and the max abs
error of the last step's rows (2 particles) against an uncached forward.

Run: ``python benchmarks/bench_smc_scale.py`` (the full grid; ``--particles 16 64``
``--prompts 100 1000`` for part of it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

STORY = (
    "In the spring of that year the river rose higher than anyone in the valley could remember. "
    "The miller moved his sacks of grain to the loft, and the children watched from the hill as "
    "the water crept across the meadow. Years later, when people spoke of it, they said that "
)
# Long prompts: varied prose taken from the standard library's own documentation (deterministic
# for a Python version, available offline), then the story, whose continuation the particles
# sample. A repeated paragraph would make the model so sure of the next token that particles
# rarely diverge; varied text keeps the SMC tree branching as it does for real prompts.
DOC_MODULES = ["json", "argparse", "asyncio", "collections", "functools", "itertools", "pathlib",
               "subprocess", "threading", "typing", "unittest", "logging", "email", "decimal",
               "fractions", "zipfile", "tarfile", "csv", "textwrap", "difflib", "heapq", "bisect",
               "statistics", "calendar", "datetime", "random", "string", "codecs", "pickle"]


def prompt_ids(tokenizer, n):
    """``n`` token ids: the tail of the documentation prose, then the story."""
    import importlib

    docs = " ".join(" ".join((importlib.import_module(m).__doc__ or "").split())
                    for m in DOC_MODULES)
    story = tokenizer.encode(STORY)
    ids = tokenizer.encode(docs)
    assert len(ids) + len(story) >= n, (len(ids), n)
    return (ids + story)[-n:] if n > len(story) else story[-n:]


def load(model_name="smollm2-135m"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genback.registry import resolve

    path = resolve(model_name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, AutoTokenizer.from_pretrained(path)


def weights_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    """Peak resident set (``VmHWM``) since :func:`current_rss` last reset it, bytes."""
    return _status("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """This process's resident set now (``VmRSS``), bytes; resets the peak (``VmHWM``) to it,
    so the peak reported later is that of the queries, not of loading the model (Linux's
    ``/proc/self/clear_refs``, value 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def errors(model, rows, contexts):
    worst = 0.0
    with torch.inference_mode():
        for row, ctx in zip(rows, contexts):
            ref = torch.log_softmax(model(torch.tensor([ctx])).logits[0, -1].float(), -1)
            worst = max(worst, float((row - ref).abs().max()))
    return worst


# -- systems (each in its own process) ----------------------------------------------------------

def run_genback(args):
    from genback.llm import AsyncTransformer

    _, model, tok = load()
    loaded = current_rss()
    lm = AsyncTransformer(model, tok)
    prompt = prompt_ids(tok, args.prompt)
    gen = torch.Generator().manual_seed(args.seed)
    trace, step_times, step_read = [], [], []

    async def smc():
        parts = [list(prompt) for _ in range(args.particles)]
        query_time = 0.0
        for step in range(args.steps + 1):
            before = lm.cache_info()["kv_bytes_read"]
            t = time.perf_counter()
            rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in parts))
            dt = time.perf_counter() - t
            query_time += dt
            if step == 0:  # the prompt's prefill
                prefill = dt
            else:
                step_times.append(dt)
                step_read.append(lm.cache_info()["kv_bytes_read"] - before)
            if step == args.steps:
                return query_time, prefill, rows, parts
            trace.append([list(p) for p in parts]) if step else None
            probs = torch.exp(torch.stack(rows))
            nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
            logw = torch.stack(rows).gather(1, nxt[:, None])[:, 0]
            parts = [p + [int(t)] for p, t in zip(parts, nxt)]
            if (step + 1) % args.resample == 0:
                idx = torch.multinomial(torch.softmax(logw, 0), args.particles, replacement=True,
                                        generator=gen)
                parts = [list(parts[i]) for i in idx.tolist()]

    wall, prefill, rows, last = asyncio.run(smc())
    trace.append(last)
    info = lm.cache_info()
    out = dict(wall=wall, prefill=prefill, steps=step_times, read=step_read,
               tokens=info["tokens_forwarded"], decode_tokens=info["tokens_forwarded"] - len(prompt),
               kv_bytes=info["kv_bytes"],
               forwards=info["forwards"], rss=peak_rss(), rss_loaded=loaded,
               weights=weights_bytes(model),
               err=errors(model, rows[:2], last[:2]), prompt=prompt)
    lm.close()
    return out, trace


def run_hand(args, trace, prompt):
    """Plain transformers over per-particle KV, each step's distinct contexts only."""
    from transformers import DynamicCache

    _, model, _ = load()
    loaded = current_rss()
    start = time.perf_counter()
    step_times, step_read, tokens = [], [], len(prompt)
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        cache = out.past_key_values
        prefill = time.perf_counter() - start
        rows_of = {tuple(prompt): 0}  # context -> row in ``cache``
        for contexts in trace:
            t = time.perf_counter()
            distinct = list(dict.fromkeys(tuple(c) for c in contexts))
            parent = torch.tensor([rows_of[c[:-1]] for c in distinct])
            layers = [(layer.keys.index_select(0, parent), layer.values.index_select(0, parent))
                      for layer in cache.layers]
            cache = DynamicCache()
            for i, (k, v) in enumerate(layers):
                cache.update(k, v, i)
            del layers
            past = cache.get_seq_length()
            nxt = torch.tensor([[c[-1]] for c in distinct])
            out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            rows = torch.log_softmax(out.logits[:, -1].float(), -1)
            rows_of = {c: i for i, c in enumerate(distinct)}
            step_times.append(time.perf_counter() - t)
            tok_bytes = sum(2 * lay.keys[0, :, 0].numel() * lay.keys.element_size()
                            for lay in cache.layers)
            step_read.append(len(distinct) * past * tok_bytes)
            tokens += len(distinct)
    wall = time.perf_counter() - start
    last = [rows[rows_of[tuple(c)]] for c in trace[-1][:2]]
    return dict(wall=wall, prefill=prefill, steps=step_times, read=step_read, tokens=tokens,
                decode_tokens=tokens - len(prompt),
                rss=peak_rss(), rss_loaded=loaded, weights=weights_bytes(model),
                err=errors(model, last, trace[-1][:2]))


def run_genlm(args, trace, prompt):
    from genlm.backend.llm import AsyncTransformer as GenlmTransformer

    path, model, _ = load()
    lm = GenlmTransformer.from_name(path, hf_opts={"device_map": None, "dtype": torch.float32})

    async def replay():
        await lm.next_token_logprobs(prompt)
        rows = None
        for contexts in trace:
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        return rows

    start = time.perf_counter()
    rows = asyncio.run(replay())
    wall = time.perf_counter() - start
    return dict(wall=wall, rss=peak_rss(), weights=weights_bytes(model),
                err=errors(model, rows[:2], trace[-1][:2]))


def child(args):
    torch.set_num_threads(1)
    if args.system == "genback":
        out, trace = run_genback(args)
        with open(args.trace, "w") as f:
            json.dump(trace, f)
    else:
        with open(args.trace) as f:
            trace = json.load(f)
        _, _, tok = load()
        prompt = prompt_ids(tok, args.prompt)
        out = (run_hand if args.system == "hand" else run_genlm)(args, trace, prompt)
    print("RESULT " + json.dumps(out))


# -- the grid ---------------------------------------------------------------------------------

def spawn(system, particles, prompt, args, trace_path):
    cmd = [sys.executable, __file__, "--child", system, "--trace", trace_path,
           "--steps", str(args.steps), "--resample", str(args.resample), "--seed", str(args.seed),
           "--particles", str(particles), "--prompts", str(prompt)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{system} failed:\n{proc.stderr[-3000:]}")


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def decode_flops(trace_path, n_params: int) -> float:
    """Floating-point operations of the decode steps of a trace (each step's distinct contexts,
    one new token each): ``2 * params`` per token for the matrix products (the tied embedding
    is the LM head) plus ``4 * layers * heads * head_dim * context`` for attention (QK^T and PV),
    the count gpt-fast and the PaLM paper's appendix B use."""
    from transformers import AutoConfig

    from genback.registry import resolve

    c = AutoConfig.from_pretrained(resolve("smollm2-135m"))
    attn = 4 * c.num_hidden_layers * c.num_attention_heads * (c.hidden_size // c.num_attention_heads)
    with open(trace_path) as f:
        trace = json.load(f)
    flops = 0.0
    for contexts in trace:
        distinct = {tuple(ctx) for ctx in contexts}
        flops += 2 * n_params * len(distinct) + attn * sum(len(ctx) for ctx in distinct)
    return flops


def decode_stats(r):
    steps = sum(r["steps"])
    bandwidth = (len(r["steps"]) * r["weights"] + sum(r["read"])) / steps
    return steps, bandwidth


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--prompts", type=int, nargs="+", default=[100, 1000, 4000])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--resample", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=["genback", "hand", "genlm"])
    parser.add_argument("--trace")
    args = parser.parse_args()
    if args.child:
        args.system, args.particles, args.prompt = args.child, args.particles[0], args.prompts[0]
        return child(args)

    kv_token = 30 * 2 * 3 * 64 * 4  # SmolLM2 fp32 KV bytes per token
    print(f"{'N':>4} {'P':>5} {'system':<10} {'wall s':>8} {'vs hand':>8} {'prefill':>7} "
          f"{'decode':>7} {'decode tok/s':>12} "
          f"{'GB/s':>6} {'GFLOP/s':>7} {'peak RSS GB':>11} {'loaded GB':>9} {'tree KV GB':>10} "
          f"{'max err':>9}")
    for P in args.prompts:
        for N in args.particles:
            with tempfile.TemporaryDirectory() as tmp:
                trace_path = os.path.join(tmp, "trace.json")
                g = spawn("genback", N, P, args, trace_path)
                flops = decode_flops(trace_path, g["weights"] // 4)
                need = 2 * N * (P + args.steps) * kv_token
                h = None
                if need < 0.6 * available_bytes():
                    h = spawn("hand", N, P, args, trace_path)
                rows = [("genback", g), ("hand", h)]
                if N == min(args.particles) and P == min(args.prompts):
                    try:
                        rows.append(("genlm", spawn("genlm", N, P, args, trace_path)))
                    except RuntimeError as exc:
                        print(f"genlm-backend skipped: {str(exc).splitlines()[-1]}")
            for name, r in rows:
                if r is None:
                    print(f"{N:>4} {P:>5} {name:<10} {'cannot fit: per-particle KV needs':>30} "
                          f"{need / 1e9:.1f} GB")
                    continue
                ratio = f"{r['wall'] / h['wall']:.2f}x" if h else "-"
                if "steps" in r:
                    steps, bw = decode_stats(r)
                    times = f"{r['prefill']:>7.2f} {steps:>7.2f}"
                    tps = f"{r['decode_tokens'] / steps:.0f}"
                    bws = f"{bw / 1e9:.1f}"
                    gfs = f"{flops / steps / 1e9:.1f}"
                else:
                    tps = bws = gfs = "-"
                    times = f"{'-':>7} {'-':>7}"
                kv = f"{r['kv_bytes'] / 1e9:.3f}" if "kv_bytes" in r else "-"
                loaded = f"{r['rss_loaded'] / 1e9:.2f}" if "rss_loaded" in r else "-"
                print(f"{N:>4} {P:>5} {name:<10} {r['wall']:>8.2f} {ratio:>8} {times} {tps:>12} {bws:>6} "
                      f"{gfs:>7} {r['rss'] / 1e9:>11.2f} {loaded:>9} {kv:>10} {r['err']:>9.1e}",
                      flush=True)


if __name__ == "__main__":
    main()
