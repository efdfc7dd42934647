"""The Hugging Face runner: KV prefix tree, batch planning, tree attention, its cache object,
the forward, and the runner that ties them together."""

from .runner import HFRunner

__all__ = ["HFRunner"]
