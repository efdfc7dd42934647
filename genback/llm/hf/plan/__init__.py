"""Planning a batch against the KV cache, as plain data: the paths each forward extends and the
queries they answer (:mod:`.batch`), the forward budget that sizes forwards and splits a query too
large for one (:mod:`.budget`), which cached segments a forward reads once for all paths below
them (:mod:`.segments`, walked from :mod:`.anchors`), and a uniform step's rows of slots, from
which the next step is laid out (:mod:`.lanes`)."""
