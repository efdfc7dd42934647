"""Backend runners (see :mod:`genback.runner`): ``hf`` (transformers, KV prefix tree and tree
attention) and ``mock``. The vLLM runner lives with its adapter in :mod:`genback.llm.vllm`."""
