"""The backends, one folder each: its facade class (``model.py``, an
:class:`~genback.core.lm.AsyncLM` subclass that only constructs) beside its runner
(``runner.py``, the protocol of :mod:`genback.runner`). ``hf`` (transformers: KV prefix tree,
tree attention, the captured decode step), ``vllm`` (vLLM's ``AsyncLLM`` on its own loop thread,
the shared-memory row tap), ``mlx`` (mlx-lm) and ``mock`` (made-up log-probs). No backend
imports another; :mod:`genback.backends` is the one table that names them."""
