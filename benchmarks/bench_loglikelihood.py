"""Evaluation throughput: genback's lm-eval model vs lm-eval's ``HFLM`` on four request mixes.

Both run the same lm-eval ``Instance`` objects on the same SmolLM2-135M weights (fp32, CPU, one
torch thread), side by side in one process: ``HFLM(batch_size=16)`` and ``GenbackLM`` (the
lm-eval model ``"genback"``) over an ``AsyncTransformer``. The requests are written by the
script from ``tests/data/engine/passage.txt`` (deterministic for a seed):

* ``multiple_choice``: ``--questions`` cloze questions, a context of ~48 words and 4 choices of
  4 words each (the true next words and spans from elsewhere), every choice its own
  ``loglikelihood`` request (choices share their context);
* ``pairs``: ``--pairs`` ``loglikelihood`` requests whose contexts are all different (20-200
  tokens) with continuations of 1-8 words;
* ``rolling``: ``--texts`` ``loglikelihood_rolling`` texts of 30-700 tokens;
* ``generate``: ``--prompts`` greedy ``generate_until`` requests, 24 new tokens, stop ``"\\n\\n"``.

Before every genback run its caches are cleared (a run never reuses another's KV); with
``--repeat N`` each mix runs N times, alternating the two systems, and each one's fastest time
is kept (the machines are shared: load comes and goes). The script checks
agreement — log-likelihoods within 1e-4, identical greedy flags, identical generations — and
prints one table (wall seconds, genback / HFLM) and genback's counted work.

    python benchmarks/bench_loglikelihood.py [--questions 32 --pairs 96 --texts 16 --prompts 32]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "engine" / "passage.txt"
MIXES = ("multiple_choice", "pairs", "rolling", "generate")


def _words():
    return TEXT.read_text().split()


def _span(words, rng, n):
    start = rng.randrange(0, len(words) - n)
    return " ".join(words[start:start + n])


def make_questions(n: int, n_choices: int = 4, context_words: int = 48, choice_words: int = 4,
                   seed: int = 0):
    """``[(context, [choice, ...], gold index)]`` cloze questions from the passage."""
    words = _words()
    rng = random.Random(seed)
    last = len(words) - context_words - choice_words
    out = []
    for _ in range(n):
        start = rng.randrange(0, last)
        ctx = " ".join(words[start: start + context_words])
        true = words[start + context_words: start + context_words + choice_words]
        choices = [" " + " ".join(true)]
        while len(choices) < n_choices:
            cand = " " + _span(words, rng, choice_words)
            if cand not in choices:
                choices.append(cand)
        order = list(range(n_choices))
        rng.shuffle(order)
        out.append((ctx, [choices[i] for i in order], order.index(0)))
    return out


def make_pairs(n: int, seed: int = 1):
    """``[(context, continuation)]`` with all-different contexts of 15-150 words (20-200 tokens)."""
    words, rng = _words(), random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        ctx = _span(words, rng, rng.randint(15, 150))
        if ctx in seen:
            continue
        seen.add(ctx)
        out.append((ctx, " " + _span(words, rng, rng.randint(1, 8))))
    return out


def make_texts(n: int, seed: int = 2):
    """Texts of 25-540 words (about 30-700 tokens)."""
    words, rng = _words(), random.Random(seed)
    return [_span(words, rng, rng.randint(25, 540)) for _ in range(n)]


def make_prompts(n: int, seed: int = 3):
    words, rng = _words(), random.Random(seed)
    return [_span(words, rng, rng.randint(20, 100)) for _ in range(n)]


def instances(mix: str, args):
    from lm_eval.api.instance import Instance

    if mix == "multiple_choice":
        qs = make_questions(args.questions)
        pairs = [(ctx, c) for ctx, choices, _ in qs for c in choices]
        return [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    if mix == "pairs":
        return [Instance("loglikelihood", {}, p, i) for i, p in enumerate(make_pairs(args.pairs))]
    if mix == "rolling":
        return [Instance("loglikelihood_rolling", {}, (t,), i)
                for i, t in enumerate(make_texts(args.texts))]
    gen = {"until": ["\n\n"], "max_gen_toks": 24, "do_sample": False}
    return [Instance("generate_until", {}, (p, dict(gen)), i)
            for i, p in enumerate(make_prompts(args.prompts))]


def run(model, mix: str, reqs):
    if mix in ("multiple_choice", "pairs"):
        return model.loglikelihood(reqs, disable_tqdm=True)
    if mix == "rolling":
        return model.loglikelihood_rolling(reqs, disable_tqdm=True)
    return model.generate_until(reqs, disable_tqdm=True)


def agreement(mix: str, ref, got, lengths) -> tuple[str, bool]:
    if mix in ("multiple_choice", "pairs"):
        diff = max(abs(r[0] - g[0]) for r, g in zip(ref, got))
        same = sum(r[1] == g[1] for r, g in zip(ref, got))
        ok = diff <= 1e-4 and same == len(ref)
        return f"max abs dlogprob {diff:.1e}, is_greedy equal {same}/{len(ref)}", ok
    if mix == "rolling":
        # a text's log-likelihood sums hundreds of fp32 token log-probs: HFLM's own padded
        # batches move it by ~1e-4 per 400 tokens against its unbatched forward, so the bound
        # is 1e-4 per 100 tokens scored
        diff = max(abs(r - g) for r, g in zip(ref, got))
        ok = all(abs(r - g) <= 1e-4 * max(1.0, n / 100) for r, g, n in zip(ref, got, lengths))
        return f"max abs dlogprob {diff:.1e} (within 1e-4 per 100 tokens: {ok})", ok
    same = sum(r == g for r, g in zip(ref, got))
    return f"generations equal {same}/{len(ref)}", same == len(ref)


class ForwardClock:
    """Time spent inside ``model``'s own forward calls (hooks on the top module: both systems
    call it), so that what is left is the host work around the forwards: encoding, checks,
    planning, padding, answering. Wall seconds, and CPU seconds (the forward's thread's; the
    process's for the whole call, every thread), which a loaded machine disturbs less. CPU
    only (no device synchronisation)."""

    def __init__(self, model):
        self.wall = self.cpu = 0.0
        self._t0 = self._c0 = None
        model.register_forward_pre_hook(self._start)
        model.register_forward_hook(self._stop)

    def _start(self, module, args):
        self._t0, self._c0 = time.perf_counter(), time.thread_time()

    def _stop(self, module, args, out):
        self.wall += time.perf_counter() - self._t0
        self.cpu += time.thread_time() - self._c0

    def timed(self, fn):
        """``(result, wall seconds, host wall seconds, host CPU seconds)`` of ``fn()``: host is
        the call's time less its forwards' time."""
        w0, c0 = self.wall, self.cpu
        t0, p0 = time.perf_counter(), time.process_time()
        result = fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - p0
        return result, wall, wall - (self.wall - w0), cpu - (self.cpu - c0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--questions", type=int, default=32, help="multiple-choice questions (x4)")
    p.add_argument("--pairs", type=int, default=96, help="loglikelihood pairs, all different")
    p.add_argument("--texts", type=int, default=16, help="loglikelihood_rolling texts")
    p.add_argument("--prompts", type=int, default=32, help="generate_until prompts")
    p.add_argument("--mixes", default=",".join(MIXES), help=f"comma list of {MIXES}")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1,
                   help="run each mix this many times, alternating HFLM and genback, and keep "
                        "each one's fastest time (a shared machine's load comes and goes)")
    p.add_argument("--model", default="smollm2-135m",
                   help="a genback model name, or 'tiny': tiny_lm.py's 2-layer random Llama over a "
                        "512-token BPE, whose forward costs little (what is left is host work)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    mixes = [m for m in args.mixes.split(",") if m]
    unknown = set(mixes) - set(MIXES)
    if unknown:
        p.error(f"--mixes: unknown {sorted(unknown)}; choose from {MIXES}")

    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genback.engine import GenbackLM
    from genback.llm import AsyncTransformer
    from genback.registry import resolve

    print("command: python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]))
    if args.model == "tiny":
        import tiny_lm

        model, tok = tiny_lm.load("tiny")
    else:
        path = resolve(args.model)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(path)
    hf = HFLM(pretrained=model, tokenizer=tok, batch_size=args.hf_batch_size, device="cpu")
    lm = AsyncTransformer(model, tok)
    gb = GenbackLM(lm=lm)
    clock = ForwardClock(model)
    print(f"torch threads {torch.get_num_threads()}; HFLM batch_size={args.hf_batch_size}")

    rows, all_ok = [], True
    for mix in mixes:
        reqs = instances(mix, args)
        t_hf = t_gb = h_hf = h_gb = c_hf = c_gb = float("inf")
        for _ in range(args.repeat):  # alternate the two; keep each one's fastest run
            ref, wall, host, cpu = clock.timed(lambda: run(hf, mix, reqs))
            t_hf, h_hf, c_hf = min(t_hf, wall), min(h_hf, host), min(c_hf, cpu)
            lm.clear_cache()
            lm.clear_kv_cache()
            before = lm.cache_info()
            got, wall, host, cpu = clock.timed(lambda: run(gb, mix, reqs))
            t_gb, h_gb, c_gb = min(t_gb, wall), min(h_gb, host), min(c_gb, cpu)
            info = lm.cache_info()
        lengths = [len(tok.encode(r.args[0])) for r in reqs]
        note, ok = agreement(mix, ref, got, lengths)
        all_ok &= ok
        work = (f"forwards {info['forwards'] - before['forwards']}, batches "
                f"{info['batches'] - before['batches']}, tokens forwarded "
                f"{info['tokens_forwarded'] - before['tokens_forwarded']} (padded "
                f"{info['padded_tokens_forwarded'] - before['padded_tokens_forwarded']})")
        rows.append((mix, len(reqs), t_hf, t_gb, note, work, h_hf, h_gb, c_hf, c_gb))
        print(f"{mix}: {len(reqs)} requests, HFLM {t_hf:.2f} s, genback {t_gb:.2f} s "
              f"({t_gb / t_hf:.2f}x); {note}; genback {work}", flush=True)
        print(f"{mix}: host time per request (wall minus the model's forwards): HFLM "
              f"{h_hf / len(reqs) * 1e6:.0f} us, genback {h_gb / len(reqs) * 1e6:.0f} us "
              f"({h_gb / h_hf:.2f}x); host CPU time per request: HFLM "
              f"{c_hf / len(reqs) * 1e6:.0f} us, genback {c_gb / len(reqs) * 1e6:.0f} us "
              f"({c_gb / c_hf:.2f}x)", flush=True)
    gb.close()

    print()
    print("| request mix | requests | HFLM s | genback s | genback / HFLM | host us/request, HFLM "
          "/ genback | agreement |")
    print("|---|---|---|---|---|---|---|")
    for mix, n, t_hf, t_gb, note, _, h_hf, h_gb, _, _ in rows:
        print(f"| {mix} | {n} | {t_hf:.2f} | {t_gb:.2f} | {t_gb / t_hf:.2f}x | "
              f"{h_hf / n * 1e6:.0f} / {h_gb / n * 1e6:.0f} ({h_gb / h_hf:.2f}x) | {note} |")
    t_hf = sum(r[2] for r in rows)
    t_gb = sum(r[3] for r in rows)
    h_hf, h_gb = sum(r[6] for r in rows), sum(r[7] for r in rows)
    print(f"| total | {sum(r[1] for r in rows)} | {t_hf:.2f} | {t_gb:.2f} | {t_gb / t_hf:.2f}x | "
          f"({h_gb / h_hf:.2f}x) | {'all agree' if all_ok else 'DISAGREEMENT'} |")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
