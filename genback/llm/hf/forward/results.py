"""Results from logits: the one place of the HF runner that dispatches on the query kinds.

A :class:`~genback.queries.kinds.NextToken` gets ``log_softmax`` of its position (float32 ``[V]`` on
``row_device``, a view of a block of such rows: :func:`genback.queries.rows.log_softmax_rows`), a
:class:`~genback.queries.kinds.Step` the :class:`~genback.queries.sampling.Choice` made on the device, a
:class:`~genback.queries.kinds.Score` its targets' log-probs (float32 CPU ``[n]``) and with ``greedy``
also whether each target is its position's argmax (bool CPU ``[n]``), a
:class:`~genback.queries.kinds.Prefill` None. Only these leave the device: one transfer for all score
outputs, one for all next-token rows.
"""

from __future__ import annotations

import operator
from itertools import chain

import numpy as np
import torch

from ....queries.kinds import NextToken, Query, Score, Step
from ....queries.rows import log_softmax_rows
from ....queries.sampling import choose_rows
from ..plan.batch import Path
from .logits import ragged_arange

# target log-probs are taken in slices of at most this many bytes of float32 logits: on the CPU
# the temporaries of a slice (128 x 49,152 x 4 bytes = 25 MB on SmolLM2) stay in reused heap
# memory, where slices of 1,024 such positions (200 MB, fresh pages each time) took 3.2x longer
# (0.80 s vs 0.25 s for 4,663 positions on one CPU core, measured); a small vocabulary's slices
# hold more positions (fewer, larger operations: 430 slices of 128 for 55,000 rolling positions
# of a 512-token vocabulary were 0.15 s of host time, measured). On CUDA the caching allocator
# reuses larger blocks and each slice is kernel launches: 128 MiB (~670 positions of a 50,257-token
# vocabulary; a slice's float32 temporaries stay well inside the 2 GiB forward budget's slack,
# which counts every output's logits in float32 while they are bf16)
_SLICE_BYTES = {"cpu": 25 << 20}
_SLICE_BYTES_DEVICE = 128 << 20
_MIN_SLICE = 128


def slice_positions(device: torch.device, vocab: int) -> int:
    """Positions per slice of :func:`_scores` on ``device`` for a vocabulary of ``vocab``: as many
    float32 rows as :data:`_SLICE_BYTES` (CPU) or :data:`_SLICE_BYTES_DEVICE` hold, at least
    :data:`_MIN_SLICE`."""
    budget = _SLICE_BYTES.get(device.type, _SLICE_BYTES_DEVICE)
    return max(_MIN_SLICE, budget // (4 * max(1, vocab)))


def results(queries: list[Query], logits: torch.Tensor, row_device: torch.device) -> list:
    """The result of each query (see :mod:`genback.queries.kinds` and this module's docstring) from
    ``logits`` ``[K, V]`` (on the model's device): the needed positions of the queries in
    order, ``n_outputs`` each."""
    if len(queries) == logits.shape[0] and set(map(type, queries)) == {NextToken}:
        # every query a next-token row, one position each (an SMC or decoding step): all rows
        return log_softmax_rows(logits, row_device)
    rows_at, steps_at, steps, scores_at, scores = [], [], [], [], []
    k = 0
    for q in queries:
        match q:
            case NextToken():
                rows_at.append(k)
            case Step():
                steps_at.append(k)
                steps.append(q)
            case Score():
                scores_at.append(k)
                scores.append(q)
        k += q.n_outputs
    dev = logits.device
    rows = iter(log_softmax_rows(logits.index_select(0, torch.tensor(rows_at, device=dev)),
                                 row_device) if rows_at else ())
    chosen = iter(choose_rows(logits.index_select(0, torch.tensor(steps_at, device=dev)),
                              [q.context for q in steps], [q.pick for q in steps])
                  if steps else ())
    scored = iter(_scores(logits, scores_at, scores))
    out: list = []
    for q in queries:
        match q:
            case NextToken():
                out.append(next(rows))
            case Step():
                out.append(next(chosen))
            case Score():
                out.append(next(scored))
            case _:
                out.append(None)
    return out


def _scores(logits: torch.Tensor, first: list[int], scores: list[Score]) -> list:
    """Each :class:`~genback.queries.kinds.Score`'s result from ``logits`` ``[K, V]``, whose rows
    ``first[i] .. first[i] + len(targets) - 1`` are the positions of ``scores[i]``'s targets
    (when the targets are all ``K`` rows, the rows are read in place): float32 CPU log-probs
    ``[n]``, with ``greedy`` paired with bool CPU argmax flags ``[n]``. Taken in slices of
    :func:`slice_positions` positions; one transfer to the CPU for all. The positions and
    targets are arrays (no Python step per target)."""
    if not scores:
        return []
    dev = logits.device
    greedy = any(q.greedy for q in scores)
    counts = np.fromiter(map(_n_targets, scores), dtype=np.int64, count=len(scores))
    total = int(counts.sum())
    tgt = torch.from_numpy(np.fromiter(chain.from_iterable(map(_targets, scores)),
                                       dtype=np.int64, count=total))
    idx = None if total == logits.shape[0] else torch.from_numpy(
        ragged_arange(np.asarray(first, dtype=np.int64), counts))
    if dev.type != "cpu":
        tgt, idx = tgt.to(dev), None if idx is None else idx.to(dev)
    lps, flags = [], []
    step = slice_positions(dev, logits.shape[-1])
    for s in range(0, total, step):
        part = (logits[s:s + step] if idx is None
                else logits.index_select(0, idx[s:s + step])).float()  # [n, V]
        want = tgt[s:s + step, None]
        if greedy:  # argmax flags only when a scoring query asks (not rolling / token_logprobs)
            flags.append(part.argmax(dim=-1) == want[:, 0])
        # log_softmax, not x - logsumexp(x): the latter rounds ~1e-5 lower on CPU
        lps.append(torch.log_softmax(part, dim=-1).gather(1, want)[:, 0])
    lps = (lps[0] if len(lps) == 1 else torch.cat(lps)).cpu()
    flags = ((flags[0] if len(flags) == 1 else torch.cat(flags)).cpu() if greedy else None)
    out, b = [], 0
    for q, n in zip(scores, counts.tolist()):
        out.append((lps[b:b + n], flags[b:b + n]) if q.greedy else lps[b:b + n])
        b += n
    return out


_n_targets, _targets = operator.attrgetter("n_outputs"), operator.attrgetter("targets")


def outputs(paths: list[Path], logits: torch.Tensor, row_device: torch.device) -> list:
    """Each output's result, paths' outputs in order (:func:`results` of their queries)."""
    return results([o.query for p in paths for o in p.outputs], logits, row_device)
