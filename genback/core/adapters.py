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

import os

from .inputs import check_lora

ADAPTER_CONFIG = "adapter_config.json"
"""The file that marks a folder as a LoRA adapter (peft's and mlx-lm's)."""


def check_adapter_path(path) -> str:
    """The folder holding the peft adapter ``path`` names (``adapter_config.json`` in it).

    ``path`` is a local folder or a Hub id ``org/name``: a Hub id is read from the local Hugging
    Face cache, or downloaded when the Hub can be used (``genback.registry.hub_offline_reason``).

    Raises:
        TypeError: ``path`` is not a str or path. ValueError: neither a folder nor a Hub id that
            can be had, or no adapter in it.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"lora_path must be a str or path, got {type(path).__name__}: {path!r}")
    path = os.fspath(path)
    if not os.path.isdir(path):
        path = _hub_adapter(path)
    if not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        raise ValueError(f"lora_path {path!r} holds no peft adapter (no {ADAPTER_CONFIG}); save one with "
                         "PeftModel.save_pretrained")
    return path


def _hub_adapter(repo_id: str) -> str:
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        raise ValueError(f"lora_path {repo_id!r} is not an existing folder (nor a Hub id "
                         "'org/name')")
    from huggingface_hub import snapshot_download, try_to_load_from_cache

    from ..registry import hub_offline_reason

    cached = try_to_load_from_cache(repo_id, ADAPTER_CONFIG)
    if isinstance(cached, str):
        return os.path.dirname(cached)
    reason = hub_offline_reason()
    if reason is not None:
        raise ValueError(f"lora_path {repo_id!r} is not an existing folder, and as a Hub id it is "
                         f"not in the local Hugging Face cache while the Hub cannot be used "
                         f"({reason})")
    try:
        return snapshot_download(repo_id)
    except Exception as exc:  # noqa: BLE001 - any download failure is a bad lora_path
        raise ValueError(f"lora_path {repo_id!r} is not an existing folder and could not be "
                         f"downloaded as a Hub id: {exc}") from exc


class Adapters:
    """Names -> adapter keys of one runner, and the retired keys' reasons.

    Args:
        runner: a runner with ``add_adapter`` / ``remove_adapter``.
        front: the model's :class:`~genback.core.front.Front`, which builds and owns this part
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
        ``adapters.safetensors``: :mod:`genback.llm.mlx.lora`), or a Hub id read from the
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
