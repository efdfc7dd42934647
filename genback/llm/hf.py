"""``AsyncTransformer``: a Hugging Face causal LM behind the auto-batched ``AsyncLM`` API.

Each batch is planned against the KV prefix tree (:mod:`genback.kvtree`): every query forwards
only the tokens after its longest cached prefix, and every forwarded token's KV is stored for
later queries. Rows with different cached lengths share one forward: their pasts are left-padded
to the longest (masked out), their new tokens right-padded, and positions are given explicitly,
so each row sees exactly its own context (the usual left-padded KV-cache batching of
``transformers.generate``).
"""

from __future__ import annotations

import torch

from ..kvtree import KVTree
from .base import AsyncLM, Query
from .inputs import check_positive_int


class AsyncTransformer(AsyncLM):
    """Async, auto-batched next-token log-probs from a Hugging Face causal LM, with KV reuse.

    Args:
        hf_model: a ``transformers`` causal LM (``AutoModelForCausalLM``) in eval mode, on any device.
        hf_tokenizer: its tokenizer.
        batch_size: most distinct queries per batch (>= 1).
        timeout: alias of ``batch_window`` kept for genlm-backend callers (seconds).
        batch_window: seconds a batch waits for more queries, from its first query (default 2 ms).
        max_batch_tokens: most new tokens forwarded per batch (>= 1).
        kv_budget_bytes: most bytes of KV kept in the prefix tree (default 2 GiB); least recently
            used leaves are evicted beyond it and recomputed when asked again.
        row_cache_size: most next-token rows kept (float32 ``[V]`` each).

    Rows are float32 on the CPU, whatever the model's dtype and device.

    Raises:
        ValueError: an option out of range.
    """

    def __init__(
        self,
        hf_model,
        hf_tokenizer,
        batch_size: int = 32,
        timeout: float | None = None,
        *,
        batch_window: float = 0.002,
        max_batch_tokens: int = 4096,
        kv_budget_bytes: int = 2 << 30,
        row_cache_size: int = 1024,
    ):
        self.model = hf_model.eval()
        self.device = next(hf_model.parameters()).device
        width = hf_model.get_output_embeddings().weight.shape[0]
        super().__init__(
            hf_tokenizer,
            vocab_size=width,
            batch_size=batch_size,
            batch_window=batch_window if timeout is None else timeout,
            max_batch_tokens=max_batch_tokens,
            row_cache_size=row_cache_size,
        )
        self._tree = KVTree(check_positive_int(kv_budget_bytes, "kv_budget_bytes"))
        self.max_context_length = getattr(hf_model.config, "max_position_embeddings", None)
        self._pad_id = 0
        self._hot = None  # (row of each context, per-layer KV) of the last unpadded forward
        self.forwards = 0
        self.tokens_forwarded = 0  # real (unpadded) tokens
        self.padded_tokens_forwarded = 0

    @classmethod
    def from_name(cls, model_id: str = "smollm2-135m", bitsandbytes_opts=None, hf_opts=None,
                  **kwargs) -> "AsyncTransformer":
        """Load a model by embedded alias, local folder or Hub id (fp32 on CPU by default).

        Args:
            model_id: ``"smollm2-135m"`` (default), a local HF folder, or a Hub id.
            bitsandbytes_opts: options of a ``BitsAndBytesConfig`` (needs bitsandbytes and CUDA).
            hf_opts: extra ``from_pretrained`` options (e.g. ``{"dtype": torch.bfloat16,
                "device_map": "cuda"}``).
            **kwargs: passed to the constructor.

        Raises:
            ValueError: unknown alias / missing folder, or the model cannot be loaded offline.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..registry import resolve

        path = resolve(model_id)
        opts = {"dtype": torch.float32}
        opts.update(hf_opts or {})
        if bitsandbytes_opts:
            from transformers import BitsAndBytesConfig

            opts["quantization_config"] = BitsAndBytesConfig(**bitsandbytes_opts)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, **opts)
        except OSError as exc:
            from ..registry import EMBEDDED_MODELS

            raise ValueError(
                f"model {model_id!r} could not be loaded: it is not an embedded alias "
                f"{sorted(EMBEDDED_MODELS)} or a local folder, and loading it as a Hub id failed "
                f"({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            ) from exc
        return cls(model, tokenizer, **kwargs)

    # -- statistics and caches ------------------------------------------------------------------

    def cache_info(self) -> dict:
        info = super().cache_info()
        with self._forward_lock:
            info.update(
                forwards=self.forwards,
                tokens_forwarded=self.tokens_forwarded,
                padded_tokens_forwarded=self.padded_tokens_forwarded,
                kv_bytes=self._tree.bytes_held,
                kv_budget_bytes=self._tree.budget_bytes,
                kv_nodes=len(self._tree),
                # the last unpadded forward's whole KV, kept for the next lockstep batch
                hot_kv_bytes=0 if self._hot is None else sum(
                    k.numel() * k.element_size() * 2 for k, _ in self._hot[1]),
                evictions=self._tree.evictions,
            )
        return info

    def _clear_backend_cache(self) -> None:
        self._tree.clear(keep_pinned=True)
        self._hot = None

    def clear_kv_cache(self) -> None:
        with self._forward_lock:
            self._tree.clear()
            self._hot = None

    def _close_backend(self) -> None:
        self._clear_backend_cache()
        self._tree.clear()

    def cache_kv(self, prompt_tokens, lora_name=None) -> None:
        """Compute ``prompt_tokens``' KV now and pin it: it is never evicted (until
        ``clear_kv_cache``), so every query extending that prompt forwards only its new tokens."""
        self.next_token_logprobs_sync(prompt_tokens, lora_name=lora_name)
        with self._forward_lock:
            if not self._tree.pin(self._check_ids(prompt_tokens, "prompt_tokens")):
                # the row came from the output cache and the KV had been evicted: recompute it
                self._compute([Query(self._check_ids(prompt_tokens, "prompt_tokens"))])
                self._tree.pin(self._check_ids(prompt_tokens, "prompt_tokens"))

    def _cost(self, query: Query) -> int:
        return max(1, len(query.tokens))

    def _check_ids(self, token_ids, name="token_ids"):
        ids = super()._check_ids(token_ids, name)
        if self.max_context_length and len(ids) > self.max_context_length:
            raise ValueError(
                f"{name} has {len(ids)} tokens, more than the model's context of "
                f"{self.max_context_length}"
            )
        return ids

    # -- computation --------------------------------------------------------------------------------

    @torch.inference_mode()
    def next_token_logprobs_uncached(self, token_ids, lora_name=None) -> torch.Tensor:
        """Reference: one full forward of ``token_ids`` alone, no cache, no batching.

        Returns float32 CPU ``[V]``.
        """
        ids = self._check_ids(token_ids)
        with self._forward_lock:
            out = self.model(torch.tensor([ids], device=self.device), use_cache=False)
        return torch.log_softmax(out.logits[0, -1].float(), dim=-1).cpu()

    def _compute(self, queries: list[Query]) -> list[torch.Tensor]:
        shared = _shared_prefixes([q.tokens for q in queries], self._cached_length)
        # prefill prefixes that several queries share but nobody has cached, once each; nested
        # prefixes go in rounds, shortest first, so a longer one reuses the shorter one's KV
        for level in _nesting_levels(shared):
            self._run([Query(prefix, ()) for prefix in level])
        return self._run(queries)

    def _cached_length(self, tokens) -> int:
        return self._tree.match(tokens)[1]

    def _run(self, queries: list[Query]) -> list[torch.Tensor]:
        plans = []
        try:
            for q in queries:
                # logits are needed from position len(tokens) - n_outputs on, so at least the
                # tokens from there are forwarded even when their KV is cached
                segments, cached, holder = self._tree.match(q.tokens, len(q.tokens) - q.n_outputs)
                self._tree.acquire(holder)
                plans.append(_Plan(q, segments, cached, holder))
            todo = [p for p in plans if p.cached < len(p.query.tokens)]  # KV-only may be done
            for group in _group_by_length(todo, self.max_batch_tokens):
                self._forward(group)
            for p in todo:
                self._tree.insert(p.query.tokens, p.cached, p.new_kv)
                p.new_kv = None
        finally:
            for p in plans:
                self._tree.release(p.holder)
            self._tree.evict()
        return [p.result for p in plans]

    def _forward(self, group: list["_Plan"]) -> None:
        from transformers import DynamicCache

        n = len(group)
        past_lens = [p.cached for p in group]
        new_lens = [len(p.query.tokens) - p.cached for p in group]
        max_past, max_new = max(past_lens), max(new_lens)
        dev = self.device

        input_ids = torch.full((n, max_new), self._pad_id, dtype=torch.long)
        mask = torch.zeros((n, max_past + max_new), dtype=torch.long)
        positions = torch.zeros((n, max_new), dtype=torch.long)
        for i, p in enumerate(group):
            input_ids[i, : new_lens[i]] = torch.tensor(p.query.tokens[p.cached:])
            mask[i, max_past - p.cached: max_past + new_lens[i]] = 1
            positions[i] = torch.arange(p.cached, p.cached + max_new)

        cache = None
        if max_past > 0:
            past = self._hot_past(group, max_past) or self._assemble_past(group, max_past)
            cache = DynamicCache()
            for layer, (keys, values) in enumerate(past):
                # initialise the layer with an empty slice, then hand it the assembled past
                # (``update`` would copy it once more by concatenating onto an empty tensor)
                cache.update(keys[:, :, :0], values[:, :, :0], layer)
                cache.layers[layer].keys, cache.layers[layer].values = keys, values
            del past

        # positions (in the new-token axis) whose logits some row needs
        wanted = sorted({j for p, m in zip(group, new_lens)
                         for j in range(m - p.query.n_outputs, m)})
        keep = torch.tensor(wanted or [max_new - 1], dtype=torch.long, device=dev)
        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids.to(dev),
                # no padding anywhere (e.g. particles of equal length): let the model use its
                # plain causal path, which is faster than a padding mask
                attention_mask=None if bool(mask.all()) else mask.to(dev),
                position_ids=positions.to(dev),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=keep,
            )
            logprobs = torch.log_softmax(out.logits.float(), dim=-1)
            column = {j: k for k, j in enumerate(wanted)}
            layers = out.past_key_values.layers
            # keep this forward's whole KV for the next one if it has no padding: particles that
            # each extend their context by a token then reuse it as is (no assembly copy)
            self._hot = None
            if bool(mask.all()):
                self._hot = ({p.query.tokens: i for i, p in enumerate(group)},
                             [(layer.keys, layer.values) for layer in layers])
            k0 = layers[0].keys
            new_kv = torch.empty((len(layers), 2, n, k0.shape[1], max_new, k0.shape[3]),
                                 dtype=k0.dtype, device=k0.device)
            for j, layer in enumerate(layers):  # the new tokens' KV, one copy
                new_kv[j, 0].copy_(layer.keys[:, :, max_past:])
                new_kv[j, 1].copy_(layer.values[:, :, max_past:])
            for i, p in enumerate(group):
                m = new_lens[i]
                p.new_kv = new_kv[:, :, i, :, :m]
                if p.query.targets == ():  # KV only (a shared-prefix prefill)
                    continue
                if p.query.targets is None:
                    p.result = logprobs[i, column[m - 1]].cpu().clone()
                else:
                    cols = torch.tensor([column[j] for j in range(m - len(p.query.targets), m)])
                    rows = logprobs[i, cols.to(dev)]
                    targets = torch.tensor(p.query.targets, device=dev)
                    p.result = rows.gather(1, targets[:, None])[:, 0].cpu().clone()
        self.forwards += 1
        self.tokens_forwarded += sum(new_lens)
        self.padded_tokens_forwarded += n * max_new


    def _hot_past(self, group: list["_Plan"], max_past: int):
        """The previous forward's KV as this forward's past, if every row extends one of its
        rows by new tokens (rows may be reordered or repeated: then one ``index_select``)."""
        hot = self._hot
        if hot is None or any(p.cached != max_past for p in group):
            return None
        index = [hot[0].get(p.query.tokens[:max_past]) for p in group]
        if None in index:
            return None
        if index == list(range(len(hot[0]))):
            return hot[1]
        rows = torch.tensor(index, device=self.device)
        return [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in hot[1]]

    def _assemble_past(self, group: list["_Plan"], max_past: int):
        """Per-layer ``(keys, values)`` ``[rows, heads, max_past, dim]`` from the prefix tree,
        each row left-padded with zeros (masked out) to ``max_past``."""
        layout = next(s for p in group for s in p.segments)  # [layers, 2, heads, len, dim]
        n_layers, _, heads, _, dim = layout.shape
        past = torch.empty((n_layers, 2, len(group), heads, max_past, dim),
                           dtype=layout.dtype, device=layout.device)
        for i, p in enumerate(group):
            pos = max_past - p.cached
            if pos:
                past[:, :, i, :, :pos].zero_()
            for seg in p.segments:
                past[:, :, i, :, pos: pos + seg.shape[3]].copy_(seg)
                pos += seg.shape[3]
        return [(past[layer, 0], past[layer, 1]) for layer in range(n_layers)]


class _Plan:
    __slots__ = ("query", "segments", "cached", "holder", "new_kv", "result")

    def __init__(self, query: Query, segments, cached: int, holder):
        self.query = query
        self.segments = segments
        self.cached = cached
        self.holder = holder
        self.new_kv = None
        self.result = None


def _group_by_length(plans: list[_Plan], max_tokens: int) -> list[list[_Plan]]:
    """Split a batch into forwards whose right-padding wastes at most half of the tokens.

    Plans are sorted by new-token count (longest first) and a group grows while
    ``size * longest <= 2 * real tokens`` and ``size * longest <= max_tokens`` (a single plan may
    exceed ``max_tokens``). Decode steps (one new token each) always share one forward.
    """
    order = sorted(plans, key=lambda p: len(p.query.tokens) - p.cached, reverse=True)
    groups: list[list[_Plan]] = []
    group: list[_Plan] = []
    longest = real = 0
    for p in order:
        m = len(p.query.tokens) - p.cached
        if group:
            size = len(group) + 1
            if size * longest > 2 * (real + m) or size * longest > max_tokens:
                groups.append(group)
                group = []
        if not group:
            longest, real = m, 0
        group.append(p)
        real += m
    if group:
        groups.append(group)
    return groups


def _shared_prefixes(contexts: list[tuple[int, ...]], cached_length, min_gain: int = 2):
    """Prefixes that two or more contexts share beyond their cached part (at least ``min_gain``
    tokens beyond it), distinct and sorted; forwarding them once first saves re-forwarding them
    for every context (e.g. the first step of particles that all extend one uncached prompt)."""
    if len(contexts) < 2:
        return []
    order = sorted(set(contexts))
    lcp = [0] * len(order)  # lcp[i]: common prefix length of order[i-1] and order[i]
    for i in range(1, len(order)):
        a, b = order[i - 1], order[i]
        n = min(len(a), len(b))
        k = 0
        while k < n and a[k] == b[k]:
            k += 1
        lcp[i] = k
    found = set()
    for i, tokens in enumerate(order):
        share = max(lcp[i], lcp[i + 1] if i + 1 < len(order) else 0)
        share = min(share, len(tokens) - 1)  # the last token is forwarded by the query itself
        if share >= min_gain and share - cached_length(tokens[:share]) >= min_gain:
            found.add(tokens[:share])
    return sorted(found)


def _nesting_levels(prefixes: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Split sorted, distinct ``prefixes`` into levels: level k holds those with exactly k proper
    prefixes among the others (a prefix sorts before its extensions, so one stack pass does it)."""
    levels: list[list[tuple[int, ...]]] = []
    stack: list[tuple[int, ...]] = []
    for p in prefixes:
        while stack and p[: len(stack[-1])] != stack[-1]:
            stack.pop()
        if len(stack) == len(levels):
            levels.append([])
        levels[len(stack)].append(p)
        stack.append(p)
    return levels
