"""LoRA adapter names on an ``AsyncLM``: registering, replacing and removing them by name.

A backend that serves adapters mixes in :class:`AdapterNames` and implements two methods:
``_load_adapter(path) -> key`` (load the adapter in folder ``path``; return a new int key, never
reused) and ``_unload_adapter(key)`` (free it and every cached state computed under it). Queries
carry the key (:class:`~genback.query.Query` ``.adapter``), so the output cache and the backend's
KV are keyed by adapter; a key that was replaced or removed is *retired*, and its queries still
pending fail with ``ValueError`` (``AsyncLM._adapter_error``).
"""

from __future__ import annotations

from .inputs import check_lora


class AdapterNames:
    """``add_new_lora`` / ``remove_lora`` / ``lora_names`` for an ``AsyncLM`` backend."""

    def _init_adapters(self) -> None:
        self._loras: dict[str, int] = {}  # registered name -> the backend's adapter key
        self._retired: dict[int, str] = {}  # keys of removed / replaced adapters -> why

    def add_new_lora(self, lora_path, lora_name: str) -> None:
        """Load the peft LoRA adapter at ``lora_path`` under ``lora_name``.

        ``lora_path``: a folder saved by peft's ``save_pretrained``, or a Hub id read from the
        local Hugging Face cache (downloaded when the Hub can be used). Queries then pick the
        adapter with ``lora_name=...``; their rows are cached apart from the base model's and
        other adapters'. Registering a name again replaces that adapter: its cached KV and rows
        are dropped and its queries still pending fail with ``ValueError``.

        Raises:
            TypeError: ``lora_name`` is not a str, or ``lora_path`` not a str / path.
            ValueError: empty ``lora_name``; ``lora_path`` holds no adapter, or the backend
                cannot load it (the message says why).
            ImportError: the backend's adapter library is missing (``genback[lora]``).
        """
        from ..runners.hf.lora import check_adapter_path

        if not isinstance(lora_name, str):
            raise TypeError(f"lora_name must be a str, got {type(lora_name).__name__}: "
                            f"{lora_name!r}")
        if not lora_name:
            raise ValueError(f"lora_name must be non-empty, got {lora_name!r}")
        path = check_adapter_path(lora_path)
        self._check_open()
        with self._forward_lock:
            key = self._load_adapter(path)
            old = self._loras.get(lora_name)
            self._loras[lora_name] = key
            if old is not None:
                self._retire(old, f"lora_name={lora_name!r} was replaced by add_new_lora "
                                  "while this query was pending")

    def remove_lora(self, lora_name: str) -> None:
        """Unload adapter ``lora_name``: its weights, cached KV and rows are dropped, and its
        queries still pending fail with ``ValueError``.

        Raises:
            ValueError: no adapter is registered under ``lora_name``.
        """
        key = self._lora_key(lora_name)
        if key is None:
            raise ValueError("lora_name must name a registered adapter, got None")
        with self._forward_lock:
            if self._loras.get(lora_name) != key:  # removed meanwhile by another thread
                raise ValueError(f"lora_name={lora_name!r} is not a registered adapter")
            del self._loras[lora_name]
            self._retire(key, f"lora_name={lora_name!r} was removed (remove_lora) while this "
                              "query was pending")

    @property
    def lora_names(self) -> list[str]:
        """Names of the registered adapters."""
        return sorted(self._loras)

    def _retire(self, key: int, why: str) -> None:
        # forward lock held: no computation under this adapter runs now
        self._retired[key] = why
        self._unload_adapter(key)
        self._output_cache.drop(lambda k: getattr(k, "adapter", None) == key)

    def _lora_key(self, lora_name) -> int | None:
        if lora_name is None:
            return None
        if not self._loras:  # the message of every backend with no adapter loaded
            check_lora(lora_name)
        key = self._loras.get(lora_name) if isinstance(lora_name, str) else None
        if key is None:
            raise ValueError(f"lora_name={lora_name!r} is not a registered adapter; "
                             f"registered: {sorted(self._loras)}")
        return key

    def _adapter_error(self, adapter: int | None) -> Exception | None:
        if adapter is None or adapter not in self._retired:
            return None
        return ValueError(self._retired[adapter])
