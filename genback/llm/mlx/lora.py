"""mlx-lm LoRA adapters chosen per forward on one model (``AsyncMlxLM.add_new_lora``).

An adapter is a folder as mlx-lm's trainer saves it: ``adapter_config.json``
(``fine_tune_type: "lora"``, ``num_layers``, ``lora_parameters: {rank, scale, dropout[, keys]}``)
and ``adapters.safetensors`` (``<module path>.lora_a`` ``[in, r]`` and ``.lora_b`` ``[r, out]``).

The first adapter fixes the model's *layout*: mlx-lm's own ``linear_to_lora_layers`` picks the
linear modules its config names, and each becomes a ``SwitchLoRA`` (:func:`_switch_class`)
that computes ``linear(x) + scale * (x @ a) @ b`` with the active adapter's ``(a, b, scale)``,
or exactly ``linear(x)`` when none is active (the base model is bit-for-bit unchanged). Later
adapters must have the same layout (``num_layers``, ``keys``); their rank and scale may differ.
Dropout is a training-time setting and is not applied (inference).
"""

from __future__ import annotations

import itertools
import json
import os

from ...core.adapters import ADAPTER_CONFIG as _CONFIG
_WEIGHTS = "adapters.safetensors"


class _Weights:
    """One adapter's arrays for one module (a plain object: not an mlx parameter)."""

    __slots__ = ("a", "b", "scale")

    def __init__(self, a, b, scale: float):
        self.a, self.b, self.scale = a, b, scale


def _switch_class():
    import mlx.nn as nn

    class SwitchLoRA(nn.Module):
        """A linear module plus whichever adapter is active (``self.active``; None: none)."""

        def __init__(self, linear):
            super().__init__()
            self.linear = linear
            self.active = None  # _Weights of the active adapter for this module

        def __call__(self, x):  # x: [..., in] -> [..., out]
            y = self.linear(x)
            w = self.active
            if w is None:
                return y
            return y + (w.scale * ((x @ w.a) @ w.b)).astype(x.dtype)

    return SwitchLoRA


