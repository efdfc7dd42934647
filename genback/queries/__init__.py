"""What a query is: its kind and result types (:mod:`.kinds`), its context (:mod:`.context`), the
model window it must fit (:mod:`.window`), how a token is chosen (:mod:`.sampling`) and the
memory of its answer rows (:mod:`.rows`). Below :mod:`genback.batching` and :mod:`genback.core`:
these modules import nothing of theirs."""
