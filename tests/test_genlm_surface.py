"""genlm-backend 0.3.1 names served by genback with genback's semantics: ``OutputCache``'s
mapping API (``genlm.backend.cache``), ``BatchAbandoned``, live ``batch_size`` / ``timeout``."""

from __future__ import annotations

import asyncio

import pytest
import torch

from genback.batcher import BatchAbandoned, BatcherClosed
from genback.output_cache import OutputCache


def test_output_cache_mapping_api_is_lru():
    cache = OutputCache(2)
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
    assert lm.batch_window == 60.0 and lm._batcher.max_batch_size == 2

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
