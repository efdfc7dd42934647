"""AsyncMlxLM on the real SmolLM2 through mlx-lm (MLX's CPU backend) against AsyncTransformer.

Both run fp32. The two frameworks' fp32 kernels round differently: against a float64 forward of
the same weights, MLX's rows are off by up to ~3.5e-4 and HF's by ~6e-5, so the cross-backend
bar is 1e-3 (measured max ~3e-4). Within MLX, every cached, batched or chunked path must equal
MLX's own uncached single forward within 1e-5.

MLX's CPU kernels are slow on these machines (a 40-token SmolLM2 forward takes seconds), so the
MLX-against-itself checks use a few contexts each; the cross-backend check uses all 50.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading

import pytest
import torch

pytest.importorskip("mlx.core", reason='mlx is not installed: pip install "genback[mlx]"')
pytest.importorskip("mlx_lm", reason='mlx-lm is not installed: pip install "genback[mlx]"')

from genback.llm import AsyncMlxLM, BatcherClosed, load_model_by_name  # noqa: E402
from genback.llm.mlx import thread as mlx_thread  # noqa: E402

CROSS_TOL = 1e-3  # MLX fp32 vs HF fp32 (different kernels)
SELF_TOL = 1e-4  # MLX cached / batched paths vs MLX uncached on SmolLM2 (the README's promise: 1e-4)

TEXT = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who told "
    "stories about the storms he had seen. def fibonacci(n):\n    if n < 2:\n        return n\n"
    "The capital of France is Paris, and the capital of Italy is Rome. 猫在桌子上 <|im_end|>"
)


@pytest.fixture(scope="module")
def mlx_lm():
    # built through load_model_by_name so its "mlx" dispatch is exercised too
    lm = load_model_by_name("smollm2-135m", backend="mlx")
    assert type(lm) is AsyncMlxLM
    yield lm
    lm.close()


@pytest.fixture(scope="module")
def ref(module_smol_lm):
    return module_smol_lm


@pytest.fixture(scope="module")
def text_ids(ref):
    return ref.tokenizer.encode(TEXT)


def _prefixes(ids, n, seed, longest=None):
    rng = random.Random(seed)
    return [ids[: rng.randint(1, longest or len(ids))] for _ in range(n)]


def test_rows_match_transformer_on_random_prefixes(mlx_lm, ref, text_ids):
    mlx_lm.clear_cache()
    n = 24  # random prefixes of one text (nested ones among them); 50 took twice as long
    contexts = _prefixes(text_ids, n, seed=0)
    rows = asyncio.run(mlx_lm.batch_next_token_logprobs(contexts))
    assert rows.dtype == torch.float32 and rows.device.type == "cpu"
    assert rows.shape == (n, len(mlx_lm.byte_vocab)) == (n, ref.vocab_size)
    want = torch.stack([ref.next_token_logprobs_uncached(c) for c in contexts])
    diff = (rows - want).abs().max().item()
    print(f"max abs diff vs AsyncTransformer on {n} prefixes: {diff:.3g}")
    assert diff < CROSS_TOL
    assert torch.allclose(torch.logsumexp(rows.double(), -1), torch.zeros(n, dtype=torch.float64), atol=1e-5)
    few = [0, 11, 23]
    own = torch.stack([mlx_lm.next_token_logprobs_uncached(contexts[i]) for i in few])
    assert (rows[few] - own).abs().max().item() < SELF_TOL
    top = mlx_lm.tokenizer.decode(int(mlx_lm.next_token_logprobs_sync(
        mlx_lm.tokenizer.encode("The capital of France is")).argmax()))
    assert top == " Paris"


def test_token_logprobs_match_transformer(mlx_lm, ref, text_ids):
    context, continuation = text_ids[:20], text_ids[20:31]
    have = asyncio.run(mlx_lm.token_logprobs(context, continuation))
    want = asyncio.run(ref.token_logprobs(context, continuation))
    assert have.shape == (11,) and have.dtype == torch.float32
    assert (have - want).abs().max().item() < CROSS_TOL
    # each entry is the row of its prefix at that token (MLX against itself: the rows come
    # from the KV-reusing path, checked against uncached forwards in the other tests)
    rows = [mlx_lm.next_token_logprobs_sync(context + continuation[:j]) for j in range(11)]
    assert (have - torch.stack([r[t] for r, t in zip(rows, continuation)])).abs().max() < SELF_TOL
    assert (rows[5] - mlx_lm.next_token_logprobs_uncached(context + continuation[:5])).abs().max() \
        < SELF_TOL


def test_score_matches_transformer(mlx_lm, ref):
    tok = ref.tokenizer
    context = tok.encode("The capital of France is")
    continuation = tok.encode(" Paris, and the capital of Italy is Rome. Berlin is in Germany.")
    n = len(continuation)
    logprobs, greedy = asyncio.run(mlx_lm.score(context, continuation))
    assert logprobs.shape == greedy.shape == (n,)
    assert logprobs.dtype == torch.float32 and greedy.dtype == torch.bool
    want_lp, want_greedy = asyncio.run(ref.score(context, continuation))
    assert (logprobs - want_lp).abs().max().item() < CROSS_TOL
    # the greedy flags agree wherever the top token leads the runner-up clearly
    rows = torch.stack([ref.next_token_logprobs_uncached(context + continuation[:j])
                        for j in range(n)])  # [n, V]
    top2 = rows.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-2
    assert clear.sum() >= n - 1
    assert torch.equal(greedy[clear], want_greedy[clear])
    assert greedy[0] and not greedy.all()  # " Paris" is the greedy choice; not every token is
    # one query: the same log-probs as token_logprobs, and the flags are the rows' argmaxes
    assert (logprobs - asyncio.run(mlx_lm.token_logprobs(context, continuation))).abs().max() \
        < SELF_TOL
    own_rows = [mlx_lm.next_token_logprobs_sync(context + continuation[:j]) for j in range(n)]
    argmax = torch.tensor([int(r.argmax()) for r in own_rows])
    assert torch.equal(greedy, argmax == torch.tensor(continuation))


def test_seeded_sampling_matches_transformer(mlx_lm, ref):
    prompt = mlx_lm.tokenizer.encode("An apple a day keeps the")
    eos = [mlx_lm.tokenizer.eos_token_id]
    have = asyncio.run(mlx_lm.sample(prompt, 12, eos, temperature=0.7, seed=80808))
    again = asyncio.run(mlx_lm.sample(prompt, 12, eos, temperature=0.7, seed=80808))
    want = asyncio.run(ref.sample(prompt, 12, eos, temperature=0.7, seed=80808))
    assert have == again == want and len(have) > 0


def test_smc_steps_reuse_kv_one_forward_per_step(mlx_lm, text_ids):
    mlx_lm.clear_cache()
    mlx_lm.clear_kv_cache()
    prompt = text_ids[:20]
    particles = [list(prompt) + [t] for t in (11, 12, 13, 14, 15, 16)]
    gen = torch.Generator().manual_seed(1)

    async def step():
        return await asyncio.gather(*(mlx_lm.next_token_logprobs(p) for p in particles))

    before = mlx_lm.cache_info()
    rows = asyncio.run(step())
    info = mlx_lm.cache_info()
    # the shared, uncached prompt is forwarded once, then one token per particle
    assert info["tokens_forwarded"] - before["tokens_forwarded"] == 20 + 6
    assert info["batches"] - before["batches"] == 1
    for _ in range(4):
        for p, r in zip(particles, rows):
            p.append(int(torch.multinomial(r.exp(), 1, generator=gen)))
        before = mlx_lm.cache_info()
        rows = asyncio.run(step())
        info = mlx_lm.cache_info()
        distinct = len({tuple(p) for p in particles})
        assert info["tokens_forwarded"] - before["tokens_forwarded"] == distinct
        assert info["forwards"] - before["forwards"] == 1  # all particles in one forward
        assert info["tokens_reused"] - before["tokens_reused"] == sum(
            len(p) - 1 for p in {tuple(p) for p in particles})
    for p, r in list(zip(particles, rows))[:3]:  # the last step, against uncached forwards
        assert (r - mlx_lm.next_token_logprobs_uncached(p)).abs().max() < SELF_TOL


def test_forked_and_diverging_contexts_reuse_common_prefix(mlx_lm, text_ids):
    """An entry serves any query sharing a prefix with it (trimmed), not only its extensions."""
    mlx_lm.clear_cache()
    mlx_lm.clear_kv_cache()
    mlx_lm.next_token_logprobs_sync(text_ids[:40])
    before = mlx_lm.cache_info()
    fork = text_ids[:25] + [100, 101]
    row = mlx_lm.next_token_logprobs_sync(fork)
    assert mlx_lm.cache_info()["tokens_forwarded"] - before["tokens_forwarded"] == 2
    assert (row - mlx_lm.next_token_logprobs_uncached(fork)).abs().max() < SELF_TOL


def test_small_kv_budget_evicts_and_stays_exact(text_ids):
    lm = AsyncMlxLM.from_name("smollm2-135m", kv_budget_bytes=1 << 20, prefill_step_size=8)
    try:
        contexts = _prefixes(text_ids, 12, seed=3, longest=40)
        rows = lm.batch_next_token_logprobs_sync(contexts)
        info = lm.cache_info()
        assert info["kv_bytes"] <= 1 << 20 and info["evictions"] > 0
        for c, r in list(zip(contexts, rows))[::4]:
            assert (r - lm.next_token_logprobs_uncached(c)).abs().max() < SELF_TOL
    finally:
        lm.close()


def test_cache_kv_pins_until_clear_kv_cache(mlx_lm, text_ids):
    mlx_lm.clear_cache()
    mlx_lm.clear_kv_cache()
    prompt = text_ids[:50]
    mlx_lm.cache_kv(prompt)
    mlx_lm.clear_cache()  # keeps pinned KV
    before = mlx_lm.cache_info()
    mlx_lm.next_token_logprobs_sync(prompt + [5])
    assert mlx_lm.cache_info()["tokens_forwarded"] - before["tokens_forwarded"] == 1
    mlx_lm.clear_kv_cache()
    assert mlx_lm.cache_info()["kv_entries"] == 0
    with pytest.raises(ValueError, match="kv_budget_bytes"):
        small = AsyncMlxLM(mlx_lm.mlx_lm_model, mlx_lm.tokenizer, kv_budget_bytes=1000)
        try:
            small.cache_kv(prompt)
        finally:
            small.close()


def test_sync_forms_and_several_event_loops(mlx_lm, text_ids):
    contexts = _prefixes(text_ids, 3, seed=5, longest=30)
    want = torch.stack([mlx_lm.next_token_logprobs_uncached(c) for c in contexts])
    for _ in range(3):  # clients call asyncio.run repeatedly on one model
        mlx_lm.clear_cache()
        got = asyncio.run(mlx_lm.batch_next_token_logprobs(contexts))
        assert (got - want).abs().max() < SELF_TOL

    async def inside_loop():  # sync calls work on a running loop's thread
        return mlx_lm.batch_next_token_logprobs_sync(contexts)

    mlx_lm.clear_cache()
    assert (asyncio.run(inside_loop()) - want).abs().max() < SELF_TOL
    assert (mlx_lm.next_token_logprobs_sync(contexts[0]) - want[0]).abs().max() < SELF_TOL


def test_bad_input_names_argument(mlx_lm):
    with pytest.raises(ValueError, match="token_ids"):
        mlx_lm.next_token_logprobs_sync([])
    with pytest.raises(ValueError, match="token_ids"):
        asyncio.run(mlx_lm.next_token_logprobs([mlx_lm.vocab_size]))
    with pytest.raises(TypeError, match="token_ids"):
        asyncio.run(mlx_lm.next_token_logprobs("hello"))
    with pytest.raises(ValueError, match="lora_name"):
        mlx_lm.next_token_logprobs_sync([1, 2], lora_name="x")
    with pytest.raises(ValueError, match="continuation_ids"):
        asyncio.run(mlx_lm.token_logprobs([1, 2], []))
    with pytest.raises(ValueError, match="dtype"):
        AsyncMlxLM.from_name("smollm2-135m", dtype="float64")
    with pytest.raises(ValueError, match="kv_budget_bytes"):
        AsyncMlxLM(mlx_lm.mlx_lm_model, mlx_lm.tokenizer, kv_budget_bytes=0)
    with pytest.raises(ValueError, match="cache_opts"):
        AsyncMlxLM(mlx_lm.mlx_lm_model, mlx_lm.tokenizer, cache_opts={"persistent": True})
    with pytest.raises(ValueError, match="no-such-model"):
        AsyncMlxLM.from_name("no-such-model")


def test_genlm_backend_constructor_names_and_mlx_lm_load(mlx_lm):
    import mlx_lm as mlx_lm_pkg

    from genback.llm.mlx.model import _config_overrides
    from genback.registry import resolve
    from mlx_lm.utils import load_config
    from pathlib import Path

    path = resolve("smollm2-135m")
    model, wrapper = mlx_lm_pkg.load(path, model_config=_config_overrides(load_config(Path(path))))
    lm = AsyncMlxLM(model, wrapper, timeout=0.01, cache_size=4)  # mlx-lm's TokenizerWrapper
    try:
        assert lm.timeout == lm.batch_window == 0.01
        assert lm.tokenizer is wrapper._tokenizer
        ids = lm.tokenizer.encode("The capital of France is")
        assert (lm.next_token_logprobs_sync(ids) - mlx_lm.next_token_logprobs_uncached(ids)).abs().max() < 1e-3
    finally:
        lm.close()


def test_close_fails_later_queries():
    lm = AsyncMlxLM.from_name("smollm2-135m")
    asyncio.run(lm.aclose())
    asyncio.run(lm.aclose())  # idempotent
    with pytest.raises(BatcherClosed):
        asyncio.run(lm.next_token_logprobs([1, 2, 3]))


def test_mlx_work_runs_on_one_thread_that_outlives_close(mlx_lm, text_ids):
    """Every MLX runner's work runs on the process's MLX thread, and closing a model leaves that
    thread running: an MLX thread that ends at interpreter shutdown aborts the process (mlx
    0.32's per-thread compile cache is released by a thread-exit destructor that needs the GIL).
    """
    seen = []
    other = AsyncMlxLM.from_name("smollm2-135m")
    run_all = other.runner._run_all

    def spy(queries):  # the runner's step, as run on its thread
        seen.append(threading.current_thread())
        return run_all(queries)

    other.runner._run_all = spy
    try:
        row = other.next_token_logprobs_sync(text_ids[:5])
        assert (row - mlx_lm.next_token_logprobs_uncached(text_ids[:5])).abs().max() < SELF_TOL
    finally:
        other.close()
    assert seen and {t.name for t in seen} == {"genback-mlx"} and len(set(seen)) == 1
    (worker,) = set(seen)
    assert worker.is_alive() and worker.daemon  # closing the model did not end it
    assert mlx_thread.on_mlx_thread(threading.current_thread) is worker  # the one all models use


def test_mlx_thread_returns_raises_nests_and_restarts_after_fork(monkeypatch):
    worker = mlx_thread.on_mlx_thread(threading.current_thread)
    assert worker is not threading.current_thread() and worker.daemon
    assert mlx_thread.on_mlx_thread(divmod, 7, 2) == (3, 1)
    with pytest.raises(ZeroDivisionError):
        mlx_thread.on_mlx_thread(divmod, 1, 0)
    # a call made on the MLX thread runs at once (waiting for the thread itself would deadlock)
    assert mlx_thread.on_mlx_thread(mlx_thread.on_mlx_thread, threading.current_thread) is worker
    assert mlx_thread.on_mlx_thread(threading.current_thread) is worker  # still served
    # a forked child (another pid) has no copy of the thread: its first call starts its own
    for name in ("_thread", "_work", "_pid"):  # the parent's thread is served again afterwards
        monkeypatch.setattr(mlx_thread, name, getattr(mlx_thread, name))
    pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: pid + 1)
    child = mlx_thread.on_mlx_thread(threading.current_thread)
    assert child is not worker and child.is_alive() and child.daemon


def test_context_objects_answer_as_lists(mlx_lm, text_ids):
    """``lm.context`` objects extended by ``+`` on the MLX backend: the rows of the same ids as
    lists, each step one forward from the last step's KV."""
    ctx = mlx_lm.context(text_ids[:12])

    async def steps():
        nonlocal ctx
        for t in text_ids[12:15]:
            ctx = ctx + [t]
            f0 = mlx_lm.cache_info()["forwards"]
            got = await mlx_lm.next_token_logprobs(ctx)
            assert mlx_lm.cache_info()["forwards"] - f0 == 1
            want = mlx_lm.next_token_logprobs_uncached(list(ctx))
            assert (got - want).abs().max() < SELF_TOL

    asyncio.run(steps())
