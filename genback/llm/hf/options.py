"""The HF runner's options, checked, with the defaults that depend on the model and device."""

from __future__ import annotations

import torch

from .forward import attention as tree_attention
from .memory import available_memory_bytes


def check_device(device) -> torch.device:
    """``device`` as a ``torch.device``, or ``ValueError`` naming ``row_device``."""
    if isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"row_device must be a torch device or its name ('cpu', 'cuda:0'), "
                         f"got {device!r}") from exc


def check_options(device, kv_budget_bytes, max_batch_tokens, max_forward_bytes,
                   min_shared_tokens, attention, decode) -> tuple[int, int]:
    """``(kv_budget_bytes, max_forward_bytes)`` with their defaults from ``device``'s free
    memory; ``ValueError`` naming an option out of range."""
    free = available_memory_bytes(device)
    if kv_budget_bytes is None:
        kv_budget_bytes = max(64 << 20, free // 2)
    if max_forward_bytes is None:
        max_forward_bytes = max(256 << 20, min(2 << 30, free // 4))
    for name, value in (("max_batch_tokens", max_batch_tokens),
                        ("max_forward_bytes", max_forward_bytes),
                        ("min_shared_tokens", min_shared_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if attention not in ("auto", "tree", "dense"):
        raise ValueError(f"attention must be 'auto', 'tree' or 'dense', got {attention!r}")
    if decode not in ("auto", "graphs", "eager", "off"):
        raise ValueError(f"decode must be 'auto', 'graphs', 'eager' or 'off', got {decode!r}")
    return kv_budget_bytes, max_forward_bytes


def attention_kind(model, attention: str) -> tuple[bool, str]:
    """``(use_tree, description)`` of ``attention`` on ``model``; ``ValueError`` when
    ``attention="tree"`` but the model lacks the attention interface."""
    reason = tree_attention.support(model)
    if attention == "tree" and reason:
        raise ValueError(f"attention='tree' is not available for this model: {reason}")
    use_tree = attention != "dense" and reason is None
    return use_tree, ("tree" if use_tree else
                      f"dense ({'attention=dense' if attention == 'dense' else reason})")
