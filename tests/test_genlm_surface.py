"""genlm-backend 0.3.1 names served by genback with genback's semantics: ``OutputCache``'s
mapping API (``genlm.backend.cache``), ``BatchAbandoned``, live ``batch_size`` / ``timeout``."""

from __future__ import annotations

import asyncio

import pytest
import torch

from genback.batching.batcher import BatchAbandoned, BatcherClosed
from genback.core.output_cache import OutputCache


def test_output_cache_mapping_api_is_lru():
    cache = OutputCache(maxsize=2, move_to_cpu=False)
    assert cache.maxsize == 2 and len(cache) == 0 and "a" not in cache
    cache["a"] = torch.zeros(3)
    cache["b"] = torch.ones(3)
    assert torch.equal(cache["a"], torch.zeros(3))  # "a" is now the most recent
    cache["c"] = torch.full((3,), 2.0)  # evicts "b", the least recently used
    assert "b" not in cache and "a" in cache and "c" in cache and len(cache) == 2
    with pytest.raises(KeyError):
        cache["b"]
    cache.clear()
    assert len(cache) == 0 and cache.bytes_held == 0


def test_output_cache_get_many_is_get_of_each_key():
    """``get_many`` (the worker's one-lock lookup of a batch) agrees with ``get`` key by key:
    same rows, same hits, same LRU order; a None key is no lookup."""
    a, b = OutputCache(3), OutputCache(3)
    for cache in (a, b):
        for k in "xyz":
            cache[k] = torch.full((2,), float(ord(k)))
    keys = ["y", "q", None, "x", "y"]
    many = a.get_many(keys)
    one = [None if k is None else b.get(k) for k in keys]
    assert [r is None for r in many] == [False, True, True, False, False]
    assert all(r is s or torch.equal(r, s) for r, s in zip(many, one) if r is not None)
    assert a.hits == b.hits == 3
    a["w"] = b["w"] = torch.zeros(2)  # evicts the least recently used: z in both
    assert "z" not in a and "z" not in b and list(a._rows) == list(b._rows)
    assert a.bytes_held == b.bytes_held == 3 * 2 * 4


def test_output_cache_hit_replaces_a_view_by_a_compact_copy():
    """Rows of one block are kept as views of it until hit; a hit keeps (and returns) a compact
    copy of equal values, once, with the byte count unchanged; the other rows stay views."""
    block = torch.randn(4, 6)
    cache = OutputCache(8)
    cache.put_many([(k, row) for k, row in zip("abcd", block.unbind(0))])
    held = cache.bytes_held
    assert held == 4 * 6 * 4 and all(cache._rows[k]._base is block for k in "abcd")
    got = cache.get("b")
    assert got._base is None and got.untyped_storage().nbytes() == 6 * 4
    assert torch.equal(got, block[1]) and cache._rows["b"] is got
    assert cache.get("b") is got  # (compacted once)
    assert [r._base is block for r in cache.get_many(["a", "c"])] == [False, False]
    assert cache._rows["d"]._base is block and cache.bytes_held == held and cache.hits == 4


def test_output_cache_move_to_cpu_keeps_cpu_copies():
    cache = OutputCache(4, move_to_cpu=True)
    row = torch.arange(4.0)
    cache[(1, 2)] = row
    stored = cache.get((1, 2))
    assert stored.device.type == "cpu" and torch.equal(stored, row)
    assert cache[(1, 2)].device == row.device  # handed back on the device it came from


def test_batch_abandoned_is_what_reset_and_close_raise(tiny_hf, gpt2_tok):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=30.0, batch_size=8)

    async def reset_while_pending():
        pending = asyncio.ensure_future(lm.next_token_logprobs([1, 2, 3]))
        await asyncio.sleep(0)
        assert lm.reset_async_queries() == 1
        with pytest.raises(BatchAbandoned):
            await pending

    asyncio.run(reset_while_pending())
    lm.close()
    with pytest.raises(BatchAbandoned):
        asyncio.run(lm.next_token_logprobs([1, 2, 3]))
    assert issubclass(BatcherClosed, BatchAbandoned)


def test_batch_size_and_timeout_are_live(tiny_hf, gpt2_tok):
    """Setting batch_size after construction changes the next batch: two queries with
    batch_size=2 go at once, without waiting for a long window."""
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    lm.timeout = 60.0
    lm.batch_size = 2
    assert lm.batch_window == 60.0 and lm.scheduler.max_batch_size == 2

    async def two():
        return await asyncio.wait_for(asyncio.gather(
            lm.next_token_logprobs([5, 6]), lm.next_token_logprobs([7])), 50)  # hang guard

    rows = asyncio.run(two())
    assert len(rows) == 2 and lm.cache_info()["batches"] == 1
    lm.close()


def test_uncached_reference_rejects_unknown_lora_name(tiny_hf, gpt2_tok):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    with pytest.raises(ValueError, match="lora_name='x'"):
        lm.next_token_logprobs_uncached([1, 2], lora_name="x")
    lm.close()


def test_walk_cache_reports_cached_prefix_and_its_kv(tiny_hf, gpt2_tok):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(tiny_hf, gpt2_tok)
    ids = gpt2_tok.encode("This is a test of caching")
    node, n, past, base = lm.walk_cache(ids)
    assert n == base == 0 and past is None and node.past_key_values is None
    lm.cache_kv(ids[:4])
    node, n, past, base = lm.walk_cache(ids)
    assert n == base == 4 and node.past_key_values is not None
    assert past.shape[3] == 4 and past.shape[:2] == (tiny_hf.config.n_layer, 2)
    lm.next_token_logprobs_sync(ids)  # every evaluated context leaves its KV
    assert lm.walk_cache(ids)[1] == len(ids)
    # the KV walk_cache returns is the model's own KV for those tokens
    with torch.inference_mode():
        ref = tiny_hf(torch.tensor([ids]), use_cache=True).past_key_values
    _, _, past, _ = lm.walk_cache(ids)
    assert (past[0, 0] - ref.layers[0].keys[0]).abs().max() < 1e-5
    lm.close()


def test_add_query_joins_the_batcher_and_reset_fails_it(tiny_hf, gpt2_tok):
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(tiny_hf, gpt2_tok, batch_window=30.0)

    async def scenario():
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()
        lm.add_query([1, 2, 3], first)
        lm.add_query([4, 5], second)
        assert [q.tokens for q in lm.queries] == [(1, 2, 3), (4, 5)]
        lm.batch_evaluate_queries()  # dispatch now instead of after 30 s
        rows = await asyncio.wait_for(asyncio.gather(first, second), 50)  # hang guard
        assert lm.queries == [] and lm.cache_info()["batches"] == 1
        third = loop.create_future()
        lm.add_query([6], third)
        lm.queries = []  # genlm-backend's way to drop the queue: the query fails
        with pytest.raises(BatchAbandoned):
            await third
        with pytest.raises(ValueError, match="query"):
            lm.add_query([], loop.create_future())
        return rows

    rows = asyncio.run(scenario())
    assert (rows[0] - lm.next_token_logprobs_uncached([1, 2, 3])).abs().max() < 1e-5
    lm.batch_evaluate_queries()  # no running loop: nothing to do
    lm.close()
