"""The Hugging Face backend: ``AsyncTransformer`` (:mod:`.model`) over :class:`.runner.HFRunner`.

The runner is one stack of rooms, each importing only the ones below it:

* :mod:`.runner`: plan, execute, commit; it knows no forward's insides.
* :mod:`.decode`: the uniform decode step (slot layout, chunks, cascade, CUDA graphs).
* :mod:`.forward`: the tree and dense forwards, tree attention, the results of each query kind.
* :mod:`.plan`: the batch as plain data (paths, budget, shared segments).
* :mod:`.cache`: the KV slot pool, the prefix tree over it, the notes of where contexts end.

:mod:`.lora` (peft adapters) and :mod:`.memory` (free memory, heap trim) serve the runner.
"""

from .runner import HFRunner

__all__ = ["HFRunner"]
