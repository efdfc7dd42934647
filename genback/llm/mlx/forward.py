"""The pieces of one group's forward in :class:`~genback.llm.mlx.runner.MlxRunner`: the
cached KV stacked along the batch axis, the chunk bounds of the new tokens, the log-softmax of
the logits wanted, and the answers of the group's query kind."""

from __future__ import annotations

import numpy as np
import torch

from ...queries.kinds import NextToken, Prefill


def log_softmax(logits) -> torch.Tensor:
    """float32 mx logits ``[..., V]`` -> float32 torch CPU log-probs, normalised in float64 by
    torch (MLX's fp32 ``logsumexp`` over a 49k vocabulary is off by up to ~2e-4, torch's fp32
    ``log_softmax`` by ~2e-5)."""
    logits = torch.from_numpy(np.array(logits, dtype=np.float32))
    return torch.log_softmax(logits.double(), dim=-1).float()


def cache_arrays(cache: list) -> list:
    """Every mx array a model's cache list holds (to evaluate them after a forward)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return [x for c in cache for _, x in tree_flatten(c.state) if isinstance(x, mx.array)]


def stacked_cache(entries: list, p: int) -> list:
    """One mlx-lm ``KVCache`` per layer holding the first ``p`` positions of every store entry,
    stacked along the batch axis: keys and values ``[B, kv_heads, p, head_dim]``, offset ``p``."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    cache = []
    for layer in range(len(entries[0].layers)):
        c = KVCache()
        c.keys = mx.concatenate([e.layers[layer][0][:, :, :p, :] for e in entries])
        c.values = mx.concatenate([e.layers[layer][1][:, :, :p, :] for e in entries])
        c.offset = p
        cache.append(c)
    return cache


def chunk_bounds(p: int, length: int, first_out: int, step: int, split_head: bool) -> list[int]:
    """The positions where the chunks of new tokens ``p .. length-1`` start, then ``length``:
    every ``step`` tokens; when the model is not split into body and head (``split_head``
    False), the logits-free chunks (before ``first_out``) are also kept apart from the wanted
    ones."""
    if split_head:  # body per chunk, the head only where logits are wanted
        bounds = list(range(p, length, step)) + [length]
    else:  # the whole model: keep the logits-free chunks apart from the wanted ones
        bounds = list(range(p, first_out, step)) + list(range(first_out, length, step)) + [length]
    return sorted(set(max(b, p) for b in bounds))


def answers(kind: type, queries: list, pieces: list[torch.Tensor]) -> list:
    """The group's results from its log-probs ``pieces`` (float32 ``[B, positions, V]`` each,
    the output positions in order): None per prefill; a row ``[V]`` per next-token query; per
    score, its targets' log-probs ``[n_out]`` (with the greedy flags ``[n_out]`` bool when
    asked)."""
    if kind is Prefill:
        return [None] * len(queries)
    logp = torch.cat(pieces, dim=1)  # [B, n_out (rows: 1), V]
    if kind is NextToken:
        return [logp[b, -1].clone() for b in range(len(queries))]
    targets = torch.tensor([q.targets for q in queries], dtype=torch.long)  # [B, n_out]
    values = logp.gather(-1, targets[..., None])[..., 0]  # [B, n_out]
    greedy = logp.argmax(-1) == targets  # [B, n_out] bool: scoring requests' flags
    return [(values[b].clone(), greedy[b].clone()) if q.greedy else values[b].clone()
            for b, q in enumerate(queries)]
