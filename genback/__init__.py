"""genback: an async language-model backend for probabilistic programs.

Auto-batched, exact next-token log-probs with a KV-cache prefix tree (``genback.llm``), exact byte
vocabularies (``genback.tokenization``) and token-character tries (``genback.trie``).
"""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing genback does not import torch or transformers
    if name == "load_model_by_name":
        from .llm import load_model_by_name

        return load_model_by_name
    if name == "decode_vocab":
        from .tokenization import decode_vocab

        return decode_vocab
    raise AttributeError(f"module 'genback' has no attribute {name!r}")


__all__ = ["load_model_by_name", "decode_vocab", "__version__"]
