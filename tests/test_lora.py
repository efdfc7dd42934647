"""LoRA adapters on AsyncTransformer (peft) with the real SmolLM2.

The adapters are made here: peft ``LoraConfig`` on SmolLM2's attention projections, with
non-zero random weights, saved with ``save_pretrained``. The reference for rows under an
adapter is an uncached forward of the merged model (``merge_and_unload``) on a separate copy.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

peft = pytest.importorskip("peft", reason='peft is not installed: pip install "genback[lora]"')

from genback.llm import AsyncTransformer  # noqa: E402

MERGED_TOL = 1e-4  # adapter layers vs merged weights: different fp32 summation order
SELF_TOL = 1e-4  # batched KV-cached fp32 forwards of SmolLM2's 30 layers (as test_llm_exact)

TEXT = ("Once upon a time, in a small village by the sea, there lived an old fisherman who "
        "told stories about the storms he had seen. The capital of France is Paris.")


def _fresh_smol():
    from transformers import AutoModelForCausalLM

    from genback.registry import resolve

    return AutoModelForCausalLM.from_pretrained(resolve("smollm2-135m"),
                                                dtype=torch.float32).eval()


def _make_adapter(folder, seed: int, targets: list[str], rank: int) -> str:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
    model = get_peft_model(_fresh_smol(), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # peft starts B at zero: give both factors real weights
                p.copy_(0.03 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "a": _make_adapter(root / "a", 1, ["q_proj", "v_proj"], 8),
        "b": _make_adapter(root / "b", 2, ["q_proj", "k_proj", "v_proj", "o_proj"], 4),
    }


@pytest.fixture(scope="module")
def merged(adapters):
    """Uncached reference rows of each adapter merged into its own copy of SmolLM2."""
    from peft import PeftModel

    refs = {}
    for name, path in adapters.items():
        model = PeftModel.from_pretrained(_fresh_smol(), path).merge_and_unload().eval()

        @torch.inference_mode()
        def row(ids, model=model):
            return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)

        refs[name] = row
    return refs


@pytest.fixture(scope="module")
def lm(adapters, smol_hf):
    lm = AsyncTransformer(_fresh_smol(), smol_hf[1])
    lm.add_new_lora(adapters["a"], "a")
    lm.add_new_lora(adapters["b"], "b")
    yield lm
    lm.close()


@pytest.fixture(scope="module")
def ids(smol_hf):
    return smol_hf[1].encode(TEXT)


def test_rows_under_adapters_equal_merged_model(lm, merged, ids):
    lm.clear_cache()
    contexts = [ids[:n] for n in (3, 11, 17, 30)]
    for name in ("a", "b"):
        rows = asyncio.run(lm.batch_next_token_logprobs(contexts, lora_name=name))
        want = torch.stack([merged[name](c) for c in contexts])
        assert rows.shape == want.shape and rows.dtype == torch.float32
        assert (rows - want).abs().max() < MERGED_TOL
        base = torch.stack([lm.next_token_logprobs_uncached(c) for c in contexts])
        assert (rows - base).abs().max() > 0.05  # the adapter really changes the rows
        uncached = torch.stack([lm.next_token_logprobs_uncached(c, lora_name=name)
                                for c in contexts])
        assert (rows - uncached).abs().max() < SELF_TOL
    # token_logprobs: one forward of the continuation under the adapter
    have = asyncio.run(lm.token_logprobs(ids[:12], ids[12:20], lora_name="a"))
    want = torch.stack([merged["a"](ids[:12 + j])[ids[12 + j]] for j in range(8)])
    assert (have - want).abs().max() < MERGED_TOL


def test_base_rows_unchanged_by_adapters(lm, module_smol_lm, ids):
    """``module_smol_lm`` runs on the session's SmolLM2 copy, which never saw an adapter: the
    same batch on both gives the same rows (same computation), and both match the uncached
    forward of the pristine model."""
    contexts = [ids[:n] for n in (5, 9, 25)]
    for model in (lm, module_smol_lm):
        model.clear_cache()
        model.clear_kv_cache()
    rows = lm.batch_next_token_logprobs_sync(contexts)
    same = module_smol_lm.batch_next_token_logprobs_sync(contexts)
    assert (rows - same).abs().max() <= 1e-6
    want = torch.stack([module_smol_lm.next_token_logprobs_uncached(c) for c in contexts])
    assert (rows - want).abs().max() < SELF_TOL
    assert (lm.next_token_logprobs_uncached(ids[:9]) - want[1]).abs().max() <= 1e-6


def test_two_adapters_and_base_interleaved_in_one_gather(lm, merged, ids):
    lm.clear_cache()
    lm.clear_kv_cache()
    contexts = [ids[:n] for n in (7, 14, 21)]
    names = [None, "a", "b"] * 3

    async def all_at_once():
        return await asyncio.gather(*(
            lm.next_token_logprobs(contexts[i // 3], lora_name=n) for i, n in enumerate(names)))

    before = lm.cache_info()
    rows = asyncio.run(all_at_once())
    info = lm.cache_info()
    assert info["batches"] - before["batches"] == 1
    assert info["batched_queries"] - before["batched_queries"] == 9  # same tokens, 3 adapters
    for i, (n, row) in enumerate(zip(names, rows)):
        c = contexts[i // 3]
        want = lm.next_token_logprobs_uncached(c) if n is None else merged[n](c)
        assert (row - want).abs().max() < (SELF_TOL if n is None else MERGED_TOL)
    assert (rows[1] - rows[2]).abs().max() > 0.05


def test_kv_reuse_is_per_adapter(lm, merged, ids):
    lm.clear_cache()
    lm.clear_kv_cache()
    prompt = ids[:30]
    lm.next_token_logprobs_sync(prompt, lora_name="a")
    before = lm.cache_info()
    row = lm.next_token_logprobs_sync(prompt + [ids[30]], lora_name="a")
    assert lm.cache_info()["tokens_forwarded"] - before["tokens_forwarded"] == 1
    assert (row - merged["a"](prompt + [ids[30]])).abs().max() < MERGED_TOL
    # the same tokens under adapter b or the base model reuse nothing of adapter a's KV
    for name in ("b", None):
        before = lm.cache_info()
        lm.next_token_logprobs_sync(prompt + [ids[30]], lora_name=name)
        assert lm.cache_info()["tokens_forwarded"] - before["tokens_forwarded"] == 31
    # a pinned prompt under an adapter serves that adapter's extensions
    lm.clear_cache()
    lm.clear_kv_cache()
    lm.cache_kv(prompt, lora_name="b")
    lm.clear_cache()  # keeps pinned KV
    before = lm.cache_info()
    row = asyncio.run(lm.next_token_logprobs(prompt + [5], lora_name="b"))
    assert lm.cache_info()["tokens_forwarded"] - before["tokens_forwarded"] == 1
    assert (row - merged["b"](prompt + [5])).abs().max() < MERGED_TOL


def test_seeded_sampling_under_adapter_is_reproducible(lm, ids):
    prompt = ids[:10]
    eos = [lm.tokenizer.eos_token_id]
    one = asyncio.run(lm.sample(prompt, 6, eos, temperature=0.8, seed=3, lora_name="a"))
    two = asyncio.run(lm.sample(prompt, 6, eos, temperature=0.8, seed=3, lora_name="a"))
    assert one == two
    # each step's row came from adapter a: the first token is drawn from a's row
    gen = torch.Generator().manual_seed(3)
    row = lm.next_token_logprobs_sync(prompt, lora_name="a")
    first = int(torch.multinomial(torch.softmax(row / 0.8, -1), 1, generator=gen))
    assert one[:1] == ([] if first == eos[0] else [first])


def test_replace_and_remove(adapters, merged, smol_hf, ids):
    lm = AsyncTransformer(_fresh_smol(), smol_hf[1])
    try:
        lm.add_new_lora(adapters["a"], "x")
        row_a = lm.next_token_logprobs_sync(ids[:9], lora_name="x")
        assert (row_a - merged["a"](ids[:9])).abs().max() < MERGED_TOL
        kv_with_a = lm.cache_info()["kv_bytes"]
        assert kv_with_a > 0 and lm.cache_info()["rows_cached"] == 1
        lm.add_new_lora(adapters["b"], "x")  # replaces: a's KV and rows are dropped
        info = lm.cache_info()
        assert info["kv_bytes"] == 0 and info["rows_cached"] == 0
        row_b = lm.next_token_logprobs_sync(ids[:9], lora_name="x")
        assert (row_b - merged["b"](ids[:9])).abs().max() < MERGED_TOL
        assert lm.lora_names == ["x"]

        async def removed_while_pending():
            lm.batch_window = 30.0  # the batch waits until remove_lora has run
            lm.batch_size = 3
            pending = [asyncio.ensure_future(lm.next_token_logprobs(ids[:n], lora_name="x"))
                       for n in (4, 5)]
            await asyncio.sleep(0)
            lm.remove_lora("x")
            base = asyncio.ensure_future(lm.next_token_logprobs(ids[:6]))  # fills the batch
            results = await asyncio.gather(*pending, base, return_exceptions=True)
            lm.batch_window = 0.002
            return results

        r4, r5, base = asyncio.run(removed_while_pending())
        for r in (r4, r5):
            assert isinstance(r, ValueError) and "'x' was removed" in str(r)
        assert (base - lm.next_token_logprobs_uncached(ids[:6])).abs().max() < SELF_TOL
        assert lm.lora_names == [] and lm.cache_info()["kv_nodes"] >= 1
        with pytest.raises(ValueError, match="lora_name='x': this model has no LoRA adapters"):
            lm.next_token_logprobs_sync(ids[:4], lora_name="x")
    finally:
        lm.close()


def test_a_decode_step_chain_gives_way_to_the_tree_forward_once_an_adapter_is_loaded(
        adapters, merged, smol_hf, ids):
    """Base-model SMC steps chained on the decode step (run eagerly: its path of CUDA graphs,
    which run the base model only); an adapter added mid-chain: the base model's next steps are
    planned on the tree forward and chained there, an adapter's steps too, every row exact."""
    lm = AsyncTransformer(_fresh_smol(), smol_hf[1], decode="eager", row_cache_size=0)
    runner = lm.runner
    parts = [list(ids[:20]) for _ in range(3)]

    def step(lora_name=None):
        for i, p in enumerate(parts):
            p.append(ids[len(p) - i])
        return lm.batch_next_token_logprobs_sync([list(p) for p in parts], lora_name=lora_name)

    try:
        for _ in range(3):
            step()
        assert runner.chain.source is runner.decode_step and runner.chain.steps >= 1
        lm.add_new_lora(adapters["a"], "a")
        for _ in range(3):
            rows = step()
            want = torch.stack([lm.next_token_logprobs_uncached(p) for p in parts])
            assert (rows - want).abs().max() < SELF_TOL
        assert runner.chain.source is runner.forward and runner.chain.steps >= 1
        for _ in range(3):  # (the first prefills the contexts under the adapter)
            rows = step("a")
            want = torch.stack([merged["a"](p) for p in parts])
            assert (rows - want).abs().max() < MERGED_TOL
        assert lm.cache_info()["chained_steps"] == 1 + 2 + 1
    finally:
        lm.close()


