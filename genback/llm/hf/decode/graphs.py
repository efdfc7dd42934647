"""The decode step's CUDA graphs: one per bucket, captured at its second use, and checked at
their first replay.

A bucket's first step runs eagerly: an SMC run's first step after a shared prompt often has
fewer distinct rows than the next ones (particles that drew the same token ask one query), so
its bucket is used once, and a capture (an eager warm-up, the capture, the first replay and its
check: ~90 ms on an 8B Llama on an H100, against one eager forward) would be spent on one step
(``benchmarks/RESULTS.md``, "Issue 38, part 1 on an H200 and an H100 (session 59)").

A graph captured on a user's GPU is code running there for the first time, so its first replay
is compared with the eager run of the same step on the same static buffers (the capture's
warm-up already computes it): logits within :data:`TOLERANCE` of the model's dtype, relative to
the largest logit, or the bucket is **rejected**: its graph is dropped, a warning names the
bucket once, the step is run again eagerly (its logits and the new tokens' KV written anew), and
that bucket runs eagerly from then on. A capture that raises warns once and every later step
runs eagerly. The capture mechanics (a warm-up on a side stream, one memory pool shared by all
graphs, ``capture_error_mode="thread_local"``) follow PyTorch's CUDA-graph documentation, as
vLLM's and SGLang's decode runners do.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

import torch

# how far a replay's logits may be from the eager run's, relative to the largest logit: float32
# as the exactness bar of every cached path (1e-4); bf16 / fp16 a few units of their last place
# (2^-8 and 2^-11 relative), as the dense path's own rounding is
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}

# the use of a bucket at which it is captured (the uses before run eagerly)
CAPTURE_AFTER = 2


class StepGraphs:
    """The graphs of one :class:`.step.DecodeStep`.

    Args:
        device: the pool's device (CUDA when ``enabled``).
        dtype: the model's dtype (picks the :data:`TOLERANCE` of the first-replay check).
        enabled: capture at all (False: every step eager).
        max_graphs: most graphs kept; further buckets run eagerly.
        max_graph_bytes: no more captures once the graphs' memory reaches this (None: an eighth
            of the device's memory).
        capture_after: a bucket is captured at this use (:data:`CAPTURE_AFTER`: its first
            step runs eagerly; 1: at its first use).

    Attributes:
        replays, eager (steps run without a graph: a bucket's first uses, rejected buckets,
            buckets past the limits), captures, verified (first replays that agreed), rejected
            (buckets whose first replay disagreed: eager from then on), capture_seconds,
            graph_bytes (the device memory the captures reserved, each measured with the
            allocator's cache emptied before and after), failed (the capture error, once: later
            steps run eagerly): statistics.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, *, enabled: bool,
                 max_graphs: int = 32, max_graph_bytes: int | None = None,
                 capture_after: int = CAPTURE_AFTER):
        if max_graph_bytes is None:
            max_graph_bytes = (torch.cuda.get_device_properties(device).total_memory // 8
                               if enabled else 0)
        self.device, self.tolerance = device, TOLERANCE.get(dtype, 2 ** -6)
        self._index = torch.device(device).index  # (None: the current device)
        self.enabled, self.max_graphs, self.max_graph_bytes = enabled, max_graphs, max_graph_bytes
        self.capture_after = capture_after
        self.graphs: dict[tuple, object] = {}
        self._uses: dict[tuple, int] = {}  # buckets seen, not captured yet: their uses so far
        self.rejected_buckets: set[tuple] = set()
        self._mempool = None
        self.replays = self.eager = self.captures = self.verified = self.rejected = 0
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        self.failed: str | None = None

    def stats(self) -> dict:
        return {"decode_replays": self.replays, "decode_eager_steps": self.eager,
                "decode_graphs": len(self.graphs),
                "decode_captures": self.captures, "decode_graphs_verified": self.verified,
                "decode_graphs_rejected": self.rejected,
                "decode_capture_seconds": round(self.capture_seconds, 4),
                "decode_graph_bytes": self.graph_bytes}

    def clear(self) -> None:
        """Drop every graph (their memory goes back to the allocator); rejected buckets stay
        rejected."""
        self.graphs.clear()
        self._uses.clear()
        self._mempool = None

    def run(self, buf, forward: Callable, rows: int) -> None:
        """Compute the step in ``buf`` (its :class:`.cascade.DecodeBuffers`, filled): replay its
        bucket's graph, capturing and checking it at its ``capture_after``-th use, or
        ``forward(buf)`` eagerly.
        ``rows``: the step's real rows (the logits compared). Runs with the pool's device as
        the current CUDA device: a capture's stream and a replay go to the current device, and
        the calling thread's may be another (a model on ``cuda:1``; a step run on the caller's
        event-loop thread, :mod:`genback.batching.batcher`'s ``inline_cohort``)."""
        if self.enabled and self._index is not None and torch.cuda.current_device() != self._index:
            with torch.cuda.device(self._index):
                return self._run(buf, forward, rows)
        return self._run(buf, forward, rows)

    def _run(self, buf, forward: Callable, rows: int) -> None:
        key = buf.key
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        uses = self._uses.get(key, 0) + 1 if self._may_capture(key) else 0
        if uses < self.capture_after:  # (0: never captured)
            if uses:
                self._uses[key] = uses
            forward(buf)
            self.eager += 1
            return
        self._uses.pop(key, None)
        graph = self._capture(buf, forward)  # (its warm-up ran the step eagerly)
        if graph is not None:
            self._first_replay(buf, graph, forward, rows)

    def _may_capture(self, key) -> bool:
        return (self.enabled and self.failed is None and key not in self.rejected_buckets
                and len(self.graphs) < self.max_graphs and self.graph_bytes < self.max_graph_bytes)

    def _first_replay(self, buf, graph, forward: Callable, rows: int) -> None:
        """Replay a new graph and compare its logits with the eager warm-up's: keep it, or
        reject its bucket and run the step eagerly again."""
        eager = buf.logits[:rows].clone()
        graph.replay()
        self.replays += 1
        diff = float((buf.logits[:rows] - eager).abs().max()) if rows else 0.0
        if diff <= self.tolerance * max(1.0, float(eager.abs().max()) if rows else 1.0):
            self.graphs[buf.key] = graph
            self.verified += 1
            return
        self.rejected += 1
        self.rejected_buckets.add(buf.key)
        warnings.warn(f"genback: the captured decode step of bucket {buf.key} (rows, width, "
                      f"prefix) disagreed with its eager run at its first replay (logits off by "
                      f"{diff:.3g}); that bucket runs without a graph from now on",
                      RuntimeWarning, stacklevel=4)
        forward(buf)  # (the replay may have written wrong KV too: the eager run writes it anew)
        self.eager += 1

    def _capture(self, buf, forward: Callable):
        """Capture ``buf``'s bucket after one eager warm-up run on a side stream (which also
        computes this step: an error there is the step's, raised as an eager step's would be);
        None, with one warning, when the capture fails."""
        t0 = time.perf_counter()
        dev = self.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            forward(buf)  # warm-up (lazy initialisations happen outside capture)
        torch.cuda.current_stream(dev).wait_stream(stream)
        try:
            before = self._reserved()
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                forward(buf)
        except Exception as exc:  # noqa: BLE001 (any capture failure falls back)
            self.failed = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"genback: capturing the decode step as a CUDA graph failed; running "
                          f"it without graphs ({self.failed})", RuntimeWarning, stacklevel=4)
            try:
                torch.cuda.synchronize(dev)
            except RuntimeError:  # (a capture error may also surface here)
                pass
            return None
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0
        self.graph_bytes += max(0, self._reserved() - before)
        return graph

    def _reserved(self) -> int:
        """Device memory the allocator reserves, its cache emptied first (what is left is in
        use: tensors and graph pools)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)
