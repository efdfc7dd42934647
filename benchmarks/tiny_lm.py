"""The host benchmarks' models and text (``bench_host.py``, ``bench_long_run.py``,
``bench_step_timeline.py``, ``host_loop.py``): a tiny random-weight Llama over a byte-level BPE
vocabulary trained here on standard-library docstrings (deterministic for a Python version,
offline), so that its forward costs little and what is left is host work; SmolLM2-135M in fp32
(installed from PyPI, loaded offline); and the prompts' token ids."""

from __future__ import annotations

import importlib
import warnings

import torch

TEXT_MODULES = ["json", "argparse", "asyncio", "collections", "functools", "itertools", "pathlib",
                "subprocess", "threading", "unittest", "logging", "email", "decimal", "fractions",
                "zipfile", "tarfile", "csv", "textwrap", "difflib", "heapq", "bisect", "statistics",
                "calendar", "datetime", "random", "string", "codecs", "pickle", "shutil", "socket"]


def corpus(min_chars: int = 150_000) -> str:
    """Prose from the standard library's docstrings (module docs, then their members' in name order),
    whitespace-normalised; deterministic for a Python version and available offline."""
    parts, total = [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mods = [importlib.import_module(m) for m in TEXT_MODULES]
        docs = [m.__doc__ for m in mods] + [getattr(v, "__doc__", None) for m in mods
                                             for _, v in sorted(vars(m).items())]
    for doc in docs:
        if isinstance(doc, str) and doc.strip():
            text = " ".join(doc.split())
            parts.append(text)
            total += len(text) + 1
            if total >= min_chars:
                break
    return " ".join(parts)


def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE of ``vocab_size`` tokens trained on :func:`corpus`, as a transformers
    ``PreTrainedTokenizerFast`` (eos ``<|endoftext|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = corpus()
    tok.train_from_iterator([text[i:i + 2000] for i in range(0, len(text), 2000)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def tiny_model(vocab_size: int, max_positions: int = 16_384, seed: int = 0):
    """A random 2-layer Llama (hidden 64), fp32, whose forward costs little."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, eos_token_id=0, bos_token_id=0,
                         pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from genback.registry import resolve

    path = resolve("smollm2-135m")
    return (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(path))


def load(name: str, vocab: int = 512):
    """``(model, tokenizer)`` for ``tiny`` or ``smollm2``."""
    if name == "tiny":
        tok = tiny_tokenizer(vocab)
        return tiny_model(len(tok)), tok
    return smollm2()


def text_ids(tokenizer, n: int) -> list[int]:
    """``n`` token ids of :func:`corpus` (repeated if it is too short)."""
    ids = tokenizer.encode(corpus(), add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]
