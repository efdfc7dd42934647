"""``KVPool``: the keys and values of every cached token, in one tensor of token slots.

The KV tree (:mod:`.kvtree`) holds no tensors of its own: a node holds the *slot indices* of
its edge's tokens (``int64 [len(edge)]``, host memory), and the states live here, in
``store`` ``[layers, 2, kv_heads, capacity, head_dim]`` (index 0 keys, 1 values) on the model's
device and dtype. This is the page-size-1 token pool of SGLang's ``TokenToKVPool`` (Zheng et
al. 2024) and the slot table of nano-vllm / vLLM's paged attention with block size 1: extending,
splitting, merging or forking a path edits index arrays; no KV byte moves after the forward that
wrote it.

* A forward takes slots for its new tokens (:meth:`KVPool.alloc`) and each layer writes its new keys
  and values straight into them (:meth:`KVPool.write`); attention reads a path's past with one
  ``index_select`` (:meth:`KVPool.gather`), or as a view where the slots are one ascending run
  (:meth:`KVPool.view`: a prompt prefilled in one forward is).
* Slot 0 is a dummy that always reads as zeros (until a padded lane writes it): the left padding
  of shorter pasts and the padded lanes of a captured decode step point there, masked.
* Slots are owned by exactly one tree node (the tree shares prefixes, so slots need no count of
  their own): eviction returns a node's slots (:meth:`KVPool.free`).

Capacity grows by doubling when a forward needs more free slots than there are (the copy is one
``copy_`` of the used part); the KV tree's byte budget, not the pool, decides what is kept. A
growth changes ``store``, so ``KVPool.version`` counts them: CUDA graphs captured over the old
store are dropped (:mod:`..decode.step`).

Not thread-safe: the runner's forward lock serialises its use.
"""

from __future__ import annotations

import numpy as np
import torch

# slots a new pool starts with (grown by doubling as forwards need more)
INITIAL_SLOTS = 4096


