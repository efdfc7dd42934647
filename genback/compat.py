"""Opt-in drop-in for genlm-backend: make ``import genlm.backend`` resolve to genback.

Programs written against genlm-backend (llamppl, genlm-control, genlm-bytes) import
``genlm.backend`` and its submodules by name. After::

    import genback.compat
    genback.compat.alias_genlm_backend()

in the same process, *before* those clients are imported, every such import gets genback's
objects instead:

* ``genlm.backend``: a facade module over genback (below);
* ``genlm.backend.llm``: ``genback.llm``; its ``.base``: ``genback.core.lm`` (``AsyncLM``); its
  ``.hf``, ``.vllm``, ``.mlx``: each backend's facade module, ``genback.llm.<name>.model``;
* ``genlm.backend.tokenization`` (``.token``, ``.vocab``): ``genback.tokenization`` (same);
  ``.bytes`` (``get_byte_vocab``, ``ByteVocabError``, ``ByteDecoderError``):
  ``genback.tokenization.vocab``;
* ``genlm.backend.cache`` (``OutputCache``): ``genback.core.output_cache``;
* ``genlm.backend.trie`` (``.base``, ``.parallel``, ``.async_impl``): ``genback.trie`` (same).

The facade ``genlm.backend`` has genlm-backend 0.3.1's top-level names (``load_model_by_name``,
``decode_vocab``, ``Token``, ``AsyncTransformer``, ``AsyncVirtualLM``, ``TokenCharacterTrie``,
``ParallelTokenCharacterTrie``, ``AsyncTokenCharacterTrie``; also ``AsyncLM``, ``MockAsyncLM``,
``AsyncMlxLM``) plus the submodules, each the genback object. ``genlm.backend.llm.sgl`` (SGLang),
which genback has no counterpart for, raises ``ImportError``, as does any other unknown
``genlm.backend.*`` name.

Only ``genlm.backend`` is aliased: ``genlm`` stays the namespace package that genlm-control,
genlm-bytes and genlm-grammar share (it is created as an empty namespace module only when no
``genlm`` distribution is installed). genlm-backend itself may stay installed; it is simply not
imported. Nothing happens unless :func:`alias_genlm_backend` is called.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

__all__ = ["alias_genlm_backend", "remove_genlm_backend_alias", "is_aliased", "ALIASED_MODULES"]

#: ``genlm.backend`` submodule name -> the genback module it resolves to.
ALIASED_MODULES: dict[str, str] = {
    "genlm.backend.llm": "genback.llm",
    "genlm.backend.llm.base": "genback.core.lm",
    "genlm.backend.llm.hf": "genback.llm.hf.model",
    "genlm.backend.llm.vllm": "genback.llm.vllm.model",
    "genlm.backend.llm.mlx": "genback.llm.mlx.model",
    "genlm.backend.tokenization": "genback.tokenization",
    "genlm.backend.tokenization.token": "genback.tokenization.token",
    "genlm.backend.tokenization.vocab": "genback.tokenization.vocab",
    "genlm.backend.tokenization.bytes": "genback.tokenization.vocab",
    "genlm.backend.cache": "genback.core.output_cache",
    "genlm.backend.trie": "genback.trie",
    "genlm.backend.trie.base": "genback.trie.base",
    "genlm.backend.trie.parallel": "genback.trie.parallel",
    "genlm.backend.trie.async_impl": "genback.trie.async_impl",
}

# top-level names of genlm-backend 0.3.1's ``genlm/backend/__init__.py`` -> (genback module, name)
_TOP_LEVEL = {
    "load_model_by_name": ("genback.llm", "load_model_by_name"),
    "AsyncLM": ("genback.llm", "AsyncLM"),
    "AsyncTransformer": ("genback.llm", "AsyncTransformer"),
    "AsyncVirtualLM": ("genback.llm", "AsyncVirtualLM"),
    "MockAsyncLM": ("genback.llm", "MockAsyncLM"),
    "AsyncMlxLM": ("genback.llm", "AsyncMlxLM"),
    "decode_vocab": ("genback.tokenization", "decode_vocab"),
    "Token": ("genback.tokenization", "Token"),
    "TokenCharacterTrie": ("genback.trie", "TokenCharacterTrie"),
    "ParallelTokenCharacterTrie": ("genback.trie", "ParallelTokenCharacterTrie"),
    "AsyncTokenCharacterTrie": ("genback.trie", "AsyncTokenCharacterTrie"),
}

_FACADE_FLAG = "__genback_alias__"


def is_aliased() -> bool:
    """True when ``genlm.backend`` in ``sys.modules`` is genback's facade."""
    mod = sys.modules.get("genlm.backend")
    return mod is not None and getattr(mod, _FACADE_FLAG, False)


