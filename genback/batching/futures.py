"""A query's awaitable: every query method of ``AsyncLM`` is a coroutine function.

``lm.next_token_logprobs(ids)`` (and ``batch_next_token_logprobs``, ``token_logprobs``,
``score``, ``sample``, ``batch_sample``, ``choose_next``) returns a native coroutine, as
genlm-backend's ``async def`` methods do, so every asyncio way of waiting on a query works as it
does there: ``await``, ``asyncio.gather``, ``asyncio.ensure_future`` or ``asyncio.create_task``
then ``asyncio.wait``, ``asyncio.as_completed``, ``asyncio.wait_for``, ``asyncio.shield``,
``asyncio.TaskGroup``, ``asyncio.run`` and ``loop.run_until_complete`` of one query; a call made
outside any loop is run later. Cancelling the task that runs a query cancels the batcher's
future it awaits, and the batcher leaves a query whose callers are all cancelled out of its
batch (``tests/test_asyncio_idioms.py``).

Why not a future (genback's design until issue 67): handing out the batcher's future itself
saved ``gather`` a task per query (~4 µs a query on this project's CPU), but asyncio cannot take
one object for both a future and a coroutine. ``asyncio.ensure_future`` returns a future as it is
and ``asyncio.wait`` refuses coroutines (``TypeError: Passing coroutines is forbidden``), while
``asyncio.create_task`` and ``TaskGroup.create_task`` take only coroutines; both tests are
``asyncio.iscoroutine``. So an awaitable that ``create_task`` takes is a coroutine and not a
future, and ``gather`` wraps it in a task: the cost of the caller's idioms. A client that asks a
whole step at once uses ``batch_next_token_logprobs`` instead (one await and one future for the
step: :mod:`genback.batching.groups`), which never had a task per query.

The hot path stays one frame: the coroutine checks and counts the query, answers a cached row
at once, else awaits the scheduler's future of it (``Front.enqueue``).
"""
