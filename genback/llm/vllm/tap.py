"""The row tap: the only genback module vLLM's worker processes import.

``RowTap`` is a vLLM V1 logits processor, registered when the engine is built
(``logits_processors=["genback.llm.vllm.tap:RowTap"]``). For a request whose
``SamplingParams.extra_args["genback_row"]`` is ``[path, slot, width]`` it writes ``log_softmax`` of
the raw float32 logits into row ``slot`` of the float32 file ``path`` (``/dev/shm``), which the
client process maps too, and returns the logits unchanged. Rows thus cross the process boundary
as bytes in shared memory instead of vLLM's sorted, serialised full-vocabulary lists.

:class:`RowSlots` is the client side: segments of rows in shared files, handed out one slot per
in-flight row request and returned when its row has been read. Segments are added, never
replaced, so a slot stays valid while other requests grow the pool.

Importing this module does not import vLLM; the class is defined on first attribute access.
"""

from __future__ import annotations

import math
import os
import tempfile
import weakref

import torch

TAP_FQCN = "genback.llm.vllm.tap:RowTap"
TAP_KEY = "genback_row"  # SamplingParams.extra_args key: [shared file path, row slot, width]


class RowSlots:
    """Row slots in shared files: float32 ``[segment_rows, width]`` per segment.

    Not thread-safe: the vLLM runner uses it from its engine loop thread only.

    Args:
        width: floats per row (the logit width ``V``).
        segment_rows: rows per shared file (each file is ``segment_rows * width * 4`` bytes).
    """

    def __init__(self, width: int, segment_rows: int = 64):
        self.width = width
        self.segment_rows = segment_rows
        self.paths: list[str] = []
        self._rows: list[torch.Tensor] = []
        self._free: list[tuple[int, int]] = []
        self._finalizers = []
        self.redirect = None  # test hook: a path no worker can open replaces the real one

    def acquire(self) -> tuple[int, int]:
        """A free ``(segment, slot)``, its row set to NaN (so an unwritten row is detectable)."""
        if not self._free:
            self._add_segment()
        seg, slot = self._free.pop()
        self._rows[seg][slot].fill_(math.nan)
        return seg, slot

    def release(self, seg: int, slot: int) -> None:
        if seg < len(self._rows):
            self._free.append((seg, slot))

    def spec(self, seg: int, slot: int) -> list:
        """The ``extra_args["genback_row"]`` value for this slot."""
        return [self.redirect or self.paths[seg], slot, self.width]

    def read(self, seg: int, slot: int) -> torch.Tensor | None:
        """A copy of the row (float32 ``[width]``), or None if no worker wrote it."""
        row = self._rows[seg][slot].clone()
        return None if bool(row.isnan().any()) else row

    def _add_segment(self) -> None:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="genback-vllm-rows-", suffix=".f32", dir=folder)
        size = self.segment_rows * self.width
        os.ftruncate(fd, size * 4)
        os.close(fd)
        self._finalizers.append(weakref.finalize(self, _unlink, path))  # also at exit
        rows = torch.from_file(path, shared=True, size=size, dtype=torch.float32)
        seg = len(self._rows)
        self.paths.append(path)
        self._rows.append(rows.view(self.segment_rows, self.width))
        self._free.extend((seg, s) for s in reversed(range(self.segment_rows)))

    @property
    def segments(self) -> int:
        return len(self._rows)

    def close(self) -> None:
        """Unmap and delete every file (idempotent)."""
        self._rows, self._free, self.paths = [], [], []
        for finalize in self._finalizers:
            finalize()
        self._finalizers = []


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def check_tap_spec(tap) -> None:
    """``ValueError`` unless ``tap`` is a ``[path, slot, width]`` list (vLLM runs it at
    admission)."""
    if not (isinstance(tap, (list, tuple)) and len(tap) == 3 and isinstance(tap[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in tap[1:])):
        raise ValueError(f"extra_args[{TAP_KEY!r}] must be [path, slot, width], got {tap!r}")


class _TapBody:
    """The body of ``RowTap``, apart from vLLM's base class (so that importing this module does
    not import vLLM). ``RowTap`` itself is built on first use by :func:`row_tap_class`, which
    sets ``_swap`` to vLLM's ``MoveDirectionality.SWAP``."""

    _swap = None

    def __init__(self, vllm_config, device, is_pin_memory):
        self._taps: dict[int, tuple] = {}  # batch index -> (path, slot, width)
        self._files: dict[str, torch.Tensor] = {}

    @classmethod
    def validate_params(cls, sampling_params):
        tap = (sampling_params.extra_args or {}).get(TAP_KEY)
        if tap is not None:
            check_tap_spec(tap)

    def is_argmax_invariant(self) -> bool:
        return False  # so vLLM applies it for greedy requests too

    def update_state(self, batch_update) -> None:
        if not batch_update:
            return
        for index in batch_update.removed:  # order: removed, added, moved (vLLM's contract)
            self._taps.pop(index, None)
        for index, params, _, _ in batch_update.added:
            tap = (params.extra_args or {}).get(TAP_KEY) if params is not None else None
            if tap is None:
                self._taps.pop(index, None)
            else:
                self._taps[index] = (tap[0], int(tap[1]), int(tap[2]))
        for a, b, direction in batch_update.moved:
            entry_a, entry_b = self._taps.pop(a, None), self._taps.pop(b, None)
            if entry_a is not None:
                self._taps[b] = entry_a
            if entry_b is not None and direction == self._swap:
                self._taps[a] = entry_b

    def _file(self, path: str, width: int):
        """The shared file ``path`` mapped as float32 ``[rows, width]`` (kept mapped), or None
        when this machine has no such file."""
        rows = self._files.get(path)
        if rows is None:
            if not os.path.exists(path):  # another machine: the client falls back
                return None
            if len(self._files) > 256:  # files of closed models: drop the oldest mapping
                self._files.pop(next(iter(self._files)))
            n = os.path.getsize(path) // 4
            rows = torch.from_file(path, shared=True, size=n, dtype=torch.float32)
            rows = self._files[path] = rows.view(-1, width)
        return rows

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # logits: [batch, V]
        if not self._taps:
            return logits
        indices = list(self._taps)
        values = torch.log_softmax(logits[indices].float(), dim=-1).cpu()  # [taps, V] float32
        n = values.shape[-1]
        for k, index in enumerate(indices):
            path, slot, width = self._taps[index]
            rows = self._file(path, width)
            if rows is not None and slot < rows.shape[0]:
                rows[slot, :n].copy_(values[k, :width])
                rows[slot, n:].fill_(-math.inf)  # logits narrower than the row: padding
        return logits


_ROW_TAP = None


def row_tap_class():
    """``RowTap``, defined on first use (vLLM is imported only then)."""
    global _ROW_TAP
    if _ROW_TAP is not None:
        return _ROW_TAP
    from vllm.v1.sample.logits_processor import LogitsProcessor, MoveDirectionality

    class RowTap(_TapBody, LogitsProcessor):
        """vLLM V1 logits processor: copies the log-softmax of the raw float32 logits of the
        requests that ask for it (``extra_args["genback_row"] = [path, slot, width]``) into row
        ``slot`` of the shared file ``path``; returns the logits unchanged. It is applied before
        penalties and sampling, and genback's row requests set no logit-changing option, so the
        logits are the model's own."""

        _swap = MoveDirectionality.SWAP

    RowTap.__module__ = __name__
    RowTap.__qualname__ = "RowTap"
    _ROW_TAP = RowTap
    return RowTap


def __getattr__(name: str):
    # vLLM's workers resolve ``genback.llm.vllm.tap:RowTap`` through this hook
    if name == "RowTap":
        return row_tap_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
