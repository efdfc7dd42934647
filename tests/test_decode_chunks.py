"""Decode steps too wide for one forward (genback.llm.hf.decode.step.DecodeStep.layouts):
run in chunks of rows, eagerly on the CPU, against the tree path and uncached forwards; the
chunks kept from step to step (layouts counted); the fallback to the tree path."""

from __future__ import annotations

import random

import pytest
import torch

from genback.llm import AsyncTransformer
from genback.llm.hf.decode.step import MAX_ROWS

from test_llm_tree import _max_err


def _wide_step(lm, prompt, parts):
    """Cache ``prompt`` and each part's context but its last token, then ask every part at once
    (one uniform step); the rows and the counters that step moved."""
    lm.cache_kv(prompt)
    lm.batch_next_token_logprobs_sync([p[:-1] for p in parts])
    return _step(lm, parts)


def _step(lm, parts):
    before = dict(lm.cache_info())
    rows = lm.batch_next_token_logprobs_sync(parts)
    after = lm.cache_info()
    moved = {k: after[k] - before[k] for k in ("forwards", "tokens_forwarded", "decode_steps",
                                               "decode_split_steps") if k in after}
    assert after["kv_pool_slots_used"] * lm.runner.pool.token_bytes == after["kv_bytes"]
    return rows, moved  # (a [len(parts), V] tensor)


@pytest.mark.parametrize("rows,own", [(256, 300), (MAX_ROWS + 1, 2)])
def test_steps_too_wide_for_one_forward_run_in_chunks_of_rows(tiny_hf, gpt2_tok, rows, own):
    """At the default limits: 256 rows whose own pasts (after the prompt they share) are 300
    tokens fill 256 x 512 table slots, more than one forward of the step takes
    (MAX_TABLE_SLOTS), and more rows than MAX_ROWS do not fit either: the step runs as two
    chunks of rows (two forwards, counted), each row equal to the tree path's and to an
    uncached forward, no pool slot lost; and so is the next step (laid out again)."""
    rng = random.Random(rows)
    prompt = [300 + rng.randrange(400) for _ in range(40)]
    parts = [prompt + [i % 400 + 100, i // 400 + 100]
             + [100 + rng.randrange(400) for _ in range(own - 1)] for i in range(rows)]
    got = {}
    for decode in ("eager", "off"):
        lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.2, row_cache_size=0,
                              decode=decode)
        try:
            got[decode] = _wide_step(lm, prompt, parts)
            got[decode + " next"] = _step(lm, [p + [7] for p in parts])
            if decode == "eager":
                assert _max_err(got[decode][0][::max(1, rows // 6)], parts[::max(1, rows // 6)],
                                lm) <= 1e-5
        finally:
            lm.close()
    assert got["eager"][1] == {"forwards": 2, "tokens_forwarded": rows, "decode_steps": 2,
                               "decode_split_steps": 1}
    assert got["off"][1] == {"forwards": 1, "tokens_forwarded": rows}
    assert got["eager next"][1] == got["eager"][1] and got["off next"][1] == got["off"][1]
    for step in ("", " next"):
        torch.testing.assert_close(got["eager" + step][0], got["off" + step][0], rtol=0,
                                   atol=1e-5)


def test_a_split_run_keeps_its_chunks_and_tries_the_whole_every_refresh(tiny_hf, gpt2_tok,
                                                                       monkeypatch):
    """Table limit lowered to 256 slots, 8 rows of ~100 own tokens growing a token a step: the
    first step tries the whole, halves, then quarters (6 layouts); the next steps lay out their
    quarters at once (4 layouts, from the last step's chunks: lane steps counted) until
    REFRESH steps have passed, when the whole is tried again; every row stays exact."""
    from genback.llm.hf.decode import step as decode_step
    from genback.llm.hf.plan.lanes import REFRESH

    monkeypatch.setattr(decode_step, "MAX_TABLE_SLOTS", 256)
    calls = []
    layout = decode_step.DecodeStep.layout

    def counted(self, group, lanes=None):
        calls[-1] += 1
        return layout(self, group, lanes)

    monkeypatch.setattr(decode_step.DecodeStep, "layout", counted)
    rng = random.Random(9)
    prompt = [300 + rng.randrange(400) for _ in range(20)]
    parts = [prompt + [100 + i] + [100 + rng.randrange(400) for _ in range(98)]
             for i in range(8)]
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.2, row_cache_size=0,
                          decode="eager")
    try:
        lm.cache_kv(prompt)
        lm.batch_next_token_logprobs_sync(parts)
        for _ in range(REFRESH + 2):
            parts = [p + [100 + rng.randrange(400)] for p in parts]
            calls.append(0)
            rows = lm.batch_next_token_logprobs_sync(parts)
            assert _max_err(rows, parts, lm) <= 1e-5
        info = lm.cache_info()
        assert calls == [6] + [4] * (REFRESH - 1) + [6, 4], calls
        assert info["decode_split_steps"] == REFRESH + 2
        assert info["decode_steps"] == 4 * (REFRESH + 2) and info["decode_lane_steps"] >= REFRESH
    finally:
        lm.close()


def test_a_step_split_at_most_into_quarters_then_takes_the_tree_path(tiny_hf, gpt2_tok,
                                                                     monkeypatch):
    """With the table limit lowered to 256 slots: 8 rows of 100 own tokens (8 x 128) run as
    four chunks of two rows; 4 rows of 50 then 4 of 300 (the first half fits, 4 x 64; the
    second's quarters do not, 2 x 512) take the tree path, no slot taken for the half that did
    fit is lost, and the rows stay exact."""
    from genback.llm.hf.decode import step as decode_step

    monkeypatch.setattr(decode_step, "MAX_TABLE_SLOTS", 256)
    rng = random.Random(8)
    prompt = [300 + rng.randrange(400) for _ in range(20)]
    for own, want in [([100] * 8, {"forwards": 4, "decode_steps": 4, "decode_split_steps": 1}),
                      ([50] * 4 + [300] * 4,
                       {"forwards": 1, "decode_steps": 0, "decode_split_steps": 0})]:
        parts = [prompt + [100 + i] + [100 + rng.randrange(400) for _ in range(n - 1)]
                 for i, n in enumerate(own)]
        lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.2, row_cache_size=0,
                              decode="eager")
        try:
            rows, moved = _wide_step(lm, prompt, parts)
            assert moved == dict(want, tokens_forwarded=8)
            assert _max_err(rows, parts, lm) <= 1e-5
        finally:
            lm.close()
