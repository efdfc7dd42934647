"""``benchmarks/bench_gpu.py`` at its tiny shape on the CPU: every cell is reported, both methods
ran, and genback's rows equal the hand-written loop's and an uncached forward's. No timing is
asserted (the numbers are only checked to be positive and finite)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_gpu  # noqa: E402
import gpu_models  # noqa: E402


def test_tiny_grid_reports_every_cell_exactly():
    out = bench_gpu.main(["--tiny", "--device", "cpu", "--particles", "3,8", "--prompts", "20,70",
                          "--steps", "5", "--resample", "2"])
    assert out["shape"] == "tiny" and out["dtype"] == "torch.float32"
    cells = out["cells"]
    assert sorted((c["particles"], c["prompt"]) for c in cells) == [(3, 20), (3, 70), (8, 20), (8, 70)]
    for c in cells:
        assert c["roofline_s"] == max(c["roofline_mem_s"], c["roofline_flop_s"]) > 0
        for name in ("genback", "loop"):
            r = c[name]
            assert r["particle_tokens_per_s"] > 0 and math.isfinite(r["step_s"])
            assert r["peak_bytes"] is None  # not measured on the CPU
            assert r["err_vs_uncached"] <= 1e-4, (name, c)
        assert c["err_genback_vs_loop"] <= 1e-4, c
        # every step of the same trace: one query per particle, all answered by genback
        assert c["genback"]["attention"].startswith("tree")
        assert 1 <= c["distinct_per_step"] <= c["particles"]


def test_trace_resamples_only_on_schedule_and_counts_the_tree():
    rng = np.random.default_rng(0)
    prompt, trace = bench_gpu.make_trace(rng, 10, 6, 7, 3, 1000)
    assert len(prompt) == 10 and len(trace) == 7
    for s, (parents, tokens) in enumerate(trace):
        if s % 3 or s == 0:
            assert (parents == np.arange(6)).all()
        assert tokens.shape == (6,) and tokens.min() >= 0 and tokens.max() < 1000
    stats = bench_gpu.tree_stats(10, trace)
    last = bench_gpu.contexts_at(prompt, trace, 6)
    # distinct contexts and distinct tree tokens, counted by brute force over the contexts
    assert stats[-1][0] == len({tuple(c) for c in last})
    suffixes = {tuple(c[10:k]) for c in last for k in range(11, len(c) + 1)}
    assert stats[-1][1] == 10 + len(suffixes)
    assert stats[-1][2] == 17


def test_real_shapes_match_their_published_sizes():
    """The configs give the published parameter counts (1.24 B and 8.03 B), checked without
    allocating the weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    for shape, billions in (("llama-3.2-1b", 1.24), ("llama-3.1-8b", 8.03)):
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**gpu_models.SHAPES[shape]))
        n = sum(p.numel() for p in model.parameters()) / 1e9
        assert abs(n - billions) < 0.01, (shape, n)


def test_bad_grid_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench_gpu.parse(["--tiny", "--steps", "0"])
