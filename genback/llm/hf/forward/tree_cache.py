"""``TreeCache``: the transformers ``Cache`` of a tree-attention forward.

Each layer hands it its new keys/values; it writes them once into the pool slots the forward
took for its new tokens (:class:`~..cache.kv_pool.KVPool`; the runner then stores those slots in the KV
tree) and returns them unchanged, so the layer's attention
(:func:`~genback.llm.hf.forward.attention.tree_attention`) sees the new tokens' KV and reads the
past from the pool itself. Positions are always given explicitly.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import Cache

from .attention import TreeBatch


class TreeCache(Cache):
    """A cache that keeps no past of its own: the KV tree holds it."""

    def __init__(self, batch: TreeBatch):
        super().__init__(layers=[])
        self.batch = batch
        self.n_layers = batch.pool.layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs):
        # key_states / value_states: [R, kv_heads, m, dim] -> the pool's [kv_heads, R * m, dim]
        R, H, m, D = key_states.shape
        self.batch.pool.write(layer_idx, self.batch.new_slots,
                              key_states.transpose(0, 1).reshape(H, R * m, D),
                              value_states.transpose(0, 1).reshape(H, R * m, D))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return self.n_layers


def cache_argument(model, cache) -> dict:
    """``{name: cache}``, the keyword argument by which ``model``'s forward takes a KV cache:
    ``cache`` from transformers 5.24 on, ``past_key_values`` before (5.24 still takes the old
    name, with a ``FutureWarning``, until 5.40)."""
    return {_cache_parameter(type(model)): cache}


@functools.lru_cache(maxsize=None)
def _cache_parameter(model_class) -> str:
    forward = getattr(model_class, "forward", None)
    try:
        parameters = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):  # no signature to read: the name every release takes
        parameters = {}
    return "cache" if "cache" in parameters else "past_key_values"


def returned_cache(output):
    """The KV cache a forward returned, or None: ``output.cache`` from transformers 5.24 on,
    ``output.past_key_values`` before (a deprecated alias of ``cache`` in 5.24)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)
