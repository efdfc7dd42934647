"""The KV tree's picture (AsyncTransformer.visualize_cache, genback sample --tree): its node and
token counts equal the tree's, live contexts are counted below each node, it is built without
Graphviz's dot program, and the command line writes it."""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import subprocess
import sys

import pytest

from genback.llm import AsyncTransformer
from genback.llm.hf.cache.picture import live_counts

from test_llm_tree import _smc_trace


def _counts(picture) -> dict:
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", picture.graph_attr["comment"])}


def test_picture_counts_equal_the_trees_after_an_smc_run(tiny_hf, gpt2_tok):
    """SMC over a pinned prompt with resampling: the picture's nodes and tokens are the tree's
    (every KV slot in use belongs to one drawn edge), the root counts every live context, the
    last step's contexts are among them, and the prompt's node is pinned (double border)."""
    trace = _smc_trace(random.Random(4), 40, 12, 9, 3, 30)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0)
    try:
        lm.cache_kv(trace[0][0][:-1])

        async def run():
            for contexts in trace:
                await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        asyncio.run(run())
        picture = lm.visualize_cache(max_nodes=10_000)
        c = _counts(picture)
        tree = lm.runner.tree
        assert c["nodes"] == c["drawn_nodes"] == len(tree)
        assert c["tokens"] == c["drawn_tokens"] == lm.cache_info()["kv_pool_slots_used"]
        live = sum(live_counts(tree).values())
        assert live >= len({tuple(x) for x in trace[-1]})
        root = re.search(r'\bn0 \[label="root\n(\d+) nodes, (\d+) tokens\n(\d+) live"',
                         picture.source)
        assert root and [int(g) for g in root.groups()] == [len(tree), c["tokens"], live]
        assert "peripheries=2" in picture.source  # the pinned prompt
        assert picture.source.count("->") == len(tree)  # one edge into every node
    finally:
        lm.close()


def test_picture_is_capped_and_checks_its_arguments(tiny_hf, gpt2_tok):
    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    try:
        empty = _counts(lm.visualize_cache())
        assert empty["nodes"] == empty["tokens"] == 0
        lm.batch_next_token_logprobs_sync([[5, 6, 7, i, i + 1] for i in range(10, 30)])
        capped = lm.visualize_cache(max_nodes=3)
        assert _counts(capped)["drawn_nodes"] == 3 and "more nodes" in capped.source
        for bad in (0, -1, 2.5, True):
            with pytest.raises(ValueError, match="max_nodes"):
                lm.visualize_cache(max_nodes=bad)
        with pytest.raises(ValueError):
            lm.visualize_cache(lora_name="nope")
    finally:
        lm.close()


def test_sample_writes_the_tree_picture(tmp_path, smol_lm):
    """``genback sample --tree FILE.gv`` writes Graphviz source after the run; a rendered format
    without the dot program, or an unknown suffix, is a usage error (exit 2) before any work."""
    out = tmp_path / "tree.gv"
    cmd = [sys.executable, "-m", "genback.cli", "sample", "Once upon a time", "--particles", "3",
           "--max-tokens", "4", "--tree", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().startswith("// KV tree\ndigraph") and "KV tree picture written" in proc.stdout
    bad = subprocess.run(cmd[:-1] + [str(tmp_path / "tree.txt")], capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode == 2 and "suffix must be" in bad.stderr
    if shutil.which("dot") is None:
        svg = subprocess.run(cmd[:-1] + [str(tmp_path / "tree.svg")], capture_output=True,
                             text=True, timeout=600)
        assert svg.returncode == 2 and "needs Graphviz's dot" in svg.stderr
