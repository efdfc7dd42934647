"""mkdocs hook: a picture of the KV tree an SMC run leaves, drawn at build time.

At build time this hook runs a small sequential Monte Carlo sampler on the embedded model
(SmolLM2-135M, CPU: 8 particles, 8 steps, multinomial resampling every 3 steps on the sampled
tokens' probabilities, seeded), draws ``AsyncTransformer.visualize_cache()`` and puts it in place
of ``<!-- kv-tree-picture -->`` on the SMC guide: an SVG rendered with Graphviz's ``dot`` when it
is installed (``.ci/run`` installs it), else the Graphviz source, said so on the page. Nothing is
drawn by hand: the picture is what this version of genback leaves in its tree.

Also usable alone: ``python docs/hooks/kv_tree.py OUT.gv`` writes the source.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- kv-tree-picture -->"
IMAGE = "img/kv-tree.svg"

log = logging.getLogger("mkdocs.hooks.kv_tree")
_state: dict = {}


def smc_picture(particles: int = 8, steps: int = 8, resample: int = 3, seed: int = 0):
    """The KV tree's picture after a seeded SMC run on the embedded model (graphviz.Digraph)."""
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch

    from genback.llm import AsyncTransformer

    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    lm = AsyncTransformer.from_name("smollm2-135m")
    prompt = lm.tokenizer.encode("Once upon a time, in a small village by the sea,")
    lm.cache_kv(prompt)

    async def run():
        parts = [list(prompt) for _ in range(particles)]
        for step in range(steps):
            rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in parts))
            probs = [torch.softmax(r.float(), -1).numpy().astype(np.float64) for r in rows]
            tokens = [int(rng.choice(len(p), p=p / p.sum())) for p in probs]
            weights = np.array([p[t] for p, t in zip(probs, tokens)])
            parts = [p + [t] for p, t in zip(parts, tokens)]
            if (step + 1) % resample == 0:
                pick = rng.choice(particles, size=particles, p=weights / weights.sum())
                parts = [list(parts[i]) for i in pick]
        await asyncio.gather(*(lm.next_token_logprobs(p) for p in parts))

    try:
        asyncio.run(run())
        return lm.visualize_cache(max_nodes=80)
    finally:
        lm.close()


def on_files(files, config):
    from mkdocs.structure.files import File

    picture = smc_picture()
    picture.attr(rankdir="TB")  # (after draw's LR: the last one holds) fits the content column better
    _state["source"] = picture.source
    _state["svg"] = None
    if shutil.which("dot") is not None:
        _state["svg"] = picture.pipe(format="svg")
        files.append(File.generated(config, IMAGE, content=_state["svg"]))
    else:
        log.info("kv_tree: Graphviz's dot is not installed; the SMC guide shows the source")
    return files


def on_page_markdown(text, page, config, files):
    if MARKER not in text:
        return text
    if _state.get("svg"):
        depth = page.file.src_uri.count("/")
        path = f"{'../' * depth}{IMAGE}"
        block = f"[![The KV tree after an SMC run]({path})]({path})"  # click: the picture alone
    else:
        block = ("Graphviz's `dot` was not installed when this page was built, so here is the "
                 "picture's Graphviz source (paste it into any Graphviz viewer):\n\n"
                 "```dot\n" + _state.get("source", "") + "```")
    return text.replace(MARKER, block)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "kv-tree.gv")
    out.write_text(smc_picture().source)
    print(f"wrote {out}")
