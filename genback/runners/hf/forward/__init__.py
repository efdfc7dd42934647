"""The forwards of a planned group of paths: the tree forward over the KV cache and the dense
forward (:mod:`.run`), the tree attention registered with transformers (:mod:`.attention`) and
the ``Cache`` object that hands each layer its past (:mod:`.tree_cache`)."""
