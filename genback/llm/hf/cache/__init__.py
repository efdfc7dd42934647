"""The HF runner's KV cache: a pool of token slots (:mod:`.kv_pool`), the radix tree of cached
prefixes over it (:mod:`.kvtree`, its nodes and the walks along them in :mod:`.nodes`, their
recency and the eviction candidates in :mod:`.recency`), the notes of where each answered
context's KV ends (:mod:`.ends`), and the tree's picture (:mod:`.picture`)."""
