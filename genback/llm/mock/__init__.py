"""The mock backend: ``MockAsyncLM`` (:mod:`.model`) over the real tokenizer, with made-up,
deterministic log-probs computed by :mod:`.runner` (no model)."""