class MlxAdapters:
    """Adapters of one mlx-lm model, keyed by int; ``activate(key)`` before a forward.

    All methods run on the runner's MLX thread.
    """

    def __init__(self, model):
        self.model = model
        self.layout: tuple | None = None  # (num_layers, keys) of the first adapter
        self.modules: dict[str, object] = {}  # module path -> SwitchLoRA
        self.adapters: dict[int, dict[str, _Weights]] = {}
        self.active: int | None = None
        self._keys = itertools.count(1)

    def add(self, path: str) -> int:
        """Load the mlx-lm adapter in folder ``path``; return its new key.

        Raises:
            ValueError: not an mlx-lm LoRA adapter (no ``adapters.safetensors``, another
                ``fine_tune_type``, a bad config), or a layout other than the model's adapters'.
        """
        import mlx.core as mx

        config, weights_file = _read(path)
        params = config["lora_parameters"]
        layout = (int(config["num_layers"]), tuple(sorted(params["keys"])) if params.get("keys")
                  else None)
        if self.layout is None:
            self._wrap(layout, params)
        elif layout != self.layout:
            raise ValueError(
                f"lora_path {path!r}: adapter layout (num_layers, keys) = {layout} differs from "
                f"the layout {self.layout} of the adapters already loaded on this model (mlx-lm "
                "adapters of one model must wrap the same modules)")
        by_module = self._by_module(mx.load(weights_file), path)
        scale = float(params["scale"])
        weights = {module: self._weights(module, pair, scale, path)
                   for module, pair in by_module.items()}
        key = next(self._keys)
        self.adapters[key] = weights
        return key

    def _by_module(self, arrays: dict, path: str) -> dict[str, dict]:
        """The adapter's arrays by wrapped module path: ``{module: {"lora_a": a, "lora_b": b}}``.
        Raises ValueError for a weight that is not the ``lora_a`` / ``lora_b`` of a wrapped
        module."""
        by_module: dict[str, dict] = {}
        for name, value in arrays.items():
            module, _, kind = name.rpartition(".")
            if kind not in ("lora_a", "lora_b") or module not in self.modules:
                raise ValueError(f"lora_path {path!r}: weight {name!r} does not fit the adapter "
                                 f"layout {self.layout} (wrapped modules: "
                                 f"{sorted(self.modules)[:4]}...)")
            by_module.setdefault(module, {})[kind] = value
        return by_module

    def _weights(self, module: str, pair: dict, scale: float, path: str) -> _Weights:
        """One module's ``(a [in, r], b [r, out], scale)``, cast to the dtype of the wrapped
        linear's weight (of its scales for a quantized base) and evaluated. Raises ValueError
        unless ``pair`` holds both ``lora_a`` and ``lora_b``."""
        import mlx.core as mx

        if set(pair) != {"lora_a", "lora_b"}:
            raise ValueError(f"lora_path {path!r}: module {module!r} has {sorted(pair)} but "
                             "needs both lora_a and lora_b")
        linear = self.modules[module].linear
        dtype = linear.weight.dtype
        if not mx.issubdtype(dtype, mx.floating):  # quantized base: its scales' dtype
            dtype = getattr(linear, "scales", mx.zeros((), mx.float16)).dtype
        a, b = pair["lora_a"].astype(dtype), pair["lora_b"].astype(dtype)
        mx.eval(a, b)
        return _Weights(a, b, scale)

    def remove(self, key: int) -> None:
        self.adapters.pop(key, None)
        if self.active == key:
            self.activate(None)

    def activate(self, key: int | None) -> None:
        """Make adapter ``key`` (None: the base model) the one the next forwards use."""
        if key == self.active:
            return
        weights = self.adapters[key] if key is not None else {}
        for module_path, module in self.modules.items():
            module.active = weights.get(module_path)
        self.active = key

    def _wrap(self, layout: tuple, params: dict) -> None:
        from mlx.utils import tree_unflatten
        from mlx_lm.tuner.lora import LoRALinear
        from mlx_lm.tuner.utils import linear_to_lora_layers

        num_layers, keys = layout
        config = {"rank": int(params["rank"]), "scale": float(params["scale"]), "dropout": 0.0}
        if keys is not None:
            config["keys"] = list(keys)
        linear_to_lora_layers(self.model, num_layers, config)
        switch = _switch_class()
        found, other = [], []
        for name, module in self.model.named_modules():
            if isinstance(module, LoRALinear):
                found.append((name, switch(module.linear)))
            elif type(module).__module__.startswith("mlx_lm.tuner"):
                other.append(f"{name} ({type(module).__name__})")
        if other:
            raise ValueError(f"mlx-lm adapters that wrap non-linear modules are not supported: "
                             f"{other[:3]}")
        self.model.update_modules(tree_unflatten(found))
        self.modules = {name: module for name, module in found}
        self.layout = layout


def _read(path: str) -> tuple[dict, str]:
    """(config, weights file) of the mlx-lm adapter folder ``path``; ValueError if it is not one."""
    weights = os.path.join(path, _WEIGHTS)
    try:
        with open(os.path.join(path, _CONFIG)) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"lora_path {path!r}: unreadable {_CONFIG}: {exc}") from exc
    if not os.path.isfile(weights):
        raise ValueError(f"lora_path {path!r} is not an mlx-lm adapter (no {_WEIGHTS}; a peft "
                         "adapter must be converted, or trained with mlx_lm.lora)")
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ValueError(f"lora_path {path!r}: fine_tune_type {kind!r} is not supported (only "
                         "'lora')")
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or not {"rank", "scale"} <= set(params) or \
            not isinstance(config.get("num_layers"), int):
        raise ValueError(f"lora_path {path!r}: {_CONFIG} needs num_layers (int) and "
                         f"lora_parameters with rank and scale, got {config!r}")
    return config, weights
