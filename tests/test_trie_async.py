"""AsyncTokenCharacterTrie: batching on a worker thread, error isolation, several event loops."""

import asyncio
import threading

import numpy as np
import pytest
import torch

from genback.tokenization import Token
from genback.trie import AsyncTokenCharacterTrie, ParallelTokenCharacterTrie, TokenCharacterTrie

torch.set_num_threads(1)
TOY = [Token(0, b"a"), Token(1, b"ab"), Token(2, b"b"), Token(3, b"ab"), Token(4, b"")]
W = np.array([1.0, 2.0, 4.0, 8.0, 16.0])


def _np(x):
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("backend", ["sequential", "parallel"])
async def test_concurrent_requests_are_batched_and_correct(backend):
    kwargs = {"device": "cpu"} if backend == "parallel" else {}
    a = AsyncTokenCharacterTrie.from_vocab(TOY, backend=backend, max_batch=4, **kwargs)
    ref = TokenCharacterTrie(TOY)
    rows = [W * (i + 1) for i in range(10)]
    sums = await asyncio.gather(*(a.weight_sum(r) for r in rows))
    maxes = await asyncio.gather(*(a.weight_max(np.log(r)) for r in rows[:3]))
    for r, s in zip(rows, sums):
        np.testing.assert_array_equal(_np(s), ref.weight_sum(r))
    np.testing.assert_allclose(_np(maxes[2]), ref.weight_max(np.log(rows[2])))
    assert a.batches_run == 3 + 1  # 10 sums in batches of at most 4, 3 maxes in one
    await a.cleanup()


async def test_runs_off_the_event_loop_thread():
    seen = []
    trie = TokenCharacterTrie(TOY)
    orig = trie.batch_weight_sum

    def spy(X):
        seen.append(threading.current_thread())
        return orig(X)

    trie.batch_weight_sum = spy
    a = AsyncTokenCharacterTrie(trie)
    await a.weight_sum(W)
    assert seen and seen[0] is not threading.current_thread()
    await a.cleanup()


async def test_bad_request_fails_alone():
    a = AsyncTokenCharacterTrie(TokenCharacterTrie(TOY))
    nan = W.copy()
    nan[1] = np.nan
    res = await asyncio.gather(a.weight_sum(W), a.weight_sum(nan), a.weight_sum(W[:3]), a.weight_sum(2 * W),
                               return_exceptions=True)
    assert res[0][0] == 31.0 and res[3][0] == 62.0
    assert isinstance(res[1], ValueError) and "NaN" in str(res[1])
    assert isinstance(res[2], ValueError) and "shape" in str(res[2])
    assert (await a.weight_max(W))[0] == 16.0  # still serving
    await a.cleanup()


def test_several_event_loops_and_idempotent_lifecycle():
    a = AsyncTokenCharacterTrie.from_vocab(TOY, backend="sequential")
    for k in range(3):
        out = asyncio.run(a.weight_sum(W * (k + 1)))
        assert out[0] == 31.0 * (k + 1)
    asyncio.run(a.cleanup())
    asyncio.run(a.cleanup())
    assert asyncio.run(a.weight_logsumexp(np.log(W)))[0] == pytest.approx(np.log(31.0))
    a.shutdown()
    a.shutdown()


def test_bad_construction():
    with pytest.raises(ValueError, match="backend must be"):
        AsyncTokenCharacterTrie.from_vocab(TOY, backend="gpu")
    with pytest.raises(ValueError, match="max_batch"):
        AsyncTokenCharacterTrie(TokenCharacterTrie(TOY), max_batch=0)
    with pytest.raises(TypeError, match="TokenCharacterTrie"):
        AsyncTokenCharacterTrie(object())
    assert isinstance(AsyncTokenCharacterTrie.from_vocab(TOY, device="cpu").trie, ParallelTokenCharacterTrie)


async def test_failed_single_request_batch_never_hangs():
    """A one-request batch whose first computation fails and whose recomputation succeeds
    resolves its caller (it used to be left pending forever)."""
    trie = TokenCharacterTrie(TOY)
    orig, calls = trie.batch_weight_sum, []

    def flaky(X):
        calls.append(len(X))
        if len(calls) == 1:
            raise RuntimeError("transient failure")
        return orig(X)

    trie.batch_weight_sum = flaky
    a = AsyncTokenCharacterTrie(trie)
    out = await asyncio.wait_for(a.weight_sum(W), 60)  # a guard against a hang, not a timing
    assert out[0] == 31.0 and calls == [1, 1]
    # a request that keeps failing gets the error; one in the same batch that works is served
    trie.batch_weight_sum = lambda X: (_ for _ in ()).throw(RuntimeError("down")) if X[0, 0] < 0 \
        else orig(X)
    res = await asyncio.wait_for(asyncio.gather(a.weight_sum(-W), a.weight_sum(W),
                                                return_exceptions=True), 60)
    assert isinstance(res[0], RuntimeError) and res[1][0] == 31.0
    await a.cleanup()


async def test_start_is_idempotent_and_shared_batcher_is_used():
    from genback.batching.batcher import Batcher

    a = AsyncTokenCharacterTrie(TokenCharacterTrie(TOY), max_batch=3)
    b = a.start()
    assert isinstance(b, Batcher) and a.start() is b and b.max_batch_size == 3
    await asyncio.gather(*(a.weight_sum(W) for _ in range(5)))
    assert b.batches == 2 and a.batches_run == 2  # 3 + 2 requests
    await a.cleanup()
    assert a.start() is not b  # a fresh worker after cleanup
    a.shutdown()