def _foreign_genlm_backend() -> list[str]:
    """Names of ``genlm.backend*`` modules already imported from somewhere other than genback."""
    found = []
    for name, mod in list(sys.modules.items()):
        if name != "genlm.backend" and not name.startswith("genlm.backend."):
            continue
        if getattr(mod, _FACADE_FLAG, False):
            continue
        if name in ALIASED_MODULES and mod is sys.modules.get(ALIASED_MODULES[name]):
            continue
        found.append(name)
    return sorted(found)


def _genlm_namespace() -> types.ModuleType:
    """The ``genlm`` package: the installed namespace package, else a new empty namespace module."""
    try:
        return importlib.import_module("genlm")
    except ImportError:
        ns = types.ModuleType("genlm")
        ns.__path__ = []  # a package with no directories: only the alias lives under it
        ns.__package__ = "genlm"
        sys.modules["genlm"] = ns
        return ns


def _make_facade() -> types.ModuleType:
    facade = types.ModuleType(
        "genlm.backend",
        "genback, aliased as genlm.backend by genback.compat.alias_genlm_backend().",
    )
    facade.__package__ = "genlm.backend"
    facade.__spec__ = importlib.machinery.ModuleSpec("genlm.backend", None, is_package=True)
    facade.__path__ = []  # a package: its submodules are the aliases in sys.modules
    setattr(facade, _FACADE_FLAG, True)
    for name, (module, attr) in _TOP_LEVEL.items():
        setattr(facade, name, getattr(importlib.import_module(module), attr))
    for sub in ("llm", "tokenization", "trie"):
        setattr(facade, sub, importlib.import_module(f"genback.{sub}"))
    facade.__all__ = sorted(_TOP_LEVEL)
    import genback

    facade.__version__ = genback.__version__
    return facade


def alias_genlm_backend() -> types.ModuleType:
    """Make ``genlm.backend`` and its submodules resolve to genback in this process.

    Call it before importing llamppl / genlm-control / genlm-bytes (they bind genlm-backend's names
    when imported). Idempotent: later calls return the same facade. It imports ``genback.llm``,
    ``genback.tokenization`` and ``genback.trie`` (and so torch).

    Returns:
        the ``genlm.backend`` facade module (also in ``sys.modules["genlm.backend"]``).

    Raises:
        RuntimeError: genlm-backend's own ``genlm.backend`` (or one of its submodules) was already
            imported in this process — its classes are then already bound in whatever imported
            it, and mixing the two would silently use both. Start a fresh process and call this
            first.
    """
    if is_aliased():
        return sys.modules["genlm.backend"]
    foreign = _foreign_genlm_backend()
    if foreign:
        origin = getattr(sys.modules.get(foreign[0]), "__file__", None)
        raise RuntimeError(
            "alias_genlm_backend: genlm-backend is already imported in this process "
            f"({', '.join(foreign[:4])}{', ...' if len(foreign) > 4 else ''} from {origin}); "
            "call genback.compat.alias_genlm_backend() before importing genlm.backend or any "
            "client (llamppl, genlm.control, genlm.bytes), in a fresh process"
        )
    facade = _make_facade()
    aliases = {name: importlib.import_module(target) for name, target in ALIASED_MODULES.items()}
    genlm = _genlm_namespace()
    sys.modules["genlm.backend"] = facade
    sys.modules.update(aliases)
    genlm.backend = facade
    return facade


def remove_genlm_backend_alias() -> bool:
    """Undo :func:`alias_genlm_backend`: drop the alias entries from ``sys.modules``.

    Modules that already imported names through the alias keep genback's objects. Returns True
    when an alias was removed, False when none was installed.
    """
    if not is_aliased():
        return False
    for name in ["genlm.backend", *ALIASED_MODULES]:
        sys.modules.pop(name, None)
    genlm = sys.modules.get("genlm")
    if genlm is not None and getattr(getattr(genlm, "backend", None), _FACADE_FLAG, False):
        del genlm.backend
    return True
