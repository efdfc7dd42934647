"""Level 0's keys and values kept across decode steps (``DecodeStep.keep_level0``).

The cascade's level 0 (:mod:`.cascade`) is the prefix every row of a step shares: in an SMC run,
the prompt, the same slots step after step. Gathered from the pool by every layer of every step,
it is most of a 16-row step's KV copies (an 8B Llama on an H100, 16 x 1,000 tokens: 0.55 ms of
gathers a step in 64 kernels, level 0's 1,024 slots against level 1's 16 x 32;
``benchmarks/RESULTS.md``, "Issue 38, part 1 on an H200 and an H100 (session 59)"). Kept, it is
copied for all layers at once (:meth:`~..cache.kv_pool.KVPool.gather_layers`) when the step's
prefix changes, and each layer of each step reads its part in place.

A kept copy stays valid while the pool has freed no slot since it was made and its store has
not moved (:class:`~..cache.kv_pool.KVPool`'s ``frees`` and ``version``): a slot's KV is written
when the slot is handed out, and a slot is handed out again only after it was freed (the rule
the decode step's lanes follow, :mod:`..plan.lanes`). The prefix's padding (the dummy slot 0,
masked by the step's bias) is copied with it: finite values, as the per-layer gather reads.
"""

from __future__ import annotations

import numpy as np
import torch

from ..cache.kv_pool import KVPool


class KeptPrefix:
    """Level 0's KV of every layer for one prefix bucket of ``Pb`` slots.

    Attributes:
        kv: ``[layers, 2, kv_heads, Pb, head_dim]`` of the pool's dtype, on its device (a decode
            step's layer ``i`` reads ``kv[i]``, as :meth:`..cache.kv_pool.KVPool.gather` would
            return it).
        slots: the host slots (``int64``, the prefix's real length) ``kv`` holds, or None.
        copies: how many times ``kv`` was (re)filled.
    """

    __slots__ = ("kv", "slots", "frees", "version", "copies")

    def __init__(self, pool: KVPool, Pb: int):
        self.kv = torch.zeros((pool.layers, 2, pool.heads, Pb, pool.dim), dtype=pool.dtype,
                              device=pool.device)
        self.slots: np.ndarray | None = None
        self.frees = self.version = -1
        self.copies = 0

    def refresh(self, pool: KVPool, prefix: np.ndarray, index: torch.Tensor) -> None:
        """Make ``kv`` hold the KV at the slots ``prefix`` (host, ``int64``) unless it already
        does. ``index``: the same slots on the device, padded to ``Pb`` with the dummy slot 0
        (the step's buffer, filled before: the copy is ordered after it on the stream)."""
        held = self.slots
        if (held is not None and self.frees == pool.frees and self.version == pool.version
                and (held is prefix or (len(held) == len(prefix)
                                        and np.array_equal(held, prefix)))):
            return
        pool.gather_layers(index, out=self.kv)
        self.slots, self.frees, self.version = prefix, pool.frees, pool.version
        self.copies += 1


class KeptPrefixes:
    """The :class:`KeptPrefix` of each prefix bucket a decode step used, within ``max_bytes``
    (None: a 32nd of the device's memory on CUDA, 1 GiB elsewhere). A bucket past the budget
    gets none: its steps gather level 0 layer by layer, as without ``keep_level0``."""

    def __init__(self, pool: KVPool, max_bytes: int | None = None):
        if max_bytes is None:
            max_bytes = (torch.cuda.get_device_properties(pool.device).total_memory // 32
                         if pool.device.type == "cuda" else 1 << 30)
        self.pool, self.max_bytes = pool, max_bytes
        self.kept: dict[int, KeptPrefix] = {}
        self.nbytes = 0
        self._copies = 0  # (of kept prefixes dropped by clear)

    def get(self, Pb: int) -> KeptPrefix | None:
        """The kept prefix of bucket ``Pb`` (made on first use), or None past the budget."""
        kept = self.kept.get(Pb)
        if kept is None:
            nbytes = Pb * self.pool.token_bytes
            if self.nbytes + nbytes > self.max_bytes:
                return None
            kept = self.kept[Pb] = KeptPrefix(self.pool, Pb)
            self.nbytes += nbytes
        return kept

    @property
    def copies(self) -> int:
        """Copies made so far (each one ``index_select`` of a prefix for all layers)."""
        return self._copies + sum(k.copies for k in self.kept.values())

    def clear(self) -> None:
        """Drop every kept prefix (with the graphs that read them)."""
        self._copies = self.copies
        self.kept.clear()
        self.nbytes = 0


__all__ = ["KeptPrefix", "KeptPrefixes"]
