"""Clocks around the named parts of an ``AsyncTransformer``'s decode step (issue 38): where a
step's host time goes before its graph launch, when the GPU waits for it.

``bench_gpu.py --phases`` wraps these points of one ``lm`` (instance or module attributes,
restored by :meth:`StepPhases.close`) and reports, per point, the median over the steps of when
it first started (ms from the step's start: the caller's ``gather``) and of how long it ran in
all (ms, summed over its calls in the step):

- ``answer``: the runner's work on a batch (``HFRunner._answer``): its start is what the front,
  the batcher and the event loop took to hand the step over (every query submitted and checked);
- ``plan``: the uniform step's plan (``plan_step``);
- ``layout``: the decode step's layout (``DecodeStep.layouts``: lanes or the tree's segments,
  new slots from the pool);
- ``fill``: the layout copied to the bucket's static buffer (``DecodeBuffers.fill``: one
  host-to-device copy, from pageable memory);
- ``level0``: the kept level 0 checked and, when its prefix changed, gathered again
  (``KeptPrefix.refresh``);
- ``launch``: ``StepGraphs.run`` (a replay's launch, or an eager or capturing forward);
- ``rows``: the rows handed out (``outputs``: views or copies of the logits' rows);
- ``forward``: the runner's forward of the step (``HFRunner._forward``: layout, launch, rows);
- ``commit``: the step's new KV noted in the tree (``HFRunner._commit_step``);
- ``chain``: a step of the runner's step chain (``StepChain.step``: its checks, the layout from
  the last step's rows, the launch and the rows; ``genback/llm/hf/chain.py``), which has no
  ``plan``, ``forward``, ``layout`` or ``commit``; ``chain commit``: a chain's steps put into
  the tree (``StepChain.commit``, once in several steps). ``rows`` is a chained step's rows too
  (``results``).

A measurement tool over private names, not an API: a point that a version lacks is skipped.
"""

from __future__ import annotations

import importlib
import time

import numpy as np


def _points(lm) -> list[tuple[str, object, str]]:
    """``(name, owner, attribute)`` of each point this ``lm`` has."""
    runner = lm.runner
    step = getattr(runner, "decode_step", None)
    out = [("answer", runner, "_answer"),
           # (plan_step: where the runner's _answer is defined, the runner's module or another)
           ("plan", importlib.import_module(type(runner)._answer.__module__), "plan_step"),
           ("forward", runner, "_forward"), ("commit", runner, "_commit_step")]
    chain = getattr(runner, "chain", None)
    if chain is not None:
        out += [("chain", type(chain), "step"), ("chain commit", type(chain), "commit")]
    if step is not None:
        cascade = importlib.import_module("genback.llm.hf.decode.cascade")
        level0 = importlib.import_module("genback.llm.hf.decode.level0")
        out += [("layout", step, "layouts"), ("fill", cascade.DecodeBuffers, "fill"),
                ("level0", level0.KeptPrefix, "refresh"), ("launch", step.graphs, "run"),
                ("rows", importlib.import_module(type(step).__module__), "outputs"),
                ("rows", importlib.import_module(type(step).__module__), "results")]
    return [(n, o, a) for n, o, a in out if hasattr(o, a)]


class StepPhases:
    """Wraps :func:`_points` of ``lm``; :meth:`begin` and :meth:`end` bracket one step."""

    def __init__(self, lm):
        self._events: list[tuple[str, float, float]] = []
        self._steps: list[dict[str, tuple[float, float]]] = []
        self._t0 = None
        self._saved = []
        for name, owner, attr in _points(lm):
            own = attr in vars(owner)  # (else a method of an instance's class)
            self._saved.append((owner, attr, vars(owner).get(attr), own))
            setattr(owner, attr, self._wrap(name, getattr(owner, attr)))

    def _wrap(self, name, fn):
        events = self._events

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                events.append((name, t, time.perf_counter()))
        return timed

    def begin(self, t0: float) -> None:
        """A step starts at ``t0`` (``time.perf_counter()``)."""
        self._events.clear()
        self._t0 = t0

    def end(self) -> None:
        """The step's callers have their rows: note each point's first start and total."""
        per: dict[str, list[float]] = {}
        for name, a, b in self._events:
            first, total = per.get(name, (b, 0.0))
            per[name] = (min(first, a), total + (b - a))
        self._steps.append({k: (a - self._t0, tot) for k, (a, tot) in per.items()})
        self._events.clear()

    def medians(self) -> dict[str, dict[str, float]]:
        """``{point: {"start_s", "total_s", "steps"}}``: medians over the steps it ran in."""
        names = {k for s in self._steps for k in s}
        out = {}
        for k in sorted(names):
            got = [s[k] for s in self._steps if k in s]
            out[k] = {"start_s": float(np.median([a for a, _ in got])),
                      "total_s": float(np.median([b for _, b in got])), "steps": len(got)}
        return out

    def close(self) -> None:
        """Put every wrapped attribute back."""
        for owner, attr, original, own in reversed(self._saved):
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._saved.clear()


def summary(phases: dict[str, dict[str, float]]) -> str:
    """One line: each point as ``name start+total`` in ms, in order of start."""
    order = sorted(phases.items(), key=lambda kv: kv[1]["start_s"])
    return "  ".join(f"{k} {v['start_s'] * 1e3:.2f}+{v['total_s'] * 1e3:.2f}" for k, v in order)
