"""The forwards of a planned group of paths, behind one contract (:mod:`.base`: a group in, one
:class:`.base.ForwardOut` back): the tree forward over the KV cache (:mod:`.tree`, with the tree
attention registered with transformers, :mod:`.attention`, and the ``Cache`` object that hands
each layer its past, :mod:`.tree_cache`) and the dense forward (:mod:`.dense`); the logits a
forward keeps (:mod:`.logits`) and each query kind's result from them (:mod:`.results`).
The decode step (:mod:`..decode`) is the third forward of the contract."""
