"""The MLX runner: an mlx-lm model with a prefix KV store (:mod:`.kv`), mlx-lm LoRA adapters
switched per query (:mod:`.lora`), and the runner that plans, forwards and dispatches on the
query kinds (:mod:`.runner`). Importing this package does not import MLX."""

from .runner import MlxRunner

__all__ = ["MlxRunner"]
