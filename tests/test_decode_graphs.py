"""The decode step's graphs check themselves (genback.llm.hf.decode.graphs): each bucket's
first replay is compared with the eager run of the same step. On the CPU the capture is replaced
by a stand-in that runs the real warm-up and returns a "graph" whose replay recomputes the step
and then corrupts its logits and the new tokens' KV (a miscompiled capture). On CUDA the real
capture's check is asserted by tests/test_decode_step.py (every bucket verified, none
rejected, graphs equal to the eager run and to uncached rows)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from genback.llm import AsyncTransformer
from genback.llm.hf.decode import graphs as graphs_module
from genback.llm.hf.decode.graphs import StepGraphs

from test_decode_step import _steps
from test_llm_tree import _smc_trace


class _Replay:
    """A captured graph's stand-in: each replay runs the step (``forward(buf)``), then adds
    ``noise`` to the real rows' logits and to the KV the step just wrote."""

    def __init__(self, buf, forward, noise: float):
        self.buf, self.forward, self.noise = buf, forward, noise

    def replay(self):
        self.forward(self.buf)
        if self.noise:
            self.buf.logits.add_(self.noise)
            for layer in self.buf.pool.store:  # [2, kv_heads, slots, head_dim]
                layer.index_add_(2, self.buf.new_slots,
                                 torch.full_like(layer.index_select(2, self.buf.new_slots),
                                                 self.noise))


def _stand_in(noise: float):
    def capture(self, buf, forward):
        forward(buf)  # the warm-up: the eager run of this step
        self.captures += 1
        return _Replay(buf, forward, noise)
    return capture


def _run(tiny_hf, gpt2_tok, monkeypatch, noise):
    monkeypatch.setattr(StepGraphs, "_capture", _stand_in(noise))
    trace = _smc_trace(random.Random(3), 40, 6, 10, 3, 50)
    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=0.05, row_cache_size=0,
                          decode="eager")
    lm.runner.decode_step.graphs.enabled = True  # (captures on the CPU: the stand-in's)
    lm.runner.decode_step.graphs.max_graph_bytes = 1 << 40
    try:
        lm.cache_kv(trace[0][0][:-1])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = _steps(lm, trace)
        worst = 0.0
        for contexts, got in zip(trace, rows):
            for j in (0, len(contexts) - 1):
                ref = lm.next_token_logprobs_uncached(contexts[j]).float()
                worst = max(worst, float((got[j] - ref).abs().max()))
        return lm.cache_info(), [str(w.message) for w in caught], worst, len(trace)
    finally:
        lm.close()


def test_a_replay_that_disagrees_rejects_its_bucket_and_the_step_stays_exact(
        tiny_hf, gpt2_tok, monkeypatch):
    """Every bucket's first replay disagrees: the bucket is rejected (counted, one warning
    naming it), the step runs again eagerly (rows and KV written anew: every later row equals
    an uncached forward), and the bucket is never captured again."""
    info, messages, worst, steps = _run(tiny_hf, gpt2_tok, monkeypatch, noise=0.5)
    assert worst <= 1e-5
    buckets = info["decode_captures"]
    assert buckets >= 1 and info["decode_graphs_rejected"] == buckets
    assert info["decode_graphs_verified"] == 0 and info["decode_graphs"] == 0
    assert info["decode_replays"] == buckets  # each bad graph replayed once, then never
    assert info["decode_steps"] == steps
    assert info["decode_eager_steps"] == steps  # (the rejected replays' steps run again)
    bad = [m for m in messages if "disagreed with its eager run" in m]
    assert len(bad) == buckets and all("bucket (" in m for m in bad)


def test_a_replay_that_agrees_is_kept_and_replayed(tiny_hf, gpt2_tok, monkeypatch):
    """Honest replays: every bucket verified once and replayed at every later step of it; a
    bucket's first step runs eagerly."""
    info, messages, worst, steps = _run(tiny_hf, gpt2_tok, monkeypatch, noise=0.0)
    assert worst <= 1e-5
    assert info["decode_graphs_verified"] == info["decode_captures"] == info["decode_graphs"] >= 1
    assert info["decode_graphs_rejected"] == 0
    assert info["decode_replays"] + info["decode_eager_steps"] == steps
    assert info["decode_eager_steps"] >= info["decode_captures"]
    assert not [m for m in messages if "disagreed" in m]


def test_the_tolerance_follows_the_models_dtype():
    assert graphs_module.TOLERANCE[torch.float32] == 1e-4
    assert graphs_module.TOLERANCE[torch.bfloat16] > graphs_module.TOLERANCE[torch.float16] > 1e-4
    off = StepGraphs(torch.device("cpu"), torch.bfloat16, enabled=False)
    assert off.tolerance == graphs_module.TOLERANCE[torch.bfloat16]
    assert not off._may_capture((1, 32, 0))


class _Buf:
    """A bucket's buffers as :class:`StepGraphs` reads them: its key and its logits."""

    def __init__(self, key):
        self.key, self.logits = key, torch.zeros(2, 3)


@pytest.mark.parametrize("capture_after,captured,replays", [
    (2, ["b", "a"], 3),  # the default: at a bucket's second use ("c", used once, never)
    (1, ["a", "b", "c"], 6),  # at its first use
    (3, ["b"], 1)])
def test_a_bucket_is_captured_at_its_capture_after_use(monkeypatch, capture_after, captured,
                                                       replays):
    """The uses of a bucket before its ``capture_after``-th run eagerly (counted), then it is
    captured (its warm-up computing that step) and replayed; every step computed exactly once
    by one of the three."""
    done = []
    monkeypatch.setattr(StepGraphs, "_capture", _stand_in(0.0))
    graphs = StepGraphs(torch.device("cpu"), torch.float32, enabled=True, max_graph_bytes=1 << 40,
                        capture_after=capture_after)
    bufs = {k: _Buf(k) for k in "abc"}

    def forward(buf):
        done.append(buf.key)
        buf.logits.fill_(ord(buf.key))  # (the same rows at every run of a bucket)

    order = list("abbbca")
    for k in order:
        graphs.run(bufs[k], forward, 2)
    assert graphs.captures == len(captured) and list(graphs.graphs) == captured
    assert graphs.replays == replays and graphs.verified == len(captured)
    # each step computed once, but for a capture's step: its warm-up, then its first replay
    assert graphs.eager == len(order) - replays
    assert len(done) == len(order) + len(captured)
    assert graphs.stats()["decode_eager_steps"] == graphs.eager
    graphs.clear()
    assert not graphs.graphs and not graphs._uses


def test_buckets_are_not_counted_when_graphs_are_off(monkeypatch):
    graphs = StepGraphs(torch.device("cpu"), torch.float32, enabled=False)
    calls = []
    for k in "aab":
        graphs.run(_Buf(k), lambda buf: calls.append(buf.key), 2)
    assert calls == list("aab") and graphs.eager == 3 and not graphs._uses
    assert graphs.captures == graphs.replays == 0
