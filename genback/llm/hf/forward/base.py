"""The forward contract of the HF runner, and the inputs every forward builds.

Every forward (:class:`.tree.TreeForward`, :class:`.dense.DenseForward`, and the decode step
:class:`..decode.step.DecodeStep`) takes one planned group of paths (:class:`..plan.batch.Path`,
each one row of the forward's input batch) and returns one :class:`ForwardOut`: the result of
each output of the paths, in order, the pool slots where each path's new tokens' KV was
written, and the KV bytes its attention read. The runner commits the new slots to the KV tree;
nothing is written into the plan, and the runner reads nothing else of a forward.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch

from ....queries.context import last_ids
from ..cache.kv_pool import KVPool
from ..plan.batch import Path


@dataclass(slots=True)
class ForwardOut:
    """What one forward of a group of paths returns.

    Attributes:
        values: each output's result (the paths' outputs in order; see :mod:`genback.queries.kinds`).
        new_slots: per path, ``int64 [n_new]``: the pool slots holding its new tokens' KV (a
            uniform step's: one ``int64 [R, 1]`` array, whose rows they are).
        bytes_read: KV bytes the forward's attention read (all layers).
        forwards: model forwards it took (a decode step split into chunks runs several).
    """

    values: list
    new_slots: list | np.ndarray
    bytes_read: int
    forwards: int = 1


def as_long(values, device=None) -> torch.Tensor:
    """int64 tensor of a list of ints (or of equal-length tuples) on ``device``, through NumPy
    (``torch.tensor`` of a 256-int list costs ~29 us on this project's CPU, NumPy ~4 us)."""
    t = torch.from_numpy(np.array(values, dtype=np.int64))
    return t if device is None or device.type == "cpu" else t.to(device)


def last_tokens(paths: list[Path]) -> np.ndarray:
    """``int64 [R]``: each path's last token (a decode step's input), without a Python frame per
    path: :func:`genback.queries.context.last_ids`)."""
    return np.array(last_ids(map(_tokens, paths)), dtype=np.int64)


def cached_lengths(paths: list[Path]) -> np.ndarray:
    """``int64 [R]``: each path's cached length (a decode step's position)."""
    return np.fromiter(map(_cached, paths), dtype=np.int64, count=len(paths))


_tokens, _cached = operator.attrgetter("tokens"), operator.attrgetter("cached")


def model_inputs(paths: list[Path], pad_id: int):
    """input_ids / position_ids ``[R, m]`` (CPU) and the new-token counts: one array built from
    the paths' new tokens (right-padded with ``pad_id``), not a torch call per path."""
    n_new = [p.n_new for p in paths]
    m = max(n_new)
    if m == 1:  # a decode step: each path's last token
        ids = last_tokens(paths)[:, None]
    else:
        pad = (pad_id,) * m
        ids = np.array([p.tokens[p.cached:] + pad[: m - n] for p, n in zip(paths, n_new)],
                       dtype=np.int64)
    cached = cached_lengths(paths)[:, None]
    positions = cached if m == 1 else cached + np.arange(m, dtype=np.int64)
    return torch.from_numpy(ids), torch.from_numpy(positions), n_new


def packed(input_ids: torch.Tensor, positions: torch.Tensor, n_new: list[int], spans: list):
    """:func:`model_inputs`' right-padded ``[R, m]`` inputs as one packed row ``[1, T]`` (``T``
    the real new tokens, row after row: no padding) and the output spans
    (:func:`.logits.output_spans`) ``(path, first, stop)`` in it: ``(0, off + first, off +
    stop)`` with ``off`` the path's first packed token."""
    R, m = input_ids.shape
    n = np.asarray(n_new)
    real = np.arange(m)[None, :] < n[:, None]
    offsets = (np.cumsum(n) - n).tolist()
    spans = [(0, offsets[i] + a, offsets[i] + b) for i, a, b in spans]
    # (NumPy's boolean selection of the host arrays: torch's costs ~1 ms a forward on the CPU)
    return (torch.from_numpy(input_ids.numpy()[real])[None],
            torch.from_numpy(positions.numpy()[real])[None], spans)


def new_slots(pool: KVPool, n_new: list[int], m: int) -> np.ndarray:
    """``int64 [R, m]``: fresh pool slots for each path's new tokens (row-major), the dummy slot
    0 in its right padding (a padded position's KV is written there and never read unmasked)."""
    if m == 1:  # one new token per path (a forwarded path has at least one)
        return pool.alloc(len(n_new))[:, None]
    n = np.asarray(n_new, dtype=np.int64)
    slots = np.zeros((len(n_new), m), dtype=np.int64)
    slots[np.arange(m)[None, :] < n[:, None]] = pool.alloc(int(n.sum()))
    return slots


def split_new_slots(n_new: list[int], slots: np.ndarray):
    """Each path's new slots ``int64 [n_new]`` (rows of ``slots`` ``[R, m]`` without padding):
    a list of them, or ``slots`` itself when every row is one slot (a decode step: its rows
    are the paths' slots, and no array is made per row)."""
    m = slots.shape[1]
    if m == 1:
        return slots
    return [row if n == m else row[:n] for row, n in zip(slots, n_new)]
