"""A next-token row's memory: who makes each copy of a row, who keeps it, and in what blocks.

A row is float32 ``[V]`` (``V`` the logit width). Its life, and the one rule at each step:

1. **Made** by a runner's forward: :func:`log_softmax_rows` computes a step's rows as views of
   blocks (on an accelerator one block per step, one kernel; in host memory blocks of
   :data:`HOST_BLOCK_BYTES`, which malloc recycles).
2. **Kept** by the output cache (:class:`genback.core.output_cache.OutputCache`): it keeps the
   view it was given (or the :class:`BlockRow` of a block of copies, see 3), and at a row's
   first hit a compact copy (:func:`compact`), so a hot row does not keep its step's block
   alive after its siblings left.
3. **Handed out**: every caller gets a tensor of its own, never the cache's or another caller's.
   A runner's rows are its callers' own already (every runner returns fresh rows: a view of a
   block it made for this batch, or a clone), so the batcher's callers of host rows get them as
   they are and the cache keeps a copy of them instead, in blocks (:func:`kept_copies`), each
   row a :class:`BlockRow` (a block and an index: no tensor view is made for a row the cache
   never hands out); a step's rows, as :func:`log_softmax_rows` made them, are copied a block
   at a time (it notes them, per thread, until :func:`copy_blocks` takes them: at most one
   step's rows a thread). On an accelerator the cache keeps the runner's rows and the callers get
   copies made in blocks (:func:`owned_copies`), since the runner's block there is the whole
   step's. The second and later callers of one query in a batch, a caller served from the
   cache, and the callers of a runner that schedules itself get a clone (:func:`own`, through
   :func:`copy_result` for the batcher).

Block sizes, in one table (every constant below is used here only):

| what | where | block |
|---|---|---|
| log-softmax rows | host memory | :data:`HOST_BLOCK_BYTES` (1 MiB) |
| log-softmax rows | accelerator | the whole step (one kernel) |
| the output cache's copies | host memory | :data:`HOST_BLOCK_BYTES` (1 MiB) |
| callers' copies | accelerator | :data:`DEVICE_COPY_BLOCK_BYTES` (8 MiB) |

Measured (``benchmarks/RESULTS.md``, "Rows in host memory"): one block of a whole step's rows
in host memory was a fresh allocation of ``N x V x 4`` bytes each step (above glibc's largest
mmap threshold, 32 MiB, every page faults when written): SmolLM2's 49,152-wide rows, 256 per
step with 4,096 kept, cost ~115-260 µs per row that way and ~43 µs in blocks of 4 rows; a
``clone`` per caller cost 80 µs per row against 26 µs in 1 MiB blocks. On an accelerator a
``clone`` is a kernel launch each (256-512 of a 256-particle step's ~1,100 launches on an
H100); a row a caller keeps keeps its block alive, so callers' blocks are bounded (8 MiB) rather
than one per step (256 rows of a 128k vocabulary: 128 MiB).
"""

from __future__ import annotations

import operator
import threading
from itertools import repeat

import torch

HOST_BLOCK_BYTES = 1 << 20
"""Bytes of a block of rows in host memory (log-softmax rows and the output cache's copies)."""

DEVICE_COPY_BLOCK_BYTES = 8 << 20
"""Most bytes of a block of callers' copies on an accelerator."""

# the rows the last log_softmax_rows of this thread made and their blocks, until copy_blocks
# takes them (once) or the next call replaces them: at most one step's rows a thread
_made = threading.local()
_is = operator.is_


