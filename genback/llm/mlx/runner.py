"""``MlxRunner``: the runner of ``AsyncMlxLM`` (an mlx-lm model with a prefix KV store).

KV reuse. Every evaluated context leaves its per-layer keys and values (``[1, kv_heads, n,
head_dim]`` mx arrays) in a store (:mod:`genback.llm.mlx.kv`) keyed by its adapter and token
ids. A query reuses the entry that shares the longest common prefix with it — not only entries
that are prefixes of it: mlx-lm's ``KVCache`` is trimmable, so the first ``p`` positions of any entry are the KV of its first ``p`` tokens. An entry
that is a strict prefix of a newer one is therefore redundant and is dropped (a particle extended
by one token replaces its parent's entry). Stored arrays are never written: a forward gets a fresh
``KVCache`` whose arrays are exactly ``p`` long, so its first update allocates new arrays. The
store is bounded by a byte budget with LRU eviction; pinned entries (``cache_kv``) stay.

Batching. Queries with the same cached length, context length and output count share one forward:
their cached KV is stacked along the batch axis, so positions and masks need no padding and every
row equals a batch-1 forward. Prefixes that several queries of a batch share but nobody has cached
are forwarded once first. Models whose caches are not plain ``KVCache`` (sliding windows, state
space layers) are computed without reuse.

LoRA: queries under different adapters are forwarded apart, each after activating its adapter
(:mod:`genback.llm.mlx.lora`); the base model's forwards run the original modules only.

All MLX work runs on the process's MLX thread (:mod:`genback.llm.mlx.thread`: MLX streams and
compiled functions are per thread, and an MLX thread that exits at shutdown can abort the process).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ...queries.kinds import NextToken, Prefill, Query, Score
from ...batching.runner import Capabilities, check_pin_budget
from .forward import answers, cache_arrays, chunk_bounds, log_softmax, stacked_cache
from .kv import PrefixKV, _lcp
from .thread import on_mlx_thread


def _kind(q: Query):
    """The kind of ``q`` (its query class, :mod:`genback.queries.kinds`), or the error that fails it
    alone: this runner answers rows, scores and prefills (``picks=False``: no ``Step``)."""
    match q:
        case NextToken():
            return NextToken
        case Score():
            return Score
        case Prefill():
            return Prefill
    return ValueError(f"the MLX runner answers rows, scores and prefills, not "
                      f"{type(q).__name__} (picks=False)")


class MlxRunner:
    """Batches of :class:`~genback.queries.kinds.Query` through an mlx-lm model.

    Declares no device-side picks (decoding steps choose on its rows) and loads mlx-lm
    adapters.

    Args:
        model: an mlx-lm model (``mlx_lm.utils.load_model``); called as ``model(ids, cache=...)``
            with ``ids`` int32 ``[B, T]``, returning logits ``[B, T, V]``.
        kv_budget_bytes: most bytes of KV kept (logical size of the stored arrays).
        max_batch_tokens: most new tokens one forward computes (rows x tokens); longer prefills
            are computed in chunks of ``prefill_step_size`` tokens.
        prefill_step_size: tokens per chunk of a long prefill (bounds the logits computed).

    Raises:
        ValueError: an option out of range.
    """

    capabilities = Capabilities(adapters=True)

    def __init__(self, model, *, kv_budget_bytes: int = 1 << 30, max_batch_tokens: int = 2048,
                 prefill_step_size: int = 512):
        for name, value in (("kv_budget_bytes", kv_budget_bytes),
                            ("max_batch_tokens", max_batch_tokens),
                            ("prefill_step_size", prefill_step_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.model = model
        self.max_batch_tokens = max_batch_tokens
        self.prefill_step_size = prefill_step_size
        self.store = PrefixKV(kv_budget_bytes)
        self.adapters = None  # MlxAdapters, made when the first adapter is added
        self.forwards = 0
        self.tokens_forwarded = 0
        self.tokens_reused = 0
        self.vocab_size, self.reuse, self._head = on_mlx_thread(self._probe)

    def _probe(self) -> tuple:
        """``(logit width, whether the model's caches are plain trimmable KVCache, head)``.

        ``head`` maps the model body's hidden states to logits (``model.lm_head`` or the tied
        ``embed_tokens.as_linear``) when the model is exactly body-then-head (checked here on
        a two-token input), so chunks whose logits nobody wants skip the vocabulary projection
        and others project only the positions wanted; None: always the whole model.
        """
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        ids = mx.array([[0, 1]], dtype=mx.int32)
        cache = make_prompt_cache(self.model)
        logits = self.model(ids, cache=cache)
        mx.eval(logits)
        reuse = all(type(c) is KVCache for c in cache)
        head = None
        body = getattr(self.model, "model", None)
        if hasattr(self.model, "lm_head"):
            head = self.model.lm_head
        elif hasattr(getattr(body, "embed_tokens", None), "as_linear"):
            head = body.embed_tokens.as_linear
        if head is not None and callable(body):
            try:
                split = head(body(ids, make_prompt_cache(self.model)))
                mx.eval(split)
                same = split.shape == logits.shape and float(
                    mx.max(mx.abs(split.astype(mx.float32) - logits.astype(mx.float32)))) <= 1e-5
            except Exception:  # noqa: BLE001 - another structure: use the whole model
                same = False
            if not same:
                head = None
        return int(logits.shape[-1]), reuse, head

    # -- the runner protocol ----------------------------------------------------------------------

    def run(self, queries: Sequence[Query]) -> list:
        return on_mlx_thread(self._run_all, list(queries))

    def stats(self) -> dict:
        return {
            "forwards": self.forwards,
            "tokens_forwarded": self.tokens_forwarded,
            "tokens_reused": self.tokens_reused,
            "kv_bytes": self.store.bytes_held,
            "kv_budget_bytes": self.store.budget_bytes,
            "kv_entries": len(self.store.entries),
            "evictions": self.store.evictions,
            "kv_reuse": "prefix" if self.reuse else "none (model caches are not trimmable)",
        }

    def clear(self, keep_pinned: bool) -> None:
        self.store.clear(keep_pinned)

    def add_adapter(self, path: str) -> int:
        """Load the mlx-lm LoRA adapter in folder ``path``; return its key (see
        :mod:`genback.llm.mlx.lora`). Raises ValueError for an adapter that does not fit."""
        return on_mlx_thread(self._add_adapter, path)

    def _add_adapter(self, path: str) -> int:
        from .lora import MlxAdapters

        if self.adapters is None:
            self.adapters = MlxAdapters(self.model)
        wrapped = self.adapters.layout is not None
        key = self.adapters.add(path)
        if not wrapped:  # modules were just wrapped: find the (possibly wrapped) head again
            self._activate(None)
            self._head = self._probe()[2]
        return key

    def remove_adapter(self, key: int, error: BaseException | None = None) -> None:
        """Free adapter ``key`` and every KV entry computed under it (under the forward lock:
        none of its queries is computing, so ``error`` has no one to fail)."""
        on_mlx_thread(self._remove_adapter, key)

    def _remove_adapter(self, key: int) -> None:
        self.store.drop_adapter(key)
        if self.adapters is not None:
            self.adapters.remove(key)

    def _activate(self, adapter: int | None) -> None:
        if self.adapters is not None:
            self.adapters.activate(adapter)

    def pin(self, tokens: tuple[int, ...], adapter: int | None = None) -> None:
        """Compute the KV of ``tokens`` and keep it until ``clear(keep_pinned=False)``.

        Raises:
            ValueError: the prompt's KV, with what is pinned already, exceeds the KV budget.
        """
        on_mlx_thread(self._pin, tokens, adapter)

    def uncached_row(self, tokens: tuple[int, ...], adapter: int | None = None) -> torch.Tensor:
        """Reference: one fresh forward of ``tokens`` alone (no store, no batching, no chunks)
        under ``adapter`` (None: the base model); float32 CPU ``[V]``."""
        return on_mlx_thread(self._uncached_row, tokens, adapter)

    def _uncached_row(self, tokens: tuple[int, ...], adapter: int | None) -> torch.Tensor:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self._activate(adapter)
        logits = self.model(mx.array([list(tokens)], dtype=mx.int32),
                            cache=make_prompt_cache(self.model))[0, -1].astype(mx.float32)
        return log_softmax(logits)

    def close(self) -> None:
        self.store.clear(keep_pinned=False)

    # -- planning -------------------------------------------------------------------------------------

    def _pin(self, tokens: tuple[int, ...], adapter: int | None) -> None:
        if not self.reuse:
            self._run([Prefill(tokens, adapter)])
            return
        existing = self.store.entries.get((adapter, tokens))
        if existing is None or not existing.pinned:
            check_pin_budget(len(tokens), self._token_bytes(), self.store.pinned_bytes(),
                             self.store.budget_bytes)
        self._run([Prefill(tokens, adapter)])
        entry = self.store.entries.get((adapter, tokens))
        if entry is None:  # covered by a longer entry: keep its first len(tokens) positions
            source, n = self.store.match(np.asarray(tokens, dtype=np.int64), len(tokens), adapter)
            assert source is not None and n == len(tokens)
            layers = [(k[:, :, :n, :], v[:, :, :n, :]) for k, v in source.layers]
            entry = self.store.put(tokens, layers, self._nbytes(layers), adapter)
        entry.pinned = True
        self.store.evict()

    def _run_all(self, queries: list[Query]) -> list:
        if self.reuse and len(queries) > 1:
            for level in self._shared_prefixes(queries):
                self._run([Prefill(prefix, adapter) for adapter, prefix in level])
        results = self._run(queries)
        self.store.evict()
        return results

    def _shared_prefixes(self, queries: list[Query]) -> list[list[tuple]]:
        """Uncached prefixes shared by two or more queries of one adapter, as ``(adapter,
        prefix)``, grouped by length (shortest first)."""
        order = sorted(range(len(queries)),
                       key=lambda i: (queries[i].adapter or 0, queries[i].tokens))
        ids = {i: np.asarray(queries[i].tokens, dtype=np.int64) for i in order}
        cached = {i: self.store.match(ids[i], len(queries[i].tokens), queries[i].adapter)[1]
                  for i in order}
        found: set[tuple] = set()
        for a, b in zip(order, order[1:]):
            qa, qb = queries[a], queries[b]
            if qa.adapter != qb.adapter:
                continue
            n = min(_lcp(ids[a], ids[b]), len(qa.tokens) - qa.n_outputs,
                    len(qb.tokens) - qb.n_outputs)
            if n > max(cached[a], cached[b]) + 1:
                found.add((qa.adapter, qa.tokens[:n]))
        by_len: dict[int, list] = {}
        for adapter, prefix in found:
            by_len.setdefault(len(prefix), []).append((adapter, prefix))
        return [by_len[n] for n in sorted(by_len)]

    def _run(self, queries: list[Query]) -> list:
        """Match every query against the store, group, forward, store; results in order. Each
        query's kind is decided here, once (:func:`_kind`); a group holds one kind."""
        results: list = [None] * len(queries)
        groups: dict[tuple, list] = {}
        for i, q in enumerate(queries):
            kind = _kind(q)
            if isinstance(kind, Exception):
                results[i] = kind
                continue
            limit = len(q.tokens) - q.n_outputs
            entry, p = (self.store.match(np.asarray(q.tokens, dtype=np.int64), limit, q.adapter)
                        if self.reuse else (None, 0))
            if kind is Prefill and p == len(q.tokens):
                self.store.touch(entry)
                continue  # KV-only query already cached
            key = (q.adapter or 0, p, len(q.tokens), q.n_outputs, kind)
            groups.setdefault(key, []).append((i, q, entry))
        for (_, p, length, _, kind), members in sorted(groups.items(),
                                                       key=lambda kv: kv[0][:4:2]):
            self._activate(members[0][1].adapter)
            rows_per_forward = max(1, self.max_batch_tokens // max(1, min(
                length - p, self.prefill_step_size)))
            for start in range(0, len(members), rows_per_forward):
                chunk = members[start:start + rows_per_forward]
                outs = self._forward(kind, [q for _, q, _ in chunk], [e for _, _, e in chunk], p)
                for (i, _, _), out in zip(chunk, outs):
                    results[i] = out
        return results

    # -- forwards -------------------------------------------------------------------------------------

    def _token_bytes(self) -> int:
        """KV bytes per token (all layers, keys and values), from a one-token forward."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        if not hasattr(self, "_kv_token_bytes"):
            cache = make_prompt_cache(self.model)
            self.model(mx.array([[0]], dtype=mx.int32), cache=cache)
            self._kv_token_bytes = self._nbytes(
                [(c.keys[:, :, :1, :], c.values[:, :, :1, :]) for c in cache])
        return self._kv_token_bytes

    @staticmethod
    def _nbytes(layers: list) -> int:
        return sum(k.nbytes + v.nbytes for k, v in layers)

    def _forward(self, kind: type, queries: list[Query], entries: list, p: int) -> list:
        """One group: every query is of ``kind`` and has ``p`` cached tokens, the same length
        and output count.

        Cached KV is stacked to ``[B, kv_heads, p, head_dim]`` per layer; the new tokens
        ``[B, length - p]`` are forwarded in chunks; logits are computed only for the chunk(s)
        holding the output positions.
        """
        from mlx_lm.models.cache import make_prompt_cache

        length, n_out = len(queries[0].tokens), queries[0].n_outputs
        if p > 0:
            cache = stacked_cache(entries, p)
            for e in entries:
                self.store.touch(e)
            self.tokens_reused += p * len(queries)
        else:
            cache = make_prompt_cache(self.model)
        ids = np.asarray([q.tokens for q in queries], dtype=np.int32)  # [B, length]
        first_out = length - n_out  # logits wanted at positions first_out .. length-1
        bounds = chunk_bounds(p, length, first_out, self.prefill_step_size, self._head is not None)
        pieces = self._chunks(kind, ids, cache, bounds, first_out)
        self.tokens_forwarded += (length - p) * len(queries)
        if self.reuse:
            for b, q in enumerate(queries):
                layers = [(c.keys[b:b + 1, :, :length, :], c.values[b:b + 1, :, :length, :])
                          for c in cache]
                self.store.put(q.tokens, layers, self._nbytes(layers), q.adapter)
        return answers(kind, queries, pieces)

    def _chunks(self, kind: type, ids: np.ndarray, cache: list, bounds: list[int],
                first_out: int) -> list[torch.Tensor]:
        """Forward ``ids`` (int32 ``[B, length]``) chunk by chunk (``bounds``: :func:`chunk_bounds`)
        through ``cache``; the log-probs of the positions from ``first_out`` on (float32 ``[B,
        positions, V]`` per chunk that holds some; a next-token group's last position only)."""
        import mlx.core as mx

        pieces = []
        for lo, hi in zip(bounds, bounds[1:]):
            chunk = mx.array(ids[:, lo:hi])  # [B, hi - lo]
            self.forwards += 1
            if self._head is not None:
                hidden = self.model.model(chunk, cache)  # [B, hi - lo, hidden]
                logits = (self._head(hidden[:, max(lo, first_out) - lo:, :])
                          if hi > first_out else None)  # [B, wanted, V]
                offset = 0
            else:
                logits = self.model(chunk, cache=cache)  # [B, hi - lo, V]
                offset = max(lo, first_out) - lo
            if hi > first_out:
                wanted = logits[:, offset:, :].astype(mx.float32)
                if kind is NextToken:  # a next-token row: the last position
                    wanted = wanted[:, -1:, :]
                mx.eval(wanted, *cache_arrays(cache))
                pieces.append(log_softmax(wanted))  # [B, hi - max(lo, first_out), V]
            else:
                mx.eval(*cache_arrays(cache))
        return pieces
