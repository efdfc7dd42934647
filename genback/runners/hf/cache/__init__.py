"""The HF runner's KV cache: a pool of token slots (:mod:`.kv_pool`), the radix tree of cached
prefixes over it (:mod:`.kvtree`, with the walks up from a node in :mod:`.walks`), the notes of
where each answered context's KV ends (:mod:`.ends`), and the tree's picture (:mod:`.picture`)."""
