"""The backend-agnostic core: :class:`~genback.core.lm.AsyncLM` and the parts it composes.

A query takes one path through them (``await lm.next_token_logprobs(ids)``):

1. :mod:`.lm` (``AsyncLM``, the public methods) checks the arguments and hands the query to
2. :mod:`.front` (``Front``): the context checked once (:mod:`.inputs`), the adapter's key
   (:mod:`.adapters`), a hit in the output cache (:mod:`.output_cache`) answered at once, else
3. the scheduler: :mod:`genback.batching.batcher` (``Batcher``: a window and a query count; ``Immediate`` for
   engines that schedule themselves) collects queries and calls the runner's ``run`` on its
   worker thread (a lockstep step on the event loop's thread); the rows come back to the front,
   which stores them in the output cache, gives
   each caller its own copy, and resolves the caller's future, which the coroutine that
   ``next_token_logprobs`` returned awaits (:mod:`genback.batching.futures`).

:mod:`.decoding` (sampling loops over decoding steps) and :mod:`.queue_api` (genlm-backend's
queue names) sit beside ``AsyncLM``; :mod:`.batch_options` is the batcher's two settings as the
front exposes them. Nothing here imports a backend: each backend's facade
(``genback.llm.<name>.model``) subclasses ``AsyncLM`` and hands it a runner
(:mod:`genback.batching.runner` is the contract).
"""
