"""A decode step's rows in chunks: a step too wide for one forward of the decode step
(:meth:`.step.DecodeStep.layout` declines it) runs as halves, then quarters of its rows, one
forward each (:class:`Chunks`, a mixin of :class:`.step.DecodeStep`), and the next step with as
many rows is split alike at once, each chunk laid out from the same chunk of the last step
(:class:`..plan.lanes.Lanes`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..plan.lanes import REFRESH
from .cascade import StepLayout

# most chunks of rows one step is split into when it does not fit one forward (halves, then
# quarters), else it takes the tree path. Each chunk is one more replay, which reads the weights
# again: on an H100 a 1B step's GPU time is 3.7-7.9 ms and the tree path's step 28-59 ms
# (benchmarks/RESULTS.md, "GPU: the captured decode step"), so four replays stay well under the
# eager tree path; the bound is to be measured with an 8B model
MAX_CHUNKS = 4


@dataclass(slots=True)
class Chunk:
    """Rows ``group[start:stop]`` of a step, and their forward's :class:`.cascade.StepLayout`."""

    start: int
    stop: int
    layout: StepLayout


class Chunks:
    """:meth:`layouts` of :class:`.step.DecodeStep` (its ``layout``, ``pool``, ``_lanes``,
    ``_rows``, ``_split_age`` and counters)."""

    def layouts(self, group) -> list[Chunk] | None:
        """The step as contiguous :class:`Chunk` s of rows in order, each with its
        :meth:`.step.DecodeStep.layout` (its new slots taken from the pool). One chunk when the step fits one
        forward; else 2, then :data:`MAX_CHUNKS` equal chunks. A step with as many rows as
        the last one, which was split, is split alike at once (each chunk laid out from the
        same chunk of the last step when its rows extend those, :class:`..plan.lanes.Lanes`), the
        whole tried again every :data:`..plan.lanes.REFRESH` steps. None (nothing taken) if none fit."""
        R = len(group)
        split_alike = len(self._lanes) > 1 and R == self._rows and self._split_age < REFRESH
        n = len(self._lanes) if split_alike else 1
        while n <= MAX_CHUNKS and n <= max(1, R):
            chunks = self._chunks(group, n)
            if chunks is not None:
                self._split_age = 0 if n == 1 else (self._split_age + 1 if split_alike else 1)
                self.split_steps += n > 1
                return chunks
            n *= 2
        self._lanes = []
        return None

    def _chunks(self, group, n: int) -> list[Chunk] | None:
        """``group`` as ``n`` equal chunks, each laid out (from the same chunk of the last step
        when the last step had ``n``); None, with the slots of the chunks laid out so far given
        back, when one does not fit. Keeps the chunks' lanes for the next step."""
        R, last = len(group), self._lanes
        chunks, lanes = [], []
        for j in range(n):
            a, b = R * j // n, R * (j + 1) // n
            out = self.layout(group[a:b], last[j] if len(last) == n else None)
            if out is None:
                for c in chunks:
                    self.pool.free(c.layout.new_slots)
                return None
            chunks.append(Chunk(a, b, out[0]))
            lanes.append(out[1])
        self._lanes, self._rows = lanes, R
        self.lane_steps += sum(1 for ln in lanes if ln.age)
        return chunks
