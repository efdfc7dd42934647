"""The way in: how a query waits and joins a batch. :mod:`.batcher` (the window and the query
count), :mod:`.immediate` (each query at once, for engines that schedule themselves),
:mod:`.pending` (the batch being gathered), :mod:`.futures` (the caller's awaitable),
:mod:`.groups` (queries answered together) and :mod:`.runner` (the protocol a backend's runner
implements for the batcher)."""
