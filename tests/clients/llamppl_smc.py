"""llamppl 0.2.3 client program: SMC with a token-mask constraint, a cached prompt, two event loops.

A lipogram model: each step first observes that the next token contains no letter "e"
(``LMContext.mask_dist``, which weights the particle by that mask's probability), then samples
the token from the masked next-token distribution. The prompt's KV is pinned with
``CachedCausalLM.cache_kv`` and the model's ``LMContext`` is built (with the synchronous
``next_token_logprobs_unbatched``) inside the running event loop; the model is loaded with
llamppl's ``CachedCausalLM.from_pretrained(path, backend="hf")``. ``smc_standard`` runs twice on
the same model object, each time in a fresh ``asyncio.run`` loop with the same seeds.

Prints ``RESULT {...}`` with, per run, the particles' texts, token ids, weights and the
log-marginal-likelihood estimate ``logsumexp(weights) - log(n_particles)``.
"""

from __future__ import annotations

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

PROMPT = "<|im_start|>user\nWrite one short sentence about the sea.<|im_end|>\n<|im_start|>assistant\n"
N_PARTICLES = 4
MAX_TOKENS = 6
SEED = 1234


def main():
    args = _common.setup(__doc__.splitlines()[0])
    with _common.phase(args, "import"):
        import numpy as np
        from llamppl import CachedCausalLM, LMContext, Model, smc_standard
        from scipy.special import logsumexp
    n_particles, max_tokens = N_PARTICLES * args.scale, MAX_TOKENS * args.scale
    with _common.phase(args, "load"):
        # llamppl's own loader: backend "hf" -> genlm.backend.llm.AsyncTransformer.from_name(path)
        lm = CachedCausalLM.from_pretrained(_common.model_path(), backend="hf")
        no_e = {i for i, s in enumerate(lm.str_vocab) if "e" not in s.lower()}
        eos = lm.tokenizer.eos_token_id

    class Lipogram(Model):
        def __init__(self, lm, prompt):
            super().__init__()
            self.context = LMContext(lm, prompt)  # sync query, on the loop thread
            self.eos = lm.tokenizer.eos_token_id

        async def step(self):
            await self.observe(self.context.mask_dist(no_e), True)
            token = await self.sample(self.context.next_token())
            if token.token_id == self.eos or self.context.token_count >= max_tokens:
                self.finish()

    async def run_once():
        model = Lipogram(lm, PROMPT)
        particles = await smc_standard(model, n_particles, ess_threshold=0.5)
        weights = [float(p.weight) for p in particles]
        return {
            "texts": [str(p.context) for p in particles],
            "tokens": [p.context.tokens[p.context.prompt_token_count:] for p in particles],
            "weights": weights,
            "log_ml": float(logsumexp(weights) - np.log(len(weights))),
        }

    with _common.phase(args, "cache_kv"):
        lm.cache_kv(lm.tokenizer.encode(PROMPT))
    runs = []
    for i in range(2):
        _common.seed_all(SEED)
        with _common.phase(args, f"smc_run{i}"):
            runs.append(asyncio.run(run_once()))
    _common.emit(args, {
        "program": "llamppl_smc",
        "n_particles": n_particles,
        "max_tokens": max_tokens,
        "eos": eos,
        "runs": runs,
    })


if __name__ == "__main__":
    main()