def test_bad_names_and_paths(lm, adapters, tmp_path, ids, monkeypatch):
    with pytest.raises(ValueError, match=r"lora_name='nope' is not a registered adapter.*'a'"):
        asyncio.run(lm.next_token_logprobs(ids[:3], lora_name="nope"))
    with pytest.raises(ValueError, match="lora_name='nope'"):
        lm.next_token_logprobs_uncached(ids[:3], lora_name="nope")
    with pytest.raises(ValueError, match="lora_name='nope'"):
        asyncio.run(lm.token_logprobs(ids[:3], ids[3:5], lora_name="nope"))
    with pytest.raises(ValueError, match="lora_name='nope'"):
        lm.cache_kv(ids[:3], lora_name="nope")
    with pytest.raises(ValueError, match="lora_name='nope'"):
        asyncio.run(lm.sample(ids[:3], 2, [], lora_name="nope"))
    with pytest.raises(ValueError, match="lora_name=3"):
        lm.batch_next_token_logprobs_sync([ids[:3]], lora_name=3)
    with pytest.raises(ValueError, match="lora_name='nope'"):
        lm.remove_lora("nope")
    with pytest.raises(ValueError, match="is not an existing folder"):
        lm.add_new_lora(str(tmp_path / "missing"), "c")
    with monkeypatch.context() as m:  # a Hub id that is not cached, with the Hub off
        m.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
            lm.add_new_lora("someorg/no-such-adapter", "c")
    with pytest.raises(ValueError, match="no peft adapter"):
        lm.add_new_lora(str(tmp_path), "c")
    with pytest.raises(TypeError, match="lora_name must be a str"):
        lm.add_new_lora(adapters["a"], 7)
    with pytest.raises(ValueError, match="lora_name must be non-empty"):
        lm.add_new_lora(adapters["a"], "")
    with pytest.raises(TypeError, match="lora_path"):
        lm.add_new_lora(None, "c")
    assert lm.lora_names == ["a", "b"]
    # other callers are unaffected: a good query right after
    assert lm.next_token_logprobs_sync(ids[:3], lora_name="a").shape == (lm.vocab_size,)