def consecutive_heads(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
    """``[2 * kv_heads, n, head_dim]``, a view: ``key`` and ``value`` (``[kv_heads, n,
    head_dim]`` each) as one tensor of their heads, keys first, when the values' heads continue
    the keys' in memory with the same strides (the key and value blocks of one product's
    columns); None otherwise."""
    H = key.shape[0]
    if (value.data_ptr() - key.data_ptr() != H * key.stride(0) * key.element_size()
            or key.stride() != value.stride() or key.shape != value.shape
            or key.dtype != value.dtype or key.device != value.device
            or key.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()):
        return None  # (the cheap test first: the tree forward's keys and values fail it)
    return key.as_strided((2 * H, *key.shape[1:]), key.stride(), key.storage_offset())


class KVPool:
    """Token slots of KV on the model's device.

    Args:
        layout: ``(layers, kv_heads, head_dim, dtype, device)`` of the model's KV.
        capacity: initial number of slots (slot 0 included).

    Attributes:
        token_bytes: bytes of KV per token, all layers, keys and values (fixed: the dtype
            never changes).
    """

    def __init__(self, layout: tuple, capacity: int = INITIAL_SLOTS):
        self.layers, self.heads, self.dim, self.dtype, self.device = layout
        self.store = self._new_store(max(2, capacity))
        self.token_bytes = self.layers * 2 * self.heads * self.dim * self.store.element_size()
        self.top = 1  # slots >= top were never handed out
        self._free: list[np.ndarray] = []  # freed runs, handed out again before top grows
        self._n_free = 0
        self.version = 0  # growths so far (captured graphs hold the store's address)
        self.in_use = 0
        self.frees = 0  # calls that freed slots (free, clear): slot numbers seen before may
        # hold other KV once this changes (the decode step's lanes check it)

    def _new_store(self, capacity: int) -> torch.Tensor:
        # zeros on CUDA (one memset): a padded lane may read any slot, masked, and a masked
        # NaN still poisons a product; on the CPU untouched pages cost no memory, so only the
        # dummy slot is cleared there (its padding is read only through slot 0)
        shape = (self.layers, 2, self.heads, capacity, self.dim)
        if self.device.type == "cuda":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        store = torch.empty(shape, dtype=self.dtype, device=self.device)
        store[:, :, :, 0].zero_()
        return store

    @property
    def capacity(self) -> int:
        return self.store.shape[3]

    @property
    def nbytes(self) -> int:
        return self.store.numel() * self.store.element_size()


    # -- slots ----------------------------------------------------------------------------------

    def alloc(self, n: int) -> np.ndarray:
        """``int64 [n]`` free slots. A run of 16 or more comes from the never-used end when it
        fits there, so a prefill's slots are one ascending run (read as a view)."""
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        if (n < 16 or self.top + n > self.capacity) and self._n_free >= n:
            return self._take_free(n)
        if self.top + n > self.capacity:
            self._grow(self.top + n)
        slots = np.arange(self.top, self.top + n, dtype=np.int64)
        self.top += n
        self.in_use += n
        return slots

    def _take_free(self, n: int) -> np.ndarray:
        # from the most recently freed runs backwards: O(n), whatever is free in all
        parts, need = [], n
        while need:
            last = self._free[-1]
            if len(last) <= need:
                parts.append(self._free.pop())
                need -= len(last)
            else:
                parts.append(last[len(last) - need:])
                self._free[-1] = last[:len(last) - need]
                need = 0
        slots = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self._n_free -= n
        self.in_use += n
        return slots

    def free(self, slots: np.ndarray) -> None:
        """Return ``slots`` (no longer referenced by any node) to the pool."""
        if len(slots):
            self._free.append(slots)
            self._n_free += len(slots)
            self.in_use -= len(slots)
            self.frees += 1

    def clear(self) -> None:
        """Every slot free again; a store grown past :data:`INITIAL_SLOTS` is released (a new
        one of that size replaces it, so clearing the cache gives its memory back)."""
        self.top, self._free, self._n_free, self.in_use = 1, [], 0, 0
        self.frees += 1
        if self.capacity > INITIAL_SLOTS:
            self.store = self._new_store(INITIAL_SLOTS)
            self.version += 1

    def _grow(self, need: int) -> None:
        capacity = self.capacity
        while capacity < need:
            capacity *= 2
        store = self._new_store(capacity)
        store[:, :, :, : self.top].copy_(self.store[:, :, :, : self.top])
        self.store = store
        self.version += 1

    # -- reads and writes ------------------------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor) -> None:
        """Store a layer's new keys and values.

        slots: long ``[n]`` on the device; key / value: ``[kv_heads, n, head_dim]``. One
        ``index_copy_`` (one kernel) where the values' heads follow the keys' in one tensor
        (:func:`consecutive_heads`: the decode step's fused projections with its RoPE op rotating
        in place, ``decode/rope.py``), else one each."""
        both = consecutive_heads(key, value)
        if both is not None:
            self.store[layer].view(2 * self.heads, -1, self.dim).index_copy_(1, slots, both)
            return
        self.store[layer, 0].index_copy_(1, slots, key)
        self.store[layer, 1].index_copy_(1, slots, value)

    def gather(self, layer: int, index: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """``[2, kv_heads, len(index), head_dim]``: layer ``layer``'s keys and values at the
        slots ``index`` (long, on the device), one ``index_select``, into ``out`` when given
        (contiguous, of that shape).

        The select runs over the layer's store viewed as ``[2 * kv_heads, capacity, head_dim]``
        (dimension 1), the same bytes: on the CPU, PyTorch's ``index_select`` along the third
        of four dimensions copies slice by slice, 2.5-8x slower than along the second of three
        (one core: 300 slots of a 2 x 16 x 2 layout 25 -> 3.5 µs; 8,000 slots of SmolLM2's 3 x
        64 x 2, 3,978 -> 1,558 µs, measured)."""
        flat = self.store[layer].view(2 * self.heads, -1, self.dim)
        if out is None:
            return flat.index_select(1, index).view(2, self.heads, -1, self.dim)
        torch.index_select(flat, 1, index, out=out.view(2 * self.heads, -1, self.dim))
        return out

    def gather_layers(self, index: torch.Tensor, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """``[layers, 2, kv_heads, len(index), head_dim]``: :meth:`gather` of every layer at
        once (one ``index_select`` over the store viewed likewise), into ``out`` when given."""
        n = self.layers * 2 * self.heads
        flat = self.store.view(n, -1, self.dim)
        if out is None:
            return flat.index_select(1, index).view(self.layers, 2, self.heads, -1, self.dim)
        torch.index_select(flat, 1, index, out=out.view(n, -1, self.dim))
        return out

    def view(self, start: int, length: int) -> torch.Tensor:
        """``[layers, 2, kv_heads, length, head_dim]``: the run of slots ``start ..`` in place."""
        return self.store[:, :, :, start:start + length]

    def read(self, slots: np.ndarray) -> torch.Tensor:
        """``[layers, 2, kv_heads, len(slots), head_dim]``: the KV at ``slots`` (a view when they
        are one ascending run, else a copy)."""
        start = run_start(slots)
        if start >= 0:
            return self.view(start, len(slots))
        return self.gather_layers(torch.from_numpy(slots).to(self.device))


def run_start(slots: np.ndarray) -> int:
    """The first slot when ``slots`` is one ascending run (``s, s + 1, ...``), else -1."""
    n = len(slots)
    if n == 0:
        return -1
    first = int(slots[0])
    if n == 1 or (int(slots[-1]) - first == n - 1 and (n == 2 or bool((np.diff(slots) == 1).all()))):
        return first
    return -1

class CachedNode:
    """A KV-tree node as :meth:`..runner.HFRunner.walk` returns it: the node's own attributes (``edge``,
    ``slots``, ``children``, ``depth``, ...) plus genlm-backend's ``past_key_values``: the KV of
    the node's edge, ``[layers, 2, kv_heads, len(edge), head_dim]`` on the model's device (a
    copy gathered from the pool), None for a root."""

    __slots__ = ("node", "pool")

    def __init__(self, node, pool: KVPool):
        self.node, self.pool = node, pool

    @property
    def past_key_values(self):
        slots = self.node.slots
        return None if slots is None else self.pool.read(slots).clone()

    def __getattr__(self, name):
        return getattr(self.node, name)
