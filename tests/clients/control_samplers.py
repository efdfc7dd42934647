"""genlm-control 0.4.1 client program: trie token samplers and AWRS under a regular expression.

A ``PromptedLLM`` over the model is constrained by ``BoolFSA.from_regex`` (a byte-level regular
expression). Three samplers run SMC on it, each after seeding every RNG the same way:

* ``eager_token_sampler(llm, fsa)`` (``EagerSetSampler``: ``await trie.weight_sum`` on the
  async trie, then a walk down ``trie.children`` with ``(None, i)`` leaf edges);
* ``topk_token_sampler(llm, fsa, K)`` (``TopKSetSampler``: ``await trie.weight_max``);
* ``AWRS(llm, fsa.coerce(llm, f=b"".join), seed=...)`` (adaptive weighted rejection sampling).

Prints ``RESULT {...}`` with, per sampler, the decoded particles, their log-weights and the SMC
log-marginal-likelihood estimate ``log_ml``.
"""

from __future__ import annotations

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

PROMPT = "<|im_start|>user\nName two animals.<|im_end|>\n<|im_start|>assistant\n"
REGEX = r"(The )?(cat|dog|fish|bird|horse|cow|lion)s? (and|or|with) (a )?(cat|dog|fish|bird|horse|cow|lion)s?\."
N_PARTICLES = 4
MAX_TOKENS = 10
TOPK = 3
SEED = 7


def _decode(context) -> str:
    out = []
    for tok in context:
        if isinstance(tok, (bytes, bytearray)):
            out.append(bytes(tok).decode("utf-8", errors="replace"))
        else:  # genlm-control's EOS / EOT sentinels
            out.append(f"<{tok}>")
    return "".join(out)


def _summary(seqs) -> dict:
    import numpy as np

    weights = [float(w) for w in np.asarray(seqs.log_weights, dtype=float)]
    return {
        "texts": [_decode(c) for c in seqs.contexts],
        "log_weights": weights,
        "log_ml": float(seqs.log_ml),
    }


def main():
    args = _common.setup(__doc__.splitlines()[0])
    with _common.phase(args, "import"):
        from genlm.control import AWRS, BoolFSA, PromptedLLM, eager_token_sampler, topk_token_sampler
    with _common.phase(args, "load"):
        llm = PromptedLLM(_common.load_lm())
        llm.set_prompt_from_str(PROMPT)
        fsa = BoolFSA.from_regex(REGEX)

    async def run(make_sampler):
        sampler = make_sampler()
        try:
            seqs = await sampler.smc(
                n_particles=N_PARTICLES * args.scale, ess_threshold=0.5, max_tokens=MAX_TOKENS
            )
        finally:
            await sampler.cleanup()
        return _summary(seqs)

    samplers = {
        "eager": lambda: eager_token_sampler(llm, fsa),
        "topk": lambda: topk_token_sampler(llm, fsa, K=TOPK),
        "awrs": lambda: AWRS(llm, fsa.coerce(llm, f=b"".join), seed=SEED),
    }
    results = {}
    for name, make in samplers.items():
        _common.seed_all(SEED)
        with _common.phase(args, name):
            results[name] = asyncio.run(run(make))
    _common.emit(args, {
        "program": "control_samplers",
        "regex": REGEX,
        "n_particles": N_PARTICLES * args.scale,
        "max_tokens": MAX_TOKENS,
        "samplers": results,
    })


if __name__ == "__main__":
    main()
