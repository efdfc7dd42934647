"""``HFRunner``: the runner of ``AsyncTransformer`` (a transformers causal LM over a KV tree).

A batch takes three steps, and the runner knows nothing of a forward's insides:

1. **plan** (:mod:`.plan`): a uniform decode step is one level of one path per query
   (:func:`.plan.batch.plan_step`); anything else is levels of paths against the KV tree
   (:func:`.plan.batch.plan_batch`: the work of a query is the tokens it forwards beyond its
   cached prefix), and a query too large for one forward is pieces
   (:meth:`.plan.budget.ForwardBudget.piece_paths`).
2. **execute**: each level's paths are held, grouped into forwards that fit
   (:func:`.plan.batch.group_paths`) and run by one forward of the one contract
   (:class:`.forward.base.ForwardOut`): the decode step (:mod:`.decode.step`) when the group is
   a uniform step it can run, else the tree forward (the dense one for models without the
   attention interface); after the first, young garbage collections may run
   (:func:`genback.cpython.forward_issued`: on a GPU, while it computes).
3. **commit**: each forward's new KV slots go into the tree (:mod:`.cache.kvtree`: a leaf that
   ends where the path's cached prefix does grows in place), the contexts' ends are noted, and
   after the batch the new nodes are compacted and the tree evicted to its budget.

LoRA adapters (:mod:`.lora`): a query's ``adapter`` selects its tree root and the adapter the
model runs with; a batch is computed one adapter at a time (one or more forwards each).
"""

from __future__ import annotations

import operator
from typing import Sequence

import numpy as np
import torch

from ...cpython import forward_issued, inline as inline_hold
from ...queries.context import last_ids
from ...queries.kinds import Prefill, Query
from ...batching.runner import Capabilities, check_pin_budget
from .cache.kv_pool import CachedNode, KVPool
from .cache.kvtree import KVTree
from .cache.picture import draw
from .decode.step import DecodeStep
from .forward import attention as tree_attention, varlen
from .forward.base import ForwardOut
from .forward.dense import DenseForward
from .forward.tree import TreeForward
from .forward.tree_cache import returned_cache
from .lora import LoraAdapters
from .memory import trim_host_memory
from .options import attention_kind, check_device, check_options
from .plan.batch import (Output, Path, group_paths, is_uniform, plan_batch, plan_step,
                         query_path)
from .plan.budget import forward_budget

_tokens, _holder, _cached = (operator.attrgetter("tokens"), operator.attrgetter("holder"),
                             operator.attrgetter("cached"))


