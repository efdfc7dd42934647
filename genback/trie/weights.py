"""Weight validation and the log-space segmented reduction shared by the trie backends."""

from __future__ import annotations

import numpy as np

__all__ = ["as_weight_matrix", "check_weight_dtype"]

def check_weight_dtype(kind: str, dtype, name: str, where: str) -> None:
    """Reject dtypes that are not real numbers (``kind`` is numpy's dtype kind letter)."""
    if kind in "fiu":
        return
    raise TypeError(
        f"{where}: {name} must have a real floating (or integer) dtype, got {dtype}"
        + (" (bool weights are ambiguous: convert to 0.0/1.0 or 0/-inf explicitly)" if kind == "b" else "")
    )


def _torch_to_numpy(x, name: str, where: str) -> np.ndarray:
    import torch

    if x.is_complex() or x.dtype == torch.bool:
        check_weight_dtype("c" if x.is_complex() else "b", x.dtype, name, where)
    return x.detach().to(device="cpu", dtype=torch.float64).numpy()


def as_weight_matrix(x, V: int, name: str, batched: bool, where: str = "TokenCharacterTrie") -> np.ndarray:
    """Validate weights and return a float64 numpy matrix of shape ``(B, V)``.

    Args:
        x: numpy array, torch tensor (any device), list of numbers, or (batched) a list of rows.
        V: the vocabulary size (``len(decode)``).
        name: the argument's name for error messages (``"ws"`` or ``"W"``).
        batched: ``True`` expects ``(B, V)``; ``False`` expects ``(V,)`` and returns ``(1, V)``.

    Raises:
        TypeError: not array-like, or a bool / complex / object / string dtype.
        ValueError: wrong number of dimensions or wrong length.
    """
    if isinstance(x, np.ndarray) and x.ndim == 2 and x.dtype == np.float64 and batched and x.shape[1] == V:
        return x
    if type(x).__module__.startswith("torch"):
        x = _torch_to_numpy(x, name, where)
    elif batched and isinstance(x, (list, tuple)) and x and not np.isscalar(x[0]):
        rows = [_torch_to_numpy(r, name, where) if type(r).__module__.startswith("torch") else r for r in x]
        try:
            x = np.stack([np.asarray(r) for r in rows])
        except ValueError:
            lens = sorted({np.shape(r) for r in rows})
            raise ValueError(f"{where}: rows of {name} have different shapes {lens[:4]}; each must be ({V},)") from None
    else:
        try:
            x = np.asarray(x)
        except Exception as e:
            raise TypeError(f"{where}: {name} must be array-like, got {type(x).__name__}") from e
    check_weight_dtype(x.dtype.kind, x.dtype, name, where)
    want = f"(B, {V})" if batched else f"({V},)"
    if x.ndim != (2 if batched else 1):
        raise ValueError(f"{where}: {name} must have shape {want}, got shape {x.shape}")
    if x.shape[-1] != V:
        raise ValueError(f"{where}: {name} must have shape {want} (V = len(decode) = {V}), got shape {x.shape}")
    return np.ascontiguousarray(x.reshape(-1, V), dtype=np.float64)
