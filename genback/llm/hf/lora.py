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

import warnings

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
