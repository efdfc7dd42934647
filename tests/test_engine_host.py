"""The engine's host path (issue 66, item 3): token-id checks in C with the per-id check's
errors, lm-eval's own ids scored without re-checks (``GenbackSession.loglikelihood_tokens``),
lm-eval pairs encoded once per distinct text in batched tokenizer calls (``encode_pairs``), and
``benchmarks/bench_lmeval_gpu.py`` at its tiny shape on the CPU.

References: the per-request path (``encode_pair``, ``loglikelihood`` with id requests) and an
uncached forward. Work is counted (``cache_info()``), never timed.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from genback.engine import GenbackEngine, LoglikelihoodRequest
from genback.engine.checks import token_ids
from genback.engine.encoding import encode_pair, encode_pairs, prefix_token_id
from genback.llm import AsyncTransformer

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def brute(model, ctx, cont):
    with torch.inference_mode():
        logits = model(torch.tensor([ctx + cont]), use_cache=False).logits[0].float()
    rows = torch.log_softmax(logits, -1)[len(ctx) - 1: len(ctx) + len(cont) - 1]
    target = torch.tensor(cont)
    return float(rows.gather(1, target[:, None])[:, 0].double().sum()), bool(
        (rows.argmax(-1) == target).all())


def test_token_ids_takes_exact_ints_whole_and_names_the_first_bad_item():
    assert token_ids([3, 0, 7], "ids") == [3, 0, 7] and token_ids((1, 2), "ids") == [1, 2]
    assert token_ids([], "ids") == [] and token_ids(None, "ids") is None
    assert token_ids(np.array([4, 5], dtype=np.int32), "ids") == [4, 5]
    assert token_ids([np.int64(2), 3], "ids") == [2, 3]  # (NumPy ints: the per-id path)
    out = token_ids(ids := [1, 2], "ids")
    assert out == ids and out is not ids  # (a copy: the caller's list is not kept)
    for bad, kind, message in [
        ([1, True], TypeError, r"ids\[1\] must be an int token id, got bool: True"),
        ([1, 2.0], TypeError, r"ids\[1\] must be an int token id, got float: 2.0"),
        ([5, -1], ValueError, r"ids\[1\] must be a token id >= 0, got -1"),
        (np.array([1, -2]), ValueError, r"ids\[1\] must be a token id >= 0, got -2"),
        (np.array([1.0]), TypeError, r"ids\[0\] must be an int token id"),
        ("abc", TypeError, "ids must be a list of int token ids, got str"),
        (7, TypeError, "ids must be a list of int token ids, got int: 7"),
    ]:
        with pytest.raises(kind, match=message):
            token_ids(bad, "ids")


@pytest.mark.parametrize("which", ["gpt2", "smollm2"])
def test_encode_pairs_equals_encode_pair_pair_by_pair(which, gpt2_tok, smol_hf):
    tok = gpt2_tok if which == "gpt2" else smol_hf[1]
    prefix = tok.decode(prefix_token_id(tok))
    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " London"),
             ("The capital of France is ", "Paris"), ("", "Hello world"), ("", prefix + " Hi"),
             (prefix + "Question: 2+2=?\nAnswer:", " 4"), ("Température  ", " élevée"),
             ("日本の首都は", "東京です"), ("The capital of France is", " Paris")]
    assert encode_pairs(tok, pairs) == [encode_pair(tok, c, x) for c, x in pairs]
    assert encode_pairs(tok, []) == []


def test_loglikelihood_tokens_equals_the_checked_path_and_brute_force(tiny_hf, gpt2_tok):
    texts = [("Bright stars shine over", " the quiet harbour"), ("Seven ducks", " swam"),
             ("Seven ducks", " flew away"), ("", "Hello there")]
    pairs = [encode_pair(gpt2_tok, c, x) for c, x in texts]
    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    with GenbackEngine(lm=lm).build() as s:
        fast = s.loglikelihood_tokens([(list(c), list(x)) for c, x in pairs])
        info_fast = lm.cache_info()
        lm.clear_cache()
        lm.clear_kv_cache()
        checked = s.loglikelihood([LoglikelihoodRequest(context_input_ids=c,
                                                        continuation_input_ids=x)
                                   for c, x in pairs])
        info = lm.cache_info()
        # an empty context scores from the prefix token, as the checked path does
        empty = s.loglikelihood_tokens([([], pairs[1][1])])[0]
    lm.close()
    assert info["forwards"] - info_fast["forwards"] == info_fast["forwards"]
    for (ctx, cont), a, b in zip(pairs, fast, checked):
        assert (a.logprob, a.is_greedy, a.token_count) == (b.logprob, b.is_greedy, b.token_count)
        ref, greedy = brute(tiny_hf, ctx, cont)
        assert a.logprob == pytest.approx(ref, abs=1e-4) and a.is_greedy == greedy
    ref, _ = brute(tiny_hf, [prefix_token_id(gpt2_tok)], pairs[1][1])
    assert empty.logprob == pytest.approx(ref, abs=1e-4)


def test_loglikelihood_tokens_bad_pairs_fail_alone(tiny_hf, gpt2_tok):
    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    good = encode_pair(gpt2_tok, "Seven ducks", " swam")
    with GenbackEngine(lm=lm).build() as s:
        outs = s.loglikelihood_tokens([good, ([1, 2], [len(gpt2_tok) + 5]), ([1, 2], []), good])
    with GenbackEngine(lm=lm, errors="raise").build() as s:
        with pytest.raises(ValueError, match=r"continuation_ids\[0\] = 50262 is outside"):
            s.loglikelihood_tokens([good, ([1, 2], [len(gpt2_tok) + 5])])
    lm.close()
    assert outs[0].logprob == outs[3].logprob > -math.inf and "error" not in outs[0].metadata
    assert "continuation_ids[0] = 50262 is outside the vocabulary" in outs[1].metadata["error"]
    assert "continuation_input_ids is empty" in outs[2].metadata["error"]
    assert all(o.logprob == -math.inf and o.token_count == 0 for o in outs[1:3])


def test_bench_lmeval_gpu_runs_every_mix_on_the_tiny_shape():
    """The benchmark's four mixes through HFLM and GenbackLM at the tiny shape on the CPU:
    both answer every request and agree (fp32); genback's work is counted."""
    sys.path.insert(0, str(BENCH))
    import bench_lmeval_gpu

    out = bench_lmeval_gpu.main(["--shape", "tiny", "--device", "cpu", "--questions", "2",
                                 "--pairs", "3", "--texts", "1", "--prompts", "2",
                                 "--max-gen-toks", "4", "--hf-batch-size", "4"])
    assert out["dtype"] == "torch.float32" and out["model"] == "tiny"
    mixes = out["mixes"]
    assert [mixes[m]["requests"] for m in bench_lmeval_gpu.MIXES] == [8, 3, 1, 2]
    for mix, r in mixes.items():
        assert r["forwards"] >= 1 and r["padded_tokens_forwarded"] >= r["tokens_forwarded"] > 0
        a = r["agreement"]
        assert a.get("greedy_equal", a["of"]) == a["of"] and a.get("outputs_equal", a["of"]) == a["of"]
        assert a.get("max_abs_dlogprob", 0.0) <= 1e-3, (mix, a)


