"""The logits a forward needs: the language-model head runs only at the (path, position)
pairs some output asks for (``logits_to_keep`` and a pre-hook on the output embeddings)."""

from __future__ import annotations

import numpy as np
import torch

from ..plan.batch import Path
from .tree_cache import cache_argument


def output_spans(paths: list[Path]) -> list[tuple[int, int, int]]:
    """``(path index, first, stop)`` per output with logits, paths' outputs in order: the
    positions in the new-token axis (``0 .. m - 1``) whose logits the output needs."""
    return [(i, o.end - o.query.n_outputs - p.cached, o.end - p.cached)
            for i, p in enumerate(paths) for o in p.outputs if o.query.n_outputs]


def ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``int64 [counts.sum()]``: ``starts[i] .. starts[i] + counts[i] - 1`` for each ``i`` in
    order (``starts`` / ``counts`` int64 ``[n]``, counts >= 0), built without a Python step per
    element."""
    total = int(counts.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    first = np.cumsum(counts) - counts  # each run's place in the result
    return np.repeat(starts - first, counts) + np.arange(total, dtype=np.int64)


def kept_positions(spans, R: int) -> tuple[np.ndarray, np.ndarray]:
    """``(wanted, flat)`` of the output ``spans`` ``(path, first, stop)`` of a forward of ``R``
    rows: ``wanted`` int64 ``[W]`` the positions (in the new-token axis) whose logits some output
    needs, sorted, each once (``[0]`` when none: a prefill-only forward keeps one position,
    unused); ``flat`` int64 ``[K]`` the indices into the ``[R, W]`` grid of the (path, position)
    pairs the outputs need, output by output (each output's positions in order). Array work:
    no Python step per position."""
    if not spans:
        return np.zeros(1, dtype=np.int64), np.empty(0, dtype=np.int64)
    rows, first, stop = np.array(spans, dtype=np.int64).T
    counts = stop - first
    at = ragged_arange(first, counts)
    if len(at) == 0:
        return np.zeros(1, dtype=np.int64), at
    if len(at) == 1 or bool((at[1:] > at[:-1]).all()):  # (each position once, in order: the
        # packed row's outputs, or one path's) its column is its place: no sort, no search
        return at, np.repeat(rows, counts) * len(at) + np.arange(len(at), dtype=np.int64)
    wanted = np.unique(at)
    return wanted, np.repeat(rows, counts) * len(wanted) + np.searchsorted(wanted, at)


def run_model(model, input_ids, positions, spans, cache, attention_mask=None, device=None):
    """Forward; return the logits ``[K, V]`` of the positions the outputs need (:func:`kept_positions`).

    The language-model head runs only on those positions: a pre-hook on the output embeddings
    selects them from the hidden states ``[R, W, H]`` of the union of the paths' positions
    (``logits_to_keep``), so paths that need different positions pay for their own only.
    ``spans`` None: one output at each path's last position (a uniform decode step), ``K = R``.
    ``device``: the model's (None: ``model.device``, a walk of its parameters).
    """
    dev = device if device is not None else getattr(model, "device", input_ids.device)
    # (host inputs on a CPU model: no .to, a dispatch that changes nothing)
    on_cpu = dev.type == "cpu" and input_ids.is_cpu and positions.is_cpu
    R, m = input_ids.shape
    if spans is None:
        W, whole_grid = 1, True
    else:
        wanted, positions_kept = kept_positions(spans, R)
        W = len(wanted)
        # the last W positions of every path, each once, in order (a decode step: the one new
        # token of each path): the head runs on exactly the kept grid, so no selection is
        # needed and ``logits_to_keep`` is the count (transformers keeps the last ``W``)
        whole_grid = (wanted[0] == m - W and len(positions_kept) == R * W
                      and bool((positions_kept == np.arange(R * W)).all()))
    flat = head = handle = None
    if not whole_grid:
        flat = torch.from_numpy(positions_kept)
        flat = flat if dev.type == "cpu" else flat.to(dev)
        head = (model.get_output_embeddings() if hasattr(model, "get_output_embeddings")
                else None)

    def select(module, args):  # hidden [R, W, H] -> [1, K, H]
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat)[None],) + args[1:]

    if head is not None:
        handle = head.register_forward_pre_hook(select)
    try:
        with torch.inference_mode():
            out = model(
                input_ids=input_ids if on_cpu else input_ids.to(dev),
                attention_mask=attention_mask,
                position_ids=positions if on_cpu else positions.to(dev),
                use_cache=True,
                **cache_argument(model, cache),
                logits_to_keep=(W if whole_grid else torch.from_numpy(wanted).to(dev)),
            )
    finally:
        if handle is not None:
            handle.remove()
    logits = out.logits
    if head is None and flat is not None:  # no head module to hook: select from the full grid
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, flat)
    return out, logits.reshape(-1, logits.shape[-1])
