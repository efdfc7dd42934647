"""A torch profile of a few SMC steps through genback on CUDA, for ``bench_gpu.py --profile``:
host-side launches, device kernel time and the kernels that take it, per step (host events
only off CUDA)."""

from __future__ import annotations

import asyncio
import cProfile
import os
import pstats
import time

import torch

import gpu_models as G


def profile_steps(lm, prompt, trace, device, k: int = 4, top: int = 15,
                  contexts: bool = False) -> dict:
    """Kernel launches (host runtime calls ``cudaLaunchKernel`` and friends, and graph
    launches), device kernel time, the ``top`` kernels by device time (calls and µs per step),
    the host's time inside CUDA runtime and driver calls (``runtime_calls``: graph launches,
    copies, synchronisations, where a step's host launches or waits) and wall time per step over
    ``k`` steps of the trace, on ``lm`` freshly cleared (torch profiler). The trace's first ``k``
    steps run unprofiled first and the next ``k`` are profiled, where the trace is that long
    (else the first ``k``), so that the profile sees replays; ``captures_in_profile`` counts the
    captures that still fell inside it (their eager warm-up and check forwards are then in the
    figures). Off CUDA (the CPU test of this path) only host events are recorded: no launches,
    no device time, no runtime calls.

    Then ``k`` more steps run under cProfile (where the trace is long enough, else the same
    ``k`` again): ``host_functions``, the ``top`` Python functions by their own time per step
    (cProfile's overhead inflates Python-heavy code, so compare them with each other, not with
    the step's time), and ``host_profiled_s_per_step``. ``contexts``: each particle's context is
    an ``lm.context`` object extended by ``+`` (``bench_gpu.py``'s ``/context``), else a list."""
    from torch.profiler import ProfilerActivity, profile

    lm.clear_kv_cache()
    lm.clear_cache()
    lm.cache_kv(prompt)
    G._sync(device)
    warm = k if len(trace) >= 2 * k else 0
    first = lm.context(prompt) if contexts else list(prompt)
    parts = [first for _ in trace[0][0]]

    async def steps(part):
        nonlocal parts
        for parents, tokens in part:
            parts = [parts[q] + [t] for q, t in zip(parents.tolist(), tokens.tolist())]
            await asyncio.gather(*(lm.next_token_logprobs(c) for c in parts))
            G._sync(device)

    asyncio.run(steps(trace[:warm]))
    captures = lm.cache_info().get("decode_captures", 0)
    t = time.perf_counter()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        asyncio.run(steps(trace[warm:warm + k]))
    wall = time.perf_counter() - t
    captures = lm.cache_info().get("decode_captures", 0) - captures
    launches = kernel_us = 0.0
    by_name: dict[str, list[float]] = {}
    runtime: dict[str, list[float]] = {}  # the host's time inside CUDA runtime / driver calls
    for e in prof.events():
        if e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                      "cuLaunchKernelEx", "cudaGraphLaunch", "cudaMemcpyAsync",
                      "cudaMemsetAsync"):
            launches += 1
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cu"):
            _add(runtime, e.name, e.cpu_time_total)
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += e.device_time
            _add(by_name, e.name, e.device_time)
    n = min(k, len(trace) - warm)
    out = {"launches_per_step": launches / n, "gpu_busy_s_per_step": kernel_us * 1e-6 / n,
           "gpu_busy_fraction": kernel_us * 1e-6 / wall, "profiled_step_s": wall / n,
           "captures_in_profile": captures, "kernels": _per_step(by_name, n, top),
           "runtime_calls": _per_step(runtime, n, top)}
    at = warm + k if len(trace) >= warm + 2 * k else warm
    host = cProfile.Profile()
    host.enable()
    asyncio.run(steps(trace[at:at + k]))
    host.disable()
    n = min(k, len(trace) - at)
    stats = pstats.Stats(host).stats  # {(file, line, name): (calls, prim, own s, cum s, ..)}
    out["host_profiled_s_per_step"] = sum(v[2] for v in stats.values()) / n
    out["host_functions"] = _per_step(
        {f"{os.path.basename(f)}:{line}({name})": [v[0], v[2] * 1e6]
         for (f, line, name), v in stats.items()}, n, top)
    return out


def _add(totals: dict, name: str, us: float) -> None:
    """One more call of ``name`` taking ``us`` µs into ``totals`` (``name: [calls, µs]``)."""
    got = totals.setdefault(name, [0, 0.0])
    got[0] += 1
    got[1] += us


def _per_step(totals: dict, n: int, top: int) -> list[dict]:
    """The ``top`` entries of ``totals`` (``name: [calls, µs]`` over ``n`` steps) by time, per
    step: ``{"name", "calls_per_step", "us_per_step"}``."""
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": name, "calls_per_step": c / n, "us_per_step": us / n}
            for name, (c, us) in rows]