class HFRunner:
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
        self.tree = KVTree(kv_budget_bytes, self.pool)
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
        self.forwards = self.tokens_forwarded = self.padded_tokens_forwarded = 0  # (real tokens)
        self.kv_bytes_read = 0  # KV bytes attention read, all forwards and layers
        self._freed_since_trim = 0
        self._inserted: list = []  # nodes inserted by the running call, compacted at its end

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

    def _answer(self, queries: list[Query]) -> list:
        """Results of one adapter's queries: a uniform decode step as one level
        (:func:`.plan.batch.plan_step`); otherwise those too large for one forward in pieces, the
        rest planned together (:func:`.plan.batch.plan_batch`) and executed level by level."""
        results: list = [None] * len(queries)
        step = plan_step(queries, self.tree.ends, queries[0].adapter, self.budget,
                         self.tree.end_node)
        if step is not None:  # an SMC or decoding step
            for output, value in self._execute(step, uniform=True):
                results[output.index] = value
            return results
        fit = []
        for i, q in enumerate(queries):
            try:  # (planned just before they run: a later query may reuse their KV)
                pieces = self.budget.piece_paths(q, self._cached)
            except ValueError as exc:  # fails alone; the others go on
                results[i] = exc
                continue
            if pieces is None:
                fit.append(i)
            else:
                results[i] = self._run_pieces(q, pieces)
        if fit:
            match = self._matcher(queries[fit[0]].adapter)
            for level in plan_batch([queries[i] for i in fit], match):
                for output, value in self._execute(level):
                    results[fit[output.index]] = value
        return results

    def _matcher(self, adapter):
        tree = self.tree
        # (no touch: _execute touches the union of a level's paths once, KVTree.touch_all)
        return lambda q, limit: tree.match(q.tokens, limit, adapter=adapter, parent=q.parent,
                                           touch=False, segments=False)

    def _cached(self, q: Query, limit: int) -> int:
        """Tokens of ``q``'s context cached now, at most ``limit`` (a probe: no LRU change)."""
        return self.tree.match(q.tokens, limit, touch=False, adapter=q.adapter,
                               parent=q.parent, segments=False)[1]

    def _run_pieces(self, q: Query, paths: list[Path]):
        """Run the paths of ``q``'s pieces (:meth:`.plan.budget.ForwardBudget.piece_paths`) one
        forward each, in order; return ``q``'s result (the target slices' log-probs, and greedy
        flags, joined in order)."""
        parts = []
        for path in paths:
            (_, value), = self._execute([path])
            parts.append(value)
        return q.join([v for v in parts if v is not None])  # (prefill pieces: None)

    def stats(self) -> dict:
        tree = self.tree
        return {
            "forwards": self.forwards,
            "tokens_forwarded": self.tokens_forwarded,
            "padded_tokens_forwarded": self.padded_tokens_forwarded,
            "kv_bytes": tree.bytes_held,
            "kv_budget_bytes": tree.budget_bytes,
            "kv_nodes": len(tree),
            "evictions": tree.evictions,
            "kv_merges": tree.merges,
            "kv_bytes_read": self.kv_bytes_read,
            "kv_pool_bytes": self.pool.nbytes,
            "kv_pool_slots_used": self.pool.in_use,
            "attention": self.attention,
            "tree_lane_steps": self.forward.lane_steps if self.use_tree else 0,
            **(self.decode_step.stats() if self.decode_step is not None else {}),
        }

    def clear(self, keep_pinned: bool) -> None:
        self.tree.clear(keep_pinned=keep_pinned)  # (frees the pool's slots)
        trim_host_memory()

    def pin(self, tokens: tuple[int, ...], adapter: int | None = None) -> None:
        """Compute the KV of ``tokens`` (what is not cached) under ``adapter`` and pin it.

        Raises:
            ValueError: the prompt's KV, with what is pinned already, exceeds the KV budget.
        """
        node = self.tree.find(tokens, adapter)
        if node is None or not node.pinned:
            check_pin_budget(len(tokens), self.kv_token_bytes, self.tree.pinned_bytes(),
                             self.tree.budget_bytes)
        try:
            self.lora.activate(adapter)
            query = Prefill(tokens, adapter)
            self._run_pieces(query, self.budget.piece_paths(query, self._cached)
                             or [query_path(query)])
            if self.tree.find(tokens, adapter) is None:  # cached, ending inside an edge: split
                self.tree.insert(tokens, len(tokens), np.empty(0, dtype=np.int64), adapter)
            self.tree.pin(tokens, adapter)
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
        self.tree.clear()
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
        self.tree.drop_adapter(key)
        self.lora.remove(key)

    # -- planning and forwards ----------------------------------------------------------------------

    def _execute(self, level: list[Path], uniform: bool = False) -> list[tuple[Output, object]]:
        """Run one level of a plan: match its paths that are not matched yet, hold their cached
        nodes, forward them in groups (:func:`.plan.batch.group_paths`) and commit each forward's new
        KV to the tree at once (a batch's new KV is never all held at one time). Returns
        ``(output, result)`` pairs. ``uniform``: the level is a uniform decode step
        (:func:`.plan.batch.plan_step`'s), not checked again."""
        answered: list[tuple[Output, object]] = []
        held, new, tree = [], [], self.tree
        try:
            for p in () if uniform else level:
                if p.holder is None:  # (planned paths were matched, and touched, by the plan)
                    _, cached, holder = tree.match(
                        p.tokens, p.limit, touch=False, adapter=p.adapter, segments=False)
                    p.matched(cached, holder)
            held = [p.holder for p in level]
            tree.acquire(*held)
            todo = [p for p in level if p.n_new > 0]  # a prefill may be cached already
            for group in group_paths(todo, self.max_batch_tokens, self.max_forward_bytes,
                                     self.budget.score_bytes, self.budget):
                out = self._forward(group, uniform)
                if inline_hold.hold is not None:  # (no call per forward otherwise)
                    forward_issued()
                answered.extend(zip([o for p in group for o in p.outputs], out.values))
                (self._commit_step if uniform else self._commit)(group, out.new_slots, new)
            answered.extend((o, None) for p in level if p.n_new == 0 for o in p.outputs)
        finally:
            # the LRU order of everything this level used or inserted, each node once (also
            # after an error: an inserted node must be in the LRU)
            tree.touch_all(held + new)
            tree.release(*held)
        return answered

    def _commit(self, group: list[Path], new_slots: list, new: list) -> None:
        """Put each path's new KV (its ``new_slots``) into the tree at once, and note where its
        context ends: a leaf that ends where the path's cached prefix does (held by the path
        alone) grows in place; otherwise a node is inserted (appended to ``new``, to be
        touched with the level's nodes)."""
        tree = self.tree
        for p, slots in zip(group, new_slots):
            holder = p.holder
            if holder.depth == p.cached and tree.extend(holder, p.tokens, slots):
                node = holder  # (touched with the held nodes)
            else:
                node = tree.insert(p.tokens, p.cached, slots, p.adapter, near=holder,
                                   touch=False)
                new.append(node)
            self._inserted.append(node)
            tree.ends.note(p.tokens, node, p.adapter)

    def _commit_step(self, group: list[Path], new_slots: list, new: list) -> None:
        """:meth:`_commit` of a uniform step's paths (one new token each, one adapter) in
        bulk: :meth:`.cache.kvtree.KVTree.grow` and :meth:`.cache.ends.Ends.note_many`, the
        rows' fields read by C-level getters (no call chain per row)."""
        contexts, cached = list(map(_tokens, group)), list(map(_cached, group))
        adapter = group[0].adapter
        nodes, inserted = self.tree.grow(list(map(_holder, group)), contexts, cached,
                                         last_ids(contexts), new_slots, adapter)
        new.extend(inserted)
        self._inserted.extend(nodes)
        self.tree.ends.note_many(contexts, nodes, [n + 1 for n in cached], adapter)

    def _evict(self) -> None:
        """Merge the nodes this call inserted with their single-child ancestors
        (:meth:`.cache.kvtree.KVTree.compact`: nothing is held any more), then evict to the budget;
        every 64 MiB freed, hand the freed heap back to the OS (the tree's many small node
        tensors live on the heap, which glibc does not shrink itself)."""
        for node in self._inserted:
            if node.slots is not None and node.parent is not None:  # (not evicted or merged away)
                self.tree.compact(node)
        self._inserted.clear()
        self.tree.ends.rotate()
        self._freed_since_trim += self.tree.evict()
        if self._freed_since_trim >= 64 << 20 and self.device.type == "cpu":
            trim_host_memory()
            self._freed_since_trim = 0

    def _forward(self, group: list[Path], uniform: bool = False) -> ForwardOut:
        """Forward ``group`` (:class:`.forward.base.ForwardOut`): a uniform decode step of the
        base model through the decode step when it is on and the step fits
        (:meth:`.decode.step.DecodeStep.run`), anything else through the tree (or dense)
        forward."""
        out = None
        uniform = uniform or is_uniform(group)
        if self.decode_step is not None and not self.lora.loaded and uniform:
            out = self.decode_step.run(group)
        if out is None:  # (a uniform step may be laid out from the last one's rows)
            out = self.forward.run(group, uniform)
        n_new = [r.n_new for r in group]
        self.forwards += out.forwards
        self.tokens_forwarded += sum(n_new)
        self.padded_tokens_forwarded += (sum(n_new) if self.budget.packed  # (no padding)
                                         else len(group) * max(n_new))
        self.kv_bytes_read += out.bytes_read
        return out