def _per_block(row_bytes: int, limit: int) -> int:
    """Rows of ``row_bytes`` per block of at most ``limit`` bytes (at least one)."""
    return max(1, limit // max(1, row_bytes))


def log_softmax_rows(logits: torch.Tensor, row_device: torch.device) -> list[torch.Tensor]:
    """``log_softmax`` of each row of ``logits`` ``[K, V]`` (any float dtype, on the model's
    device) as float32 ``[V]`` tensors on ``row_device``: views of blocks of
    :data:`HOST_BLOCK_BYTES` when they land in host memory, of one block otherwise."""
    K, V = logits.shape
    per = _per_block(4 * V, HOST_BLOCK_BYTES) if row_device.type == "cpu" else K
    on_device = logits.device.type != "cpu"
    # (no op that changes nothing: a dispatch costs more than a step's small tensors need)
    move, f32 = logits.device != row_device, logits.dtype is torch.float32
    if on_device:  # one kernel where it runs; moved to row_device block by block
        logits = torch.log_softmax(logits if f32 else logits.float(), dim=-1)
    out: list[torch.Tensor] = []
    blocks = []
    for a in range(0, K, per):
        block = logits if K <= per else logits[a:a + per]
        if not on_device:
            block = torch.log_softmax(block if f32 else block.float(), dim=-1)
        blocks.append(block.to(row_device) if move else block)
        out.extend(blocks[-1].unbind(0))
    _made.last = (tuple(out), blocks)  # (copy_blocks: these rows are copied block by block)
    return out


def copy_blocks(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of equal-shaped ``rows`` (one device, one dtype) stacked in blocks of at most
    :data:`DEVICE_COPY_BLOCK_BYTES` (:data:`HOST_BLOCK_BYTES` in host memory; at least one row
    each), in order: ``[n_i, *row shape]`` each.

    When ``rows`` are the very rows that the last :func:`log_softmax_rows` on this thread made,
    in its order (a step's rows, copied right after its forward: the object of each compared
    in C), the blocks are copies of its blocks (or of slices of its one block), not stacks of
    the rows: the same bytes, without ``torch.stack``'s work per row (a tensor each; with the
    BlockRows made in C, ``kept_copies`` of 256 rows of 512: 206-241 -> 135-143 µs, this
    project's CPU, best of 300)."""
    limit = HOST_BLOCK_BYTES if rows[0].is_cpu else DEVICE_COPY_BLOCK_BYTES
    per = _per_block(rows[0].nbytes, limit)
    made, _made.last = getattr(_made, "last", None), None  # (one use: a step's rows once)
    if made is not None and len(made[0]) == len(rows) and all(map(_is, rows, made[0])):
        blocks = made[1]
        if len(blocks) == 1:  # (a device's one block, or one host block)
            block = blocks[0]
            return [block.clone()] if len(rows) <= per else [
                block[a:a + per].clone() for a in range(0, len(rows), per)]
        if all(len(b) == per for b in blocks[:-1]):  # (host blocks: this very partition)
            return [b.clone() for b in blocks]
    if len(rows) <= per:  # (one block: no comprehension's frame)
        return [torch.stack(rows)]
    return [torch.stack(rows[a:a + per]) for a in range(0, len(rows), per)]


def made_blocks(rows: list) -> list[torch.Tensor] | None:
    """The blocks of ``rows`` when they are, in order, the very rows that the last
    :func:`log_softmax_rows` on this thread made (a step's rows, right after its forward), else
    None. Nothing is taken: :func:`copy_blocks` still finds them."""
    made = getattr(_made, "last", None)
    if made is not None and len(made[0]) == len(rows) and all(map(_is, rows, made[0])):
        return made[1]
    return None


class StepRows(list):
    """A compute step's results (a list, one per query) whose rows are, in order, the rows of
    ``blocks`` (:func:`made_blocks`), for a caller that wants them as one ``[N, V]`` tensor
    (``batch_next_token_logprobs``): the blocks themselves, which nothing else holds once the
    output cache kept copies of the rows, instead of a stack of the rows."""

    __slots__ = ("blocks",)

    def __init__(self, results, blocks):
        super().__init__(results)
        self.blocks = blocks

    def stacked(self) -> torch.Tensor:
        """The rows as one tensor ``[N, *row shape]`` (the blocks joined)."""
        blocks = self.blocks
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def owned_copies(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of equal-shaped ``rows`` (one device, one dtype), one copy per block
    (:func:`copy_blocks`): each copy a view of its block (a single row: its clone)."""
    if len(rows) == 1:  # (one op, not a stack and an unbind)
        return [rows[0].clone()]
    out: list[torch.Tensor] = []
    for block in copy_blocks(rows):
        out.extend(block.unbind(0))
    return out


class BlockRow(tuple):
    """``(block, index, nbytes)``: row ``index`` of ``block`` (``[n, *row shape]``), as the output
    cache keeps a copy it may never hand out; a tensor view is made only when it is
    (:func:`compact`). ``nbytes``: the row's bytes. (A tuple: made and read in C, no Python
    frame per row.)"""

    __slots__ = ()
    block = property(operator.itemgetter(0))
    index = property(operator.itemgetter(1))
    nbytes = property(operator.itemgetter(2))


def kept_copies(rows: list[torch.Tensor]) -> list[BlockRow]:
    """The output cache's copies of equal-shaped ``rows`` (one device, one dtype), in order: the
    rows stacked in blocks as :func:`copy_blocks` makes them, each row a :class:`BlockRow`."""
    nbytes, out = rows[0].nbytes, []
    for b in copy_blocks(rows):  # (each row's BlockRow made in C: no frame or tuple per row)
        out.extend(map(tuple.__new__, repeat(BlockRow), zip(repeat(b), range(len(b)),
                                                            repeat(nbytes))))
    return out


def own(row: torch.Tensor) -> torch.Tensor:
    """A caller's own copy of a shared row (cached, or another caller's): a clone."""
    return row.clone()


def copy_result(result):
    """The batcher's copy for the second and later callers of one query: a row is cloned
    (:func:`own`); any other result (a score, a choice) is shared."""
    return own(result) if isinstance(result, torch.Tensor) else result


def compact(row):
    """The output cache's copy of a row found again: a view of a larger block, or a
    :class:`BlockRow`, becomes a compact copy (a clone); anything else is kept as it is."""
    if type(row) is BlockRow:
        return row[0][row[1]].clone()
    if type(row) is torch.Tensor and row._base is not None:
        return row.clone()
    return row
