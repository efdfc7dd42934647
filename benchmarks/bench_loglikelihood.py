"""Multiple-choice log-likelihood throughput: genback's engine vs lm-eval's ``HFLM``.

Both score the same requests with the same SmolLM2-135M weights (fp32, CPU, one torch thread):
``--questions`` cloze questions written from ``tests/data/engine/passage.txt`` (a context of
``--context-words`` consecutive words, and ``--choices`` candidate continuations of
``--choice-words`` words: the true next words and spans from elsewhere in the text, as in
LAMBADA- or HellaSwag-style tasks). genback runs them through ``GenbackSession.loglikelihood`` (every
choice of a question reuses the context's KV from the prefix tree); lm-eval through
``HFLM.loglikelihood`` with ``--hf-batch-size``. Both compute ``is_greedy``. The script checks
that the two agree (max |difference| of the log-likelihoods) and prints requests per second.

    python benchmarks/bench_loglikelihood.py [--questions 200]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "engine" / "passage.txt"


def make_questions(n: int, n_choices: int, context_words: int, choice_words: int, seed: int = 0):
    """``[(context, [choice, ...], gold index)]`` from the passage (deterministic for a seed)."""
    words = TEXT.read_text().split()
    rng = random.Random(seed)
    last = len(words) - context_words - choice_words
    out = []
    for _ in range(n):
        start = rng.randrange(0, last)
        ctx = " ".join(words[start: start + context_words])
        true = words[start + context_words: start + context_words + choice_words]
        choices = [" " + " ".join(true)]
        while len(choices) < n_choices:
            s = rng.randrange(0, len(words) - choice_words)
            cand = " " + " ".join(words[s: s + choice_words])
            if cand not in choices:
                choices.append(cand)
        order = list(range(n_choices))
        rng.shuffle(order)
        out.append((ctx, [choices[i] for i in order], order.index(0)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--context-words", type=int, default=48)
    p.add_argument("--choice-words", type=int, default=4)
    p.add_argument("--hf-batch-size", type=int, default=8)
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genback.engine import GenbackEngine, LoglikelihoodRequest
    from genback.llm import AsyncTransformer
    from genback.registry import resolve

    print("command: python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]))
    path = resolve(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    questions = make_questions(args.questions, args.choices, args.context_words, args.choice_words)
    pairs = [(ctx, c) for ctx, choices, _ in questions for c in choices]
    ctx_tokens = sum(len(tok.encode(ctx)) for ctx, _, _ in questions) / len(questions)
    print(f"{len(questions)} questions x {args.choices} choices = {len(pairs)} requests; "
          f"context ~{ctx_tokens:.0f} tokens; torch threads {torch.get_num_threads()}")

    hf = HFLM(pretrained=model, tokenizer=tok, batch_size=args.hf_batch_size, device="cpu")
    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    t0 = time.perf_counter()
    ref = hf.loglikelihood(instances, disable_tqdm=True)
    t_hf = time.perf_counter() - t0

    lm = AsyncTransformer(model, tok)
    session = GenbackEngine(lm=lm).build()
    t0 = time.perf_counter()
    outs = session.loglikelihood([LoglikelihoodRequest(c, x) for c, x in pairs])
    t_gb = time.perf_counter() - t0
    info = lm.cache_info()
    session.close()

    diff = max(abs(r[0] - o.logprob) for r, o in zip(ref, outs))
    greedy_same = sum(r[1] == o.is_greedy for r, o in zip(ref, outs))
    acc = sum(max(range(args.choices), key=lambda j: outs[i * args.choices + j].logprob) == gold
              for i, (_, _, gold) in enumerate(questions)) / len(questions)
    print(f"lm-eval HFLM (batch_size={args.hf_batch_size}): {t_hf:8.2f} s  "
          f"{len(pairs) / t_hf:7.1f} requests/s")
    print(f"genback engine            : {t_gb:8.2f} s  {len(pairs) / t_gb:7.1f} requests/s")
    print(f"speed-up genback / HFLM   : {t_hf / t_gb:.2f}x")
    print(f"agreement: max |logprob diff| {diff:.2e}, is_greedy equal {greedy_same}/{len(pairs)}; "
          f"accuracy {acc:.3f}")
    print(f"genback: forwards {info['forwards']}, tokens forwarded {info['tokens_forwarded']} "
          f"(padded {info['padded_tokens_forwarded']}), tokens in all queries "
          f"{info['tokens_queried']}, batches {info['batches']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
