"""``Query``: one question a batch asks a backend runner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Query:
    """One question to the model.

    ``targets is None``: the next-token log-prob row after ``tokens`` (float32 ``[V]``).
    Otherwise: the log-probs of ``targets`` at the last ``len(targets)`` positions of
    ``tokens + targets[-1:]``, i.e. ``tokens = context + continuation[:-1]`` and
    ``targets = continuation`` (float32 ``[len(targets)]``). ``targets == ()``: only compute and
    keep the KV of ``tokens`` (runners with a KV cache; the result is None).

    ``adapter``: None for the base model, else the runner's key of a LoRA adapter (the same
    tokens under two adapters are two different queries).
    """

    tokens: tuple[int, ...]
    targets: tuple[int, ...] | None = None
    adapter: int | None = None

    @property
    def n_outputs(self) -> int:
        return 1 if self.targets is None else len(self.targets)