def test_adapter_for_another_architecture_is_a_clear_error(tmp_path, smol_hf):
    """A peft adapter whose target modules the model lacks fails with peft's reason."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    small = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    get_peft_model(small, LoraConfig(r=2, target_modules=["c_attn"])).save_pretrained(tmp_path)
    lm = AsyncTransformer(_fresh_smol(), smol_hf[1])
    try:
        with pytest.raises(ValueError, match="could not be loaded as a LoRA adapter"):
            lm.add_new_lora(str(tmp_path), "gpt2-adapter")
        assert lm.lora_names == []
        ids = smol_hf[1].encode("Hello there")
        assert (lm.next_token_logprobs_sync(ids)
                - lm.next_token_logprobs_uncached(ids)).abs().max() < SELF_TOL
    finally:
        lm.close()


def test_adapter_by_hub_id_from_local_cache(lm, adapters, merged, ids, tmp_path, monkeypatch):
    from pathlib import Path

    from huggingface_hub import constants
    from _hub_standins import add_to_cache

    add_to_cache(tmp_path / "hub", "someorg/smol-lora-a", Path(adapters["a"]))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm.add_new_lora("someorg/smol-lora-a", "from-hub")
    try:
        row = lm.next_token_logprobs_sync(ids[:8], lora_name="from-hub")
        assert (row - merged["a"](ids[:8])).abs().max() < MERGED_TOL
    finally:
        lm.remove_lora("from-hub")
