"""``HFRunner``: the runner of ``AsyncTransformer`` (a transformers causal LM over a KV tree).

A batch is planned, forwarded and committed to the KV tree (:mod:`.execute`); the runner holds
the model, the KV pool and tree, the forward, and the cache's operations (statistics, pin,
walk, picture, clear). Its ``tree`` is read up to date: a chain of steps not committed yet
(:class:`.chain.StepChain`) is committed first.

LoRA adapters (:mod:`.lora`): a query's ``adapter`` selects its tree root and the adapter the
model runs with; a batch is computed one adapter at a time (one or more forwards each).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ...queries.kinds import Prefill, Query
from ...batching.runner import Capabilities, check_pin_budget
from .cache.kv_pool import CachedNode, KVPool
from .cache.kvtree import KVTree
from .cache.picture import draw
from .chain import StepChain
from .decode.step import DecodeStep
from .forward import attention as tree_attention, varlen
from .execute import Execution
from .forward.dense import DenseForward
from .forward.tree import TreeForward
from .forward.tree_cache import returned_cache
from .lora import LoraAdapters
from .memory import trim_host_memory
from .options import attention_kind, check_device, check_options
from .plan.batch import query_path
from .plan.budget import forward_budget


class HFRunner(Execution):
    """Batches of :class:`~genback.queries.kinds.Query` through a transformers causal LM.

    Args:
        model: a causal LM in eval mode, on any device.
        pad_id: token id used for right padding (its logits are never read).
        kv_budget_bytes: most bytes of KV the tree holds (None: half the device's free memory at
            construction); least recently used leaves are evicted beyond it.
        max_batch_tokens: most new tokens (padding included) one forward computes.
        max_forward_bytes: bound on a forward's working set, attention scores and logits (None:
            a quarter of the free memory, at most 2 GiB); larger queries are answered in pieces
            (:meth:`.plan.budget.ForwardBudget.pieces`), and one that cannot fit fails alone.
        min_shared_tokens: a cached segment under two or more rows is read once for all of them
            when it is at least this many tokens long (:func:`.plan.segments.split_segments`).
        attention: ``"auto"`` (tree attention when the model supports it), ``"tree"`` or
            ``"dense"``.
        row_device: where next-token rows are returned (None: the model's device).
        decode: ``"auto"``, ``"graphs"``, ``"eager"`` or ``"off"``: how uniform decode steps
            run (:mod:`.decode.step`; ``"auto"``: CUDA graphs on a CUDA device with tree
            attention, else the tree path).

    Raises:
        ValueError: an option out of range, ``attention="tree"`` on a model without support,
            or ``decode="graphs"`` off CUDA or without tree attention.
    """

    # decoding steps (Step) answered on the model's device; KV in a prefix tree; LoRA by peft
    capabilities = Capabilities(picks=True, cache_kind="prefix tree", adapters=True)

    def __init__(self, model, *, pad_id: int = 0, kv_budget_bytes: int | None = None,
                 max_batch_tokens: int = 4096, max_forward_bytes: int | None = None,
                 min_shared_tokens: int = 64, attention: str = "auto", row_device=None,
                 decode: str = "auto"):
        self.model = model
        self.device = next(model.parameters()).device
        self.row_device = self.device if row_device is None else check_device(row_device)
        kv_budget_bytes, max_forward_bytes = check_options(
            self.device, kv_budget_bytes, max_batch_tokens, max_forward_bytes,
            min_shared_tokens, attention, decode)
        self.lora = LoraAdapters(model)
        self.pad_id, self.max_batch_tokens = pad_id, max_batch_tokens
        self.max_forward_bytes, self.min_shared_tokens = max_forward_bytes, min_shared_tokens
        self.pool = KVPool(self._probe_kv_shape())  # every cached token's KV, in slots
        self._tree = KVTree(kv_budget_bytes, self.pool)  # (read it as self.tree: see tree)
        self.kv_token_bytes = self.pool.token_bytes
        self.use_tree, self.attention = attention_kind(model, attention)
        kernel = self.use_tree and varlen.kernel_for(self.device, self.pool.dtype, self.pool.dim)
        self.budget = forward_budget(model.config, max_forward_bytes, kernel or None, self.pool.heads)
        if self.use_tree:
            tree_attention.register()
            self.forward = TreeForward(model, self.pool, pad_id=pad_id,
                                       min_shared_tokens=min_shared_tokens,
                                       row_device=self.row_device)
        else:
            self.forward = DenseForward(model, self.pool, pad_id=pad_id,
                                        row_device=self.row_device)
        self.decode_step = self._decode_step(decode)
        self.chain = StepChain(self._tree, self._step_fits) if self.use_tree else None
        self._stepped = None  # the forward that ran the last group (a chain begins there)
        self.forwards = self.tokens_forwarded = self.padded_tokens_forwarded = 0  # (real tokens)
        self.kv_bytes_read = 0  # KV bytes attention read, all forwards and layers
        self._freed_since_trim = 0
        self._inserted: list = []  # nodes inserted by the running call, compacted at its end

    @property
    def tree(self) -> KVTree:
        """The KV tree (:class:`.cache.kvtree.KVTree`), up to date: a chain of steps not
        committed yet (:class:`.chain.StepChain`) is committed first."""
        self._settle()
        return self._tree

    def _decode_step(self, decode: str) -> DecodeStep | None:
        """The :class:`.decode.step.DecodeStep` of ``decode`` (None: uniform steps take the tree
        path).

        Raises:
            ValueError: ``decode="graphs"`` off CUDA or without tree attention.
        """
        cuda = self.device.type == "cuda"
        if decode == "graphs" and not (cuda and self.use_tree):
            raise ValueError(f"decode='graphs' needs a CUDA model with tree attention; this one "
                             f"is on {self.device} with {self.attention} attention")
        graphs = decode == "graphs" or (decode == "auto" and cuda)
        if not self.use_tree or not (graphs or decode == "eager"):
            return None
        return DecodeStep(self.model, self.pool, graphs=graphs, row_device=self.row_device)

    def _probe_kv_shape(self) -> tuple:
        """``(layers, kv_heads, head_dim, dtype, device)`` of the model's KV, from a one-token
        forward."""
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([[self.pad_id]], device=self.device),
                             use_cache=True)
        layers = getattr(returned_cache(out), "layers", None)
        if not layers or getattr(layers[0], "keys", None) is None:
            raise TypeError(
                f"AsyncTransformer needs a causal LM whose forward returns a key/value cache "
                f"(attention layers); {type(self.model).__name__} returns none (state-space "
                f"models such as Mamba have no KV to reuse; AsyncMlxLM serves them)")
        k = layers[0].keys
        return len(layers), k.shape[1], k.shape[3], k.dtype, k.device

    # -- the runner protocol ----------------------------------------------------------------------

    def run(self, queries: Sequence[Query]) -> list:
        """One result per query (see :mod:`genback.queries.kinds`), or the exception that fails only it."""
        results: list = [None] * len(queries)
        if len({q.adapter for q in queries}) == 1:  # (mostly: one adapter, or the base model)
            by_adapter = {queries[0].adapter: range(len(queries))}
        else:
            by_adapter = {}
            for i, q in enumerate(queries):
                by_adapter.setdefault(q.adapter, []).append(i)
        try:
            for adapter, indices in by_adapter.items():  # one adapter's queries at a time
                self.lora.activate(adapter)
                batch = (queries if len(indices) == len(queries)
                         else [queries[i] for i in indices])
                for i, out in zip(indices, self._answer(batch)):
                    results[i] = out
        finally:
            self._evict()
        return results

    def stats(self) -> dict:
        """The runner's counters (``cache_info()``, read without the forward lock: nothing is
        changed here, so a step chain is not committed; ``kv_bytes`` counts its uncommitted KV,
        ``kv_nodes`` the tree's nodes as they stand)."""
        tree, chain = self._tree, self.chain
        pending = chain.pending_tokens * self.kv_token_bytes if chain is not None else 0
        return {
            "forwards": self.forwards,
            "tokens_forwarded": self.tokens_forwarded,
            "padded_tokens_forwarded": self.padded_tokens_forwarded,
            "kv_bytes": tree.bytes_held + pending,
            "kv_budget_bytes": tree.budget_bytes,
            "kv_nodes": len(tree),
            "evictions": tree.evictions,
            "kv_merges": tree.merges,
            "kv_bytes_read": self.kv_bytes_read,
            "kv_pool_bytes": self.pool.nbytes,
            "kv_pool_slots_used": self.pool.in_use,
            "attention": self.attention,
            "tree_lane_steps": self.forward.lane_steps if self.use_tree else 0,
            "chained_steps": self.chain.steps_run if self.chain is not None else 0,
            **(self.decode_step.stats() if self.decode_step is not None else {}),
        }

    def clear(self, keep_pinned: bool) -> None:
        self._settle(drop=True)
        self._tree.clear(keep_pinned=keep_pinned)  # (frees the pool's slots)
        trim_host_memory()

    def pin(self, tokens: tuple[int, ...], adapter: int | None = None) -> None:
        """Compute the KV of ``tokens`` (what is not cached) under ``adapter`` and pin it.

        Raises:
            ValueError: the prompt's KV, with what is pinned already, exceeds the KV budget.
        """
        self._settle()
        node = self._tree.find(tokens, adapter)
        if node is None or not node.pinned:
            check_pin_budget(len(tokens), self.kv_token_bytes, self._tree.pinned_bytes(),
                             self._tree.budget_bytes)
        try:
            self.lora.activate(adapter)
            query = Prefill(tokens, adapter)
            self._run_pieces(query, self.budget.piece_paths(query, self._cached)
                             or [query_path(query)])
            if self._tree.find(tokens, adapter) is None:  # cached, ending inside an edge: split
                self._tree.insert(tokens, len(tokens), np.empty(0, dtype=np.int64), adapter)
            self._tree.pin(tokens, adapter)
        finally:
            self._evict()

    def walk(self, tokens: tuple[int, ...], adapter=None) -> tuple["CachedNode", int, object]:
        """genlm-backend's cache walk: ``(node, n, past)`` where ``n`` tokens of ``tokens`` have
        cached KV, ``node`` the deepest node on that path (:class:`CachedNode`) and ``past``
        their KV ``[layers, 2, kv_heads, n, head_dim]`` (a copy; None when ``n == 0``). Reads
        without reordering the LRU."""
        segments, n, node = self.tree.match(tokens, touch=False, adapter=adapter)
        past = (self.pool.read(np.concatenate([s for _, _, s in segments])).clone()
                if segments else None)
        return CachedNode(node, self.pool), n, past

    def picture(self, token_text, max_nodes: int = 200, adapter=None):
        """The KV tree under ``adapter`` as a ``graphviz.Digraph`` (:func:`.cache.picture.draw`)."""
        return draw(self.tree, token_text, max_nodes, adapter)

    @torch.inference_mode()
    def uncached_row(self, tokens: tuple[int, ...], adapter=None) -> torch.Tensor:
        """The reference row: one full forward of ``tokens`` alone under ``adapter``, no cache,
        the model's own attention; float32 ``[V]`` on ``row_device``."""
        self.lora.activate(adapter)
        out = self.model(torch.tensor([tokens], device=self.device), use_cache=False)
        return torch.log_softmax(out.logits[0, -1].float(), dim=-1).to(self.row_device)

    def close(self) -> None:
        self._settle(drop=True)
        self._tree.clear()
        if self.decode_step is not None:
            self.decode_step.clear()
        trim_host_memory()

    # -- adapters --------------------------------------------------------------------------------

    def add_adapter(self, path: str) -> int:
        """Load the peft adapter in folder ``path``; return its key (see :mod:`.lora`)."""
        return self.lora.add(path)

    def remove_adapter(self, key: int, error: BaseException | None = None) -> None:
        """Drop adapter ``key``'s KV (pinned too) and unload its weights (called under the
        forward lock: none of its queries is computing, so ``error`` has no one to fail)."""
        self._settle(drop=True)
        self._tree.drop_adapter(key)
        self.lora.remove(key)
