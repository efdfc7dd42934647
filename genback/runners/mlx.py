"""``MlxRunner``: the runner of ``AsyncMlxLM`` (an mlx-lm model with a prefix KV store).

KV reuse. Every evaluated context leaves its per-layer keys and values (``[1, kv_heads, n,
head_dim]`` mx arrays) in a store keyed by its token ids. A query reuses the entry that shares the
longest common prefix with it — not only entries that are prefixes of it: mlx-lm's ``KVCache`` is
trimmable, so the first ``p`` positions of any entry are the KV of its first ``p`` tokens. An entry
that is a strict prefix of a newer one is therefore redundant and is dropped (a particle extended
by one token replaces its parent's entry). Stored arrays are never written: a forward gets a fresh
``KVCache`` whose arrays are exactly ``p`` long, so its first update allocates new arrays. The
store is bounded by a byte budget with LRU eviction; pinned entries (``cache_kv``) stay.

Batching. Queries with the same cached length, context length and output count share one forward:
their cached KV is stacked along the batch axis, so positions and masks need no padding and every
row equals a batch-1 forward. Prefixes that several queries of a batch share but nobody has cached
are forwarded once first. Models whose caches are not plain ``KVCache`` (sliding windows, state
space layers) are computed without reuse.

All MLX work runs on one dedicated thread (MLX streams are per thread on some devices).
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from ..query import Query


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _log_softmax(logits) -> torch.Tensor:
    """float32 mx logits ``[..., V]`` -> float32 torch CPU log-probs, normalised in float64 by
    torch (MLX's fp32 ``logsumexp`` over a 49k vocabulary is off by up to ~2e-4, torch's fp32
    ``log_softmax`` by ~2e-5)."""
    logits = torch.from_numpy(np.array(logits, dtype=np.float32))
    return torch.log_softmax(logits.double(), dim=-1).float()


def _cache_arrays(cache: list) -> list:
    """Every mx array a model's cache list holds (to evaluate them after a forward)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return [x for c in cache for _, x in tree_flatten(c.state) if isinstance(x, mx.array)]


class _Entry:
    __slots__ = ("tokens", "ids", "layers", "nbytes", "pinned")

    def __init__(self, tokens: tuple[int, ...], layers: list, nbytes: int):
        self.tokens = tokens
        self.ids = np.asarray(tokens, dtype=np.int64)
        self.layers = layers  # per layer (keys, values): mx [1, kv_heads, len(tokens), head_dim]
        self.nbytes = nbytes
        self.pinned = False


class PrefixKV:
    """LRU store of per-context KV, bounded by ``budget_bytes`` (pinned entries never evicted)."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.bytes_held = 0
        self.evictions = 0

    def match(self, ids: np.ndarray, limit: int) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with ``ids`` and that length, capped at ``limit``."""
        best, best_len = None, 0
        for entry in self.entries.values():
            n = _lcp(entry.ids, ids)
            if n > best_len:
                best, best_len = entry, n
                if n >= limit:
                    break
        return best, min(best_len, limit)

    def put(self, tokens: tuple[int, ...], layers: list, nbytes: int) -> _Entry:
        old = self.entries.pop(tokens, None)
        if old is not None:
            self.bytes_held -= old.nbytes
        entry = _Entry(tokens, layers, nbytes)
        entry.pinned = old is not None and old.pinned
        for other in list(self.entries.values()):  # strict prefixes are served by the new entry
            if not other.pinned and len(other.tokens) < len(tokens) and \
                    _lcp(other.ids, entry.ids) == len(other.tokens):
                self._drop(other)
        self.entries[tokens] = entry
        self.bytes_held += nbytes
        return entry

    def touch(self, entry: _Entry) -> None:
        if entry.tokens in self.entries:
            self.entries.move_to_end(entry.tokens)

    def _drop(self, entry: _Entry) -> None:
        del self.entries[entry.tokens]
        self.bytes_held -= entry.nbytes

    def evict(self) -> None:
        for entry in list(self.entries.values()):
            if self.bytes_held <= self.budget_bytes:
                return
            if not entry.pinned:
                self._drop(entry)
                self.evictions += 1

    def pinned_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values() if e.pinned)

    def clear(self, keep_pinned: bool) -> None:
        for entry in list(self.entries.values()):
            if not (keep_pinned and entry.pinned):
                self._drop(entry)


