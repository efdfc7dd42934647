"""The host floor of ``bench_host.py``: the same SMC trace served by a hand-written async step
over plain transformers, measured with the same clocks.

The loop keeps one ``DynamicCache`` row per particle (the prompt's prefill once, repeated to
``n`` rows); a step is what any awaitable server of one-token rows must do at least, with none
of genback's work (no input checks, no KV tree, no output cache, no copies):

1. one future per caller (``loop.create_future``);
2. when the particles were resampled, the cache's rows reordered (``reorder_cache``: an
   ``index_select`` of every layer's keys and values, the loop's price for resampling);
3. the particles' last tokens as one ``[n, 1]`` tensor, one model forward;
4. ``log_softmax`` of the ``[n, V]`` logits, unbound into the callers' rows (fresh each step: no
   copy is needed), each future's result set, and the ``gather`` awaited.

``host`` is its wall minus the forward's (``bench_host.ForwardTimer``), as in genback's cell, so
``bench_host.py``'s ``host vs loop`` column is genback's host time over this floor's, measured in
the same run on the same model and trace shape.
"""

from __future__ import annotations

import asyncio
import time

import torch

# the loop's KV beyond this many bytes is not measured (1,024 x 4,000 tokens of the tiny model
# is 2 GiB, copied whole at every resampling)
MAX_LOOP_KV_BYTES = 1 << 30


def kv_bytes(model, n: int, context: int) -> int:
    """Bytes of ``n`` particles' KV at ``context`` tokens in ``model``'s dtype."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim
    return n * context * per_token * next(model.parameters()).element_size()


async def loop_cell(model, prompt: list[int], n: int, *, steps: int, warmup: int, resample: int,
                    seed: int, timer, choose, reference) -> dict:
    """The hand-written loop's cell: ``n`` particles from ``prompt``, ``warmup`` steps then
    ``steps`` measured ones, resampling every ``resample`` steps; ``choose(rows, resample, gen)``
    is the trace's sampler (``bench_host.smc_choice``: each particle's next token, and the
    resampled particles' indices or None); ``timer`` a ``bench_host.ForwardTimer`` on
    ``model``; ``reference(model, contexts)`` the uncached rows (``bench_host.reference_rows``).
    Returns ``wall``, ``fwd`` and ``host`` in µs per query, ``reorder`` (the part of ``host``
    that reordered the cache) and ``err``: the max abs difference of two particles' last rows
    from ``reference``'s."""
    loop = asyncio.get_running_loop()
    gen = torch.Generator().manual_seed(seed)
    wall = fwd = reorder = 0.0
    parts = [list(prompt)] * n
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)  # the prompt's prefill, once
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)
        rows = [torch.log_softmax(out.logits[0, -1].float(), -1)] * n
        for step in range(warmup + steps):
            nxt, order = choose(rows, (step + 1) % resample == 0, gen)
            parts = [p + [t] for p, t in zip(parts, nxt)]
            if order is not None:
                parts = [parts[i] for i in order]
            f0, t0 = timer.wall, time.perf_counter()
            futures = [loop.create_future() for _ in range(n)]
            if order is not None:
                r0 = time.perf_counter()
                cache.reorder_cache(torch.tensor(order))
                r1 = time.perf_counter() - r0
            else:
                r1 = 0.0
            ids = torch.tensor([p[-1] for p in parts])[:, None]
            logits = model(ids, past_key_values=cache, use_cache=True,
                           position_ids=torch.full((n, 1), len(parts[0]) - 1)).logits
            for f, r in zip(futures, torch.log_softmax(logits[:, -1].float(), -1).unbind(0)):
                f.set_result(r)
            rows = await asyncio.gather(*futures)
            if step >= warmup:
                wall += time.perf_counter() - t0
                fwd += timer.wall - f0
                reorder += r1
    refs = reference(model, [parts[0], parts[n - 1]])
    err = max(float((rows[i] - ref).abs().max()) for i, ref in zip((0, n - 1), refs))
    us = 1e6 / (n * steps)
    return {"wall": wall * us, "fwd": fwd * us, "host": (wall - fwd) * us,
            "reorder": reorder * us, "err": err}
