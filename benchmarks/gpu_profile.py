"""A torch profile of a few SMC steps through genback on CUDA, for ``bench_gpu.py --profile``:
host-side launches, device kernel time and the kernels that take it, per step (host events
only off CUDA)."""

from __future__ import annotations

import asyncio
import time

import torch

import gpu_models as G


def profile_steps(lm, prompt, trace, device, k: int = 4, top: int = 15) -> dict:
    """Kernel launches (host runtime calls ``cudaLaunchKernel`` and friends, and graph
    launches), device kernel time, the ``top`` kernels by device time (calls and µs per step)
    and wall time per step over ``k`` steps of the trace, on ``lm`` freshly cleared (torch
    profiler; CUDA only). The trace's first ``k`` steps run unprofiled first and the next ``k``
    are profiled, where the trace is that long (else the first ``k``), so that the profile sees
    replays; ``captures_in_profile`` counts the captures that still fell inside it (their eager
    warm-up and check forwards are then in the figures). Off CUDA (the CPU test of this path)
    only host events are recorded: no launches, no device time."""
    from torch.profiler import ProfilerActivity, profile

    lm.clear_kv_cache()
    lm.clear_cache()
    lm.cache_kv(prompt)
    G._sync(device)
    warm = k if len(trace) >= 2 * k else 0
    parts = [list(prompt) for _ in trace[0][0]]

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
    for e in prof.events():
        if e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                      "cuLaunchKernelEx", "cudaGraphLaunch", "cudaMemcpyAsync",
                      "cudaMemsetAsync"):
            launches += 1
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += e.device_time
            got = by_name.setdefault(e.name, [0, 0.0])
            got[0] += 1
            got[1] += e.device_time
    k = min(k, len(trace) - warm)
    table = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"launches_per_step": launches / k, "gpu_busy_s_per_step": kernel_us * 1e-6 / k,
            "gpu_busy_fraction": kernel_us * 1e-6 / wall, "profiled_step_s": wall / k,
            "captures_in_profile": captures,
            "kernels": [{"name": n, "calls_per_step": c / k, "us_per_step": us / k}
                        for n, (c, us) in table]}