class MlxRunner:
    """Batches of :class:`~genback.query.Query` through an mlx-lm model.

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
        self.forwards = 0
        self.tokens_forwarded = 0
        self.tokens_reused = 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genback-mlx")
        self.vocab_size, self.reuse, self._head = self._on_thread(self._probe)

    def _on_thread(self, fn, *args):
        return self._thread.submit(fn, *args).result()

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
        return self._on_thread(self._run_all, list(queries))

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

    def pin(self, tokens: tuple[int, ...]) -> None:
        """Compute the KV of ``tokens`` and keep it until ``clear(keep_pinned=False)``.

        Raises:
            ValueError: the prompt's KV, with what is pinned already, exceeds the KV budget.
        """
        self._on_thread(self._pin, tokens)

    def uncached_row(self, tokens: tuple[int, ...]) -> torch.Tensor:
        """Reference: one fresh forward of ``tokens`` alone (no store, no batching, no chunks);
        float32 CPU ``[V]``."""
        return self._on_thread(self._uncached_row, tokens)

    def _uncached_row(self, tokens: tuple[int, ...]) -> torch.Tensor:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        logits = self.model(mx.array([list(tokens)], dtype=mx.int32),
                            cache=make_prompt_cache(self.model))[0, -1].astype(mx.float32)
        return _log_softmax(logits)

    def close(self) -> None:
        self.store.clear(keep_pinned=False)
        self._thread.shutdown(wait=True)

    # -- planning -------------------------------------------------------------------------------------

    def _pin(self, tokens: tuple[int, ...]) -> None:
        if not self.reuse:
            self._run([Query(tokens, ())])
            return
        existing = self.store.entries.get(tokens)
        if existing is None or not existing.pinned:
            need = len(tokens) * self._token_bytes()
            pinned = self.store.pinned_bytes()
            if pinned + need > self.store.budget_bytes:
                raise ValueError(
                    f"prompt_tokens ({len(tokens)} tokens) need {need:,} bytes of KV; with "
                    f"{pinned:,} bytes pinned already that exceeds kv_budget_bytes="
                    f"{self.store.budget_bytes:,}: raise the budget or pin a shorter prompt")
        self._run([Query(tokens, ())])
        entry = self.store.entries.get(tokens)
        if entry is None:  # covered by a longer entry: keep its first len(tokens) positions
            source, n = self.store.match(np.asarray(tokens, dtype=np.int64), len(tokens))
            assert source is not None and n == len(tokens)
            layers = [(k[:, :, :n, :], v[:, :, :n, :]) for k, v in source.layers]
            entry = self.store.put(tokens, layers, self._nbytes(layers))
        entry.pinned = True
        self.store.evict()

    def _run_all(self, queries: list[Query]) -> list:
        if self.reuse and len(queries) > 1:
            for level in self._shared_prefixes(queries):
                self._run([Query(prefix, ()) for prefix in level])
        results = self._run(queries)
        self.store.evict()
        return results

    def _shared_prefixes(self, queries: list[Query]) -> list[list[tuple[int, ...]]]:
        """Uncached prefixes shared by two or more queries, grouped by length (shortest first)."""
        order = sorted(range(len(queries)), key=lambda i: queries[i].tokens)
        ids = {i: np.asarray(queries[i].tokens, dtype=np.int64) for i in order}
        cached = {i: self.store.match(ids[i], len(queries[i].tokens))[1] for i in order}
        found: set[tuple[int, ...]] = set()
        for a, b in zip(order, order[1:]):
            qa, qb = queries[a], queries[b]
            n = min(_lcp(ids[a], ids[b]), len(qa.tokens) - qa.n_outputs,
                    len(qb.tokens) - qb.n_outputs)
            if n > max(cached[a], cached[b]) + 1:
                found.add(qa.tokens[:n])
        by_len: dict[int, list] = {}
        for prefix in found:
            by_len.setdefault(len(prefix), []).append(prefix)
        return [by_len[n] for n in sorted(by_len)]

    def _run(self, queries: list[Query]) -> list:
        """Match every query against the store, group, forward, store; results in order."""
        results: list = [None] * len(queries)
        groups: dict[tuple[int, int, int], list] = {}
        for i, q in enumerate(queries):
            limit = len(q.tokens) - q.n_outputs
            entry, p = (self.store.match(np.asarray(q.tokens, dtype=np.int64), limit)
                        if self.reuse else (None, 0))
            if q.n_outputs == 0 and p == len(q.tokens):
                self.store.touch(entry)
                continue  # KV-only query already cached
            groups.setdefault((p, len(q.tokens), q.n_outputs), []).append((i, q, entry))
        for (p, length, n_out), members in sorted(groups.items(), key=lambda kv: kv[0][1]):
            rows_per_forward = max(1, self.max_batch_tokens // max(1, min(
                length - p, self.prefill_step_size)))
            for start in range(0, len(members), rows_per_forward):
                chunk = members[start:start + rows_per_forward]
                outs = self._forward([q for _, q, _ in chunk], [e for _, _, e in chunk], p)
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

    def _forward(self, queries: list[Query], entries: list, p: int) -> list:
        """One group: every query has ``p`` cached tokens, the same length and output count.

        Cached KV is stacked to ``[B, kv_heads, p, head_dim]`` per layer; the new tokens
        ``[B, length - p]`` are forwarded in chunks; logits are computed only for the chunk(s)
        holding the output positions.
        """
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        length, n_out = len(queries[0].tokens), queries[0].n_outputs
        if p > 0:
            cache = []
            for layer in range(len(entries[0].layers)):
                c = KVCache()
                c.keys = mx.concatenate([e.layers[layer][0][:, :, :p, :] for e in entries])
                c.values = mx.concatenate([e.layers[layer][1][:, :, :p, :] for e in entries])
                c.offset = p
                cache.append(c)
            for e in entries:
                self.store.touch(e)
            self.tokens_reused += p * len(queries)
        else:
            cache = make_prompt_cache(self.model)
        ids = np.asarray([q.tokens for q in queries], dtype=np.int32)  # [B, length]
        first_out = length - n_out  # logits wanted at positions first_out .. length-1
        if self._head is not None:  # body per chunk, the head only where logits are wanted
            bounds = list(range(p, length, self.prefill_step_size)) + [length]
        else:  # the whole model: keep the logits-free chunks apart from the wanted ones
            bounds = list(range(p, first_out, self.prefill_step_size)) + \
                list(range(first_out, length, self.prefill_step_size)) + [length]
        bounds = sorted(set(max(b, p) for b in bounds))
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
                if queries[0].targets is None:
                    wanted = wanted[:, -1:, :]
                mx.eval(wanted, *_cache_arrays(cache))
                pieces.append(_log_softmax(wanted))  # [B, hi - max(lo, first_out), V]
            else:
                mx.eval(*_cache_arrays(cache))
        self.tokens_forwarded += (length - p) * len(queries)
        if self.reuse:
            for b, q in enumerate(queries):
                layers = [(c.keys[b:b + 1, :, :length, :], c.values[b:b + 1, :, :length, :])
                          for c in cache]
                self.store.put(q.tokens, layers, self._nbytes(layers))
        if n_out == 0:
            return [None] * len(queries)
        logp = torch.cat(pieces, dim=1)  # [B, n_out (rows: 1), V]
        if queries[0].targets is None:
            return [logp[b, -1].clone() for b in range(len(queries))]
        targets = torch.tensor([q.targets for q in queries], dtype=torch.long)  # [B, n_out]
        values = logp.gather(-1, targets[..., None])[..., 0]
        return [values[b].clone() for b in range(len(queries))]