def test_profile_lmeval_splits_genback_s_cpu_by_thread():
    """``benchmarks/lab/profile_lmeval.py`` (the GPU session's ``profile`` part) at the tiny
    shape on the CPU: each mix's CPU is put on genback's own threads (the engine's loop thread,
    which runs the batches inline here, or the batcher's worker), not left unattributed, and the
    thread that ran the forwards lists the model's forward among its functions."""
    sys.path.insert(0, str(BENCH / "lab"))
    import profile_lmeval

    out = profile_lmeval.main(["--shape", "tiny", "--device", "cpu", "--mixes", "pairs,rolling",
                               "--pairs", "3", "--texts", "1", "--top", "5"])
    assert [(m, r["requests"]) for m, r in out.items()] == [("pairs", 3), ("rolling", 1)]
    for mix, r in out.items():
        cpu = r["cpu"]
        ours = cpu.get("loop", 0.0) + cpu.get("worker", 0.0)
        assert ours >= 0.5 * sum(cpu.values()) and ours > 0, (mix, cpu)
        assert r["profiled_wall"] > 0 and r["wall"] > 0
        ran = [fn for role in ("loop", "worker") for _, _, fn in r["top"].get(role, [])]
        assert any(fn.startswith("HFRunner._forward ") for fn in ran), (mix, ran[:10])
