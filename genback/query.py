"""``Query``: one question a batch asks a backend runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sampling import Pick


@dataclass(frozen=True)
class Query:
    """One question to the model.

    ``targets is None``: the next-token log-prob row after ``tokens`` (float32 ``[V]``).
    Otherwise: the log-probs of ``targets`` at the last ``len(targets)`` positions of
    ``tokens + targets[-1:]``, i.e. ``tokens = context + continuation[:-1]`` and
    ``targets = continuation`` (float32 ``[len(targets)]``). ``targets == ()``: only compute and
    keep the KV of ``tokens`` (runners with a KV cache; the result is None).

    ``greedy=True`` (with non-empty ``targets``): the result is the pair ``(logprobs float32
    [n], is_greedy bool [n])``, ``is_greedy[i]`` telling whether ``targets[i]`` is the argmax of
    its position's logits, both from the same forward (a scoring request).

    ``pick`` (with ``targets is None``): a decoding step: the result is the
    :class:`~genback.sampling.Choice` that :func:`genback.sampling.choose` makes from the logits
    after ``tokens``, on the model's device (only the token and the asked-for log-probs leave
    it). Runners that answer such queries have ``picks = True``.

    ``adapter``: None for the base model, else the runner's key of a LoRA adapter (the same
    tokens under two adapters are two different queries).
    """

    tokens: tuple[int, ...]
    targets: tuple[int, ...] | None = None
    adapter: int | None = None
    greedy: bool = False
    pick: "Pick | None" = None

    @property
    def n_outputs(self) -> int:
        return 1 if self.targets is None else len(self.targets)


def row_key(query: Query):
    """Output-cache and batch key of a next-token query: its tokens (base model), or
    ``(adapter, tokens)`` (the same tokens under another adapter are another context)."""
    return query.tokens if query.adapter is None else (query.adapter, query.tokens)
