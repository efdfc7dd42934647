"""LoRA adapters on a transformers model through ``peft``: load, remove, switch per forward.

The first adapter wraps the model's target modules in place (``peft.PeftModel.from_pretrained``
injects LoRA layers into the very modules the runner calls), later adapters are loaded beside it.
Every adapter gets an internal key (an int, never reused), so a name registered again is a new
adapter whose KV and rows cannot be confused with the old one's. Before each forward the runner
calls :meth:`LoraAdapters.activate` with the key of the rows it computes (None: adapters off,
the base model).

Not thread-safe: the owner serialises access (``AsyncLM``'s forward lock).
"""

from __future__ import annotations

import os
import warnings

_CONFIG = "adapter_config.json"


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
    if not os.path.isfile(os.path.join(path, _CONFIG)):
        raise ValueError(f"lora_path {path!r} holds no peft adapter (no {_CONFIG}); save one with "
                         "PeftModel.save_pretrained")
    return path


def _hub_adapter(repo_id: str) -> str:
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        raise ValueError(f"lora_path {repo_id!r} is not an existing folder (nor a Hub id "
                         "'org/name')")
    from huggingface_hub import snapshot_download, try_to_load_from_cache

    from ...registry import hub_offline_reason

    cached = try_to_load_from_cache(repo_id, _CONFIG)
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


class LoraAdapters:
    """The adapters loaded into one model.

    Args:
        model: the transformers model the runner forwards (modified in place by the first
            :meth:`add`).
    """

    def __init__(self, model):
        self.model = model
        self._peft = None  # the PeftModel wrapper, once an adapter was loaded
        self._next_key = 0
        self._active: int | None | str = "unset"

    @staticmethod
    def _name(key: int) -> str:
        return f"genback_lora_{key}"

    def add(self, path: str) -> int:
        """Load the adapter in folder ``path``; return its new key.

        Raises:
            ImportError: peft is not installed.
            ValueError: peft cannot load it for this model (message gives peft's reason).
        """
        try:
            from peft import PeftModel
        except ImportError as exc:
            raise ImportError('LoRA adapters need peft: pip install "genback[lora]"') from exc
        key, self._next_key = self._next_key, self._next_key + 1
        try:
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(self.model, path,
                                                       adapter_name=self._name(key))
            else:
                self._peft.load_adapter(path, adapter_name=self._name(key))
        except (ValueError, KeyError, RuntimeError, OSError) as exc:
            raise ValueError(f"lora_path {path!r} could not be loaded as a LoRA adapter of "
                             f"{type(self.model).__name__}: {exc}") from exc
        self.model.eval()
        self._active = "unset"
        return key

    def remove(self, key: int) -> None:
        """Unload adapter ``key`` (its LoRA weights are freed)."""
        if self._peft is not None:
            with warnings.catch_warnings():  # peft says which adapter it made active instead;
                warnings.simplefilter("ignore", UserWarning)  # activate() sets it per forward
                self._peft.delete_adapter(self._name(key))
            self._active = "unset"

    @property
    def loaded(self) -> bool:
        """Whether any adapter was ever loaded (the model is then wrapped by peft)."""
        return self._peft is not None

    def activate(self, key: int | None) -> None:
        """Make the model's forward use adapter ``key`` (None: the base model)."""
        if key == self._active or self._peft is None:
            return
        lora_model = self._peft.base_model  # peft's LoraModel over self.model
        if key is None:
            lora_model.disable_adapter_layers()
        else:
            lora_model.enable_adapter_layers()
            lora_model.set_adapter(self._name(key))
        self._active = key
