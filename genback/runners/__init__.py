"""Backend runners (see :mod:`genback.runner`): ``hf`` (transformers, KV prefix tree and tree
attention), ``vllm`` (vLLM's ``AsyncLLM`` on its own loop thread, the shared-memory row tap)
and ``mock``."""
