"""``Adapters``: the LoRA adapter names of an ``AsyncLM`` (a component, built when the runner
declares ``Capabilities.adapters``).

The runner loads and frees adapters (``add_adapter(path) -> key``: a new int key, never reused;
``remove_adapter(key, error)``: free it and every cached state computed under it, failing its
queries in flight with ``error``). Queries carry the key (``Query.adapter``), so the output cache
and the runner's KV are keyed by adapter. A key that was replaced or removed is *retired*: its
queries still pending fail with ``ValueError`` (the front, which owns this part, asks
:meth:`Adapters.error`).
"""

from __future__ import annotations

from .inputs import check_lora


class Adapters:
    """Names -> adapter keys of one runner, and the retired keys' reasons.

    Args:
        runner: a runner with ``add_adapter`` / ``remove_adapter``.
        front: the model's :class:`~genback.llm.front.Front`, which builds and owns this part
            (its forward lock is held while an adapter is loaded or freed; its output cache
            loses a retired adapter's rows).
    """

    def __init__(self, runner, front):
        self.runner = runner
        self.front = front
        self._keys: dict[str, int] = {}  # registered name -> the runner's adapter key
        self._retired: dict[int, str] = {}  # keys of removed / replaced adapters -> why

    def add(self, lora_path, lora_name: str) -> None:
        """Load the LoRA adapter at ``lora_path`` under ``lora_name``.

        ``lora_path``: a folder saved by peft's ``save_pretrained`` (on AsyncMlxLM: a folder as
        ``mlx_lm.lora`` saves it, ``adapter_config.json`` with ``fine_tune_type: "lora"`` and
        ``adapters.safetensors``: :mod:`genback.runners.mlx.lora`), or a Hub id read from the
        local Hugging Face cache. Queries then
        pick the adapter with ``lora_name=...``; their rows are cached apart from the base
        model's and other adapters'. Registering a name again replaces that adapter: its cached
        KV and rows are dropped and its queries still pending fail with ``ValueError``.

        Raises:
            TypeError: ``lora_name`` is not a str, or ``lora_path`` not a str / path.
            ValueError: empty ``lora_name``; ``lora_path`` holds no adapter, or the backend
                cannot load it (the message says why: e.g. on AsyncMlxLM a peft folder, or a
                layout other than that of the adapters already loaded).
            ImportError: the backend's adapter library is missing (``genback[lora]``).
        """
        from ..runners.hf.lora import check_adapter_path

        if not isinstance(lora_name, str):
            raise TypeError(f"lora_name must be a str, got {type(lora_name).__name__}: "
                            f"{lora_name!r}")
        if not lora_name:
            raise ValueError(f"lora_name must be non-empty, got {lora_name!r}")
        path = check_adapter_path(lora_path)
        with self.front.lock:
            key = self.runner.add_adapter(path)
            old = self._keys.get(lora_name)
            self._keys[lora_name] = key
            if old is not None:
                self._retire(old, f"lora_name={lora_name!r} was replaced by add_new_lora "
                                  "while this query was pending")

    def remove(self, lora_name: str) -> None:
        """Unload adapter ``lora_name``: its weights, cached KV and rows are dropped, and its
        queries still pending fail with ``ValueError``.

        Raises:
            ValueError: no adapter is registered under ``lora_name``.
        """
        key = self.key(lora_name)
        if key is None:
            raise ValueError("lora_name must name a registered adapter, got None")
        with self.front.lock:
            if self._keys.get(lora_name) != key:  # removed meanwhile by another thread
                raise ValueError(f"lora_name={lora_name!r} is not a registered adapter")
            del self._keys[lora_name]
            self._retire(key, f"lora_name={lora_name!r} was removed (remove_lora) while this "
                              "query was pending")

    @property
    def names(self) -> list[str]:
        """Names of the registered adapters, sorted."""
        return sorted(self._keys)

    def key(self, lora_name) -> int | None:
        """The runner's key of ``lora_name`` (None for None: the base model).

        Raises:
            ValueError: ``lora_name`` is not a registered adapter.
        """
        if lora_name is None:
            return None
        if not self._keys:  # the message of every backend with no adapter loaded
            check_lora(lora_name)
        key = self._keys.get(lora_name) if isinstance(lora_name, str) else None
        if key is None:
            raise ValueError(f"lora_name={lora_name!r} is not a registered adapter; "
                             f"registered: {sorted(self._keys)}")
        return key

    def error(self, adapter: int | None) -> Exception | None:
        """None when adapter key ``adapter`` can still be computed, else the error for its
        callers."""
        if adapter is None or adapter not in self._retired:
            return None
        return ValueError(self._retired[adapter])

    def _retire(self, key: int, why: str) -> None:
        # forward lock held: no computation under this adapter runs now
        self._retired[key] = why
        self.runner.remove_adapter(key, ValueError(why))
        self.front.cache.drop(lambda k: getattr(k, "adapter", None) == key)
