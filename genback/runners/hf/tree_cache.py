"""``TreeCache``: the transformers ``Cache`` of a tree-attention forward.

Each layer hands it its new keys/values; it writes them once into the forward's ``new_kv``
buffer (from which the runner stores them in the KV tree) and returns them unchanged, so the
layer's attention (:func:`~genback.runners.hf.tree_attention.tree_attention`) sees only the new
tokens' KV and reads the past from the tree itself. Positions are always given explicitly.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .tree_attention import TreeBatch


class TreeCache(Cache):
    """A cache that keeps no past of its own: the KV tree holds it."""

    def __init__(self, batch: TreeBatch):
        super().__init__(layers=[])
        self.batch = batch
        self.n_layers = batch.new_kv.shape[0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs):
        # key_states / value_states: [R, kv_heads, m, dim]
        self.batch.new_kv[layer_idx, 0].copy_(key_states)
        self.batch.new_kv[layer_idx, 1].copy_(value_states)
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
