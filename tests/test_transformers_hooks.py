"""Each part of transformers that genback hooks (``docs/transformers.md``) behaves as genback needs,
checked directly on a tiny random Llama (SmolLM2's architecture, grouped-query attention) in
seconds: run this file first against a new transformers release.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from genback.llm.hf.forward import attention as tree_attention
from genback.llm.hf.forward.tree_cache import cache_argument, returned_cache

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


IDS = torch.tensor([[5, 17, 42, 8, 3], [9, 1, 60, 22, 7]])


def test_cache_keyword_is_the_one_forward_declares(llama):
    import inspect

    declared = inspect.signature(type(llama).forward).parameters
    (name,) = cache_argument(llama, None)
    assert name in declared and name in ("cache", "past_key_values")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # transformers 5.24 warns on the old name
        with torch.inference_mode():
            out = llama(input_ids=IDS, use_cache=True, **cache_argument(llama, None))
            cache = returned_cache(out)
            keys = cache.layers[0].keys
            assert keys.shape == (2, 2, 5, 16)  # [R, kv_heads, tokens, head_dim]
            nxt = llama(input_ids=IDS[:, :1], position_ids=torch.tensor([[5], [5]]),
                        use_cache=True, **cache_argument(llama, cache))
    assert returned_cache(nxt).layers[0].keys.shape == (2, 2, 6, 16)


def test_registered_attention_gets_new_kv_and_no_mask(llama):
    """A function registered with ``AttentionInterface`` and switched on through
    ``config._attn_implementation_internal`` is called once per layer with the new tokens'
    query/key/value, the layer index and no mask; its output is what the layer uses."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def recording(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        calls.append((module.layer_idx, tuple(query.shape), tuple(key.shape), attention_mask))
        q_len = query.shape[2]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), is_causal=q_len > 1,
            scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    tree_attention.register("genback_test_recording", recording)
    assert sdpa_attention_forward is not None  # the implementation the model keeps elsewhere
    with torch.inference_mode():
        want = llama(input_ids=IDS).logits
        with tree_attention.use_tree_attention(llama.config, "genback_test_recording"):
            got = llama(input_ids=IDS).logits
    assert llama.config._attn_implementation != "genback_test_recording"  # restored
    assert [c[0] for c in calls] == [0, 1]
    assert all(c[1] == (2, 4, 5, 16) and c[2] == (2, 2, 5, 16) and c[3] is None for c in calls)
    assert (got - want).abs().max() < 1e-5


def test_cache_subclass_sees_each_layer_once(llama):
    from transformers.cache_utils import Cache

    seen = []

    class Recording(Cache):
        def __init__(self):
            super().__init__(layers=[])

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            seen.append((layer_idx, tuple(key_states.shape)))
            return key_states, value_states

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
            return query_length, 0

        def get_query_offset(self, layer_idx: int = 0) -> int:
            return 0

        def __len__(self):
            return 2

    with torch.inference_mode():
        llama(input_ids=IDS, position_ids=torch.arange(5).expand(2, 5), use_cache=True,
              **cache_argument(llama, Recording()))
    assert seen == [(0, (2, 2, 5, 16)), (1, (2, 2, 5, 16))]


def test_logits_to_keep_tensor_keeps_those_positions(llama):
    with torch.inference_mode():
        full = llama(input_ids=IDS).logits
        kept = llama(input_ids=IDS, logits_to_keep=torch.tensor([0, 3])).logits
    assert kept.shape == (2, 2, 96)
    assert torch.allclose(kept, full[:, [0, 3]], atol=1e-6)


def test_interface_checks(llama):
    assert tree_attention.support(llama) is None  # on the attention interface
    assert isinstance(llama.config._attn_implementation_internal, (str, type(None)))


@pytest.mark.parametrize("attention", ["tree", "dense"])
def test_genback_forwards_use_no_deprecated_name(tiny_hf, gpt2_tok, attention):
    """genback's own forwards (a first one, then one over the cached past) raise no warning:
    on transformers 5.24 the old ``past_key_values`` name would raise a ``FutureWarning``."""
    from genback.llm import AsyncTransformer

    lm = AsyncTransformer(tiny_hf, gpt2_tok, attention=attention)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            first = lm.next_token_logprobs_sync([15496, 995])
            second = lm.next_token_logprobs_sync([15496, 995, 11])
        assert lm.cache_info()["tokens_forwarded"] == 3  # the second forward used the cache
        want = lm.next_token_logprobs_uncached([15496, 995, 11])
        assert (second - want).abs().max() < 1e-5 and first.shape == second.shape
    finally:
        lm.close()
