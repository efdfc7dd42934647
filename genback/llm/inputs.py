"""Validation of caller input: token ids, options. Errors name the argument and the bad value."""

from __future__ import annotations

import numbers

import numpy as np
import torch


def check_token_ids(
    token_ids, vocab_size: int, name: str = "token_ids", allow_empty: bool = False
) -> tuple[int, ...]:
    """Return ``token_ids`` as a tuple of Python ints after checking them.

    Accepts a list or tuple of ints (NumPy integers too), or a 1-D integer NumPy array or torch
    tensor (any device).

    Raises:
        TypeError: ``token_ids`` is not a sequence of integers (a str, floats, bools, a 2-D array).
        ValueError: it is empty (unless ``allow_empty``) or an id lies outside ``[0, vocab_size)``.
    """
    if isinstance(token_ids, torch.Tensor) or isinstance(token_ids, np.ndarray):
        dtype = token_ids.dtype
        is_int = (
            (not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool)
            if isinstance(token_ids, torch.Tensor)
            else np.issubdtype(dtype, np.integer)
        )
        if not is_int:
            raise TypeError(f"{name} must hold integer token ids, got an array of dtype {dtype}")
        if token_ids.ndim != 1:
            raise ValueError(
                f"{name} must be 1-D (one context), got shape {tuple(token_ids.shape)}"
            )
        ids = tuple(token_ids.tolist())
    elif isinstance(token_ids, (list, tuple)):
        ids = tuple(token_ids)
        if not all(type(t) is int for t in ids):
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise TypeError(
                        f"{name}[{i}] must be an int token id, got {type(t).__name__}: {t!r}"
                    )
            ids = tuple(int(t) for t in ids)
    else:
        raise TypeError(
            f"{name} must be a list of int token ids, got {type(token_ids).__name__}: "
            f"{_short(token_ids)}"
        )
    if not ids:
        if allow_empty:
            return ids
        raise ValueError(f"{name} must be non-empty, got {_short(token_ids)}")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        i, t = next((i, t) for i, t in enumerate(ids) if t < 0 or t >= vocab_size)
        raise ValueError(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    return ids


def check_positive_int(value, name: str) -> int:
    """Raise ``ValueError`` unless ``value`` is an int > 0 (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_lora(lora_name) -> None:
    """The check of a model with no LoRA adapter loaded: any adapter name is an error."""
    if lora_name is not None:
        raise ValueError(
            f"lora_name={lora_name!r}: this model has no LoRA adapters loaded; pass "
            "lora_name=None (AsyncTransformer / AsyncVirtualLM: register one with add_new_lora)"
        )


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
