"""The dense forward, for models without the attention interface: each path's whole past is
gathered (left-padded) into a ``DynamicCache``; the new tokens' KV is copied to fresh pool slots."""

from __future__ import annotations

import numpy as np
import torch

from ..cache.kv_pool import KVPool
from ..plan.batch import Path
from .base import ForwardOut, model_inputs, new_slots, split_new_slots
from .logits import output_spans, run_model
from .results import outputs
from .tree_cache import returned_cache


class DenseForward:
    """The dense forward of the runner's model over its pool (models without the attention
    interface); arguments as :class:`.tree.TreeForward`'s but ``min_shared_tokens``."""

    def __init__(self, model, pool: KVPool, *, pad_id: int, row_device: torch.device):
        self.model, self.pool, self.pad_id, self.row_device = model, pool, pad_id, row_device

    def run(self, paths: list[Path], uniform: bool = False) -> ForwardOut:
        """Forward ``paths`` over their gathered pasts (:class:`.base.ForwardOut`; the new slots
        are freed again if the forward fails). ``uniform`` (a uniform decode step) changes
        nothing here: every forward gathers its pasts from the tree."""
        pool = self.pool
        input_ids, positions, n_new = model_inputs(paths, self.pad_id)
        R, m = input_ids.shape
        P = max(r.cached for r in paths)
        mask, cache = _gathered_past(pool, paths, n_new, P, m)
        slots = new_slots(pool, n_new, m)
        try:
            out, logits = run_model(self.model, input_ids, positions, output_spans(paths), cache,
                                    None if bool(mask.all()) else mask.to(pool.device),
                                    device=pool.device)
            values = outputs(paths, logits, self.row_device)
            _write_new_kv(pool, returned_cache(out).layers, slots, P)
        except BaseException:
            pool.free(slots[slots > 0])
            raise
        return ForwardOut(values, split_new_slots(n_new, slots), pool.token_bytes * R * P)


def _gathered_past(pool: KVPool, paths: list[Path], n_new: list[int], P: int, m: int):
    """``(mask, cache)``: the attention mask long ``[R, P + m]`` (1 attend) and a
    ``DynamicCache`` holding each path's past left-padded to ``P`` tokens (None when ``P`` is
    0), gathered from the pool with one index per layer."""
    from transformers import DynamicCache

    R = len(paths)
    mask = torch.zeros((R, P + m), dtype=torch.long)
    past = np.zeros((R, P), dtype=np.int64)  # each path's past slots, left-padded with slot 0
    for i, r in enumerate(paths):
        mask[i, P - r.cached: P + n_new[i]] = 1
        if r.cached:
            past[i, P - r.cached:] = np.concatenate([s for _, _, s in r.segments])
    if not P:
        return mask, None
    index = torch.from_numpy(past.ravel()).to(pool.device)
    cache = DynamicCache()
    for layer in range(pool.layers):
        kv = pool.gather(layer, index).view(2, pool.heads, R, P, pool.dim).transpose(1, 2)
        # start each layer empty, then hand it the gathered past (no second copy)
        cache.update(kv[0][:, :, :0], kv[1][:, :, :0], layer)
        cache.layers[layer].keys, cache.layers[layer].values = kv[0], kv[1]
    return mask, cache


def _write_new_kv(pool: KVPool, layers, slots, P: int) -> None:
    """Copy the new tokens' KV (each layer's keys/values ``[R, H, P + m, D]`` after ``P``) to
    their pool ``slots`` ``int64 [R, m]``, one copy per layer."""
    R, m = slots.shape
    index = torch.from_numpy(slots.ravel()).to(pool.device)
    for j, layer in enumerate(layers):
        H, D = layer.keys.shape[1], layer.keys.shape[3]
        pool.write(j, index, layer.keys[:, :, P:].transpose(0, 1).reshape(H, R * m, D),
                   layer.values[:, :, P:].transpose(0, 1).reshape(H, R * m, D))
