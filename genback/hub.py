"""The Hugging Face Hub as seen from here: whether it can be used now, the local caches a Hub id
is looked up in, and a cached snapshot's folder. :mod:`genback.registry` resolves model names
with them (and re-exports them: ``genback.registry.hub_offline_reason`` is this one)."""

from __future__ import annotations

import os

_TRUE = {"1", "on", "yes", "true"}


def hub_offline_reason(timeout: float = 0.5) -> str | None:
    """Why the Hugging Face Hub cannot be used now, or ``None`` when it may be.

    ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to 1/on/yes/true is a reason. Otherwise a
    TCP connection to the Hub endpoint (``HF_ENDPOINT``, default ``huggingface.co:443``) is tried
    for at most ``timeout`` seconds, name lookup included; with an HTTP(S) proxy configured no
    probe is made (the proxy decides) and ``None`` is returned.
    """
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var}={os.environ[var]} is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    import socket
    import threading
    from urllib.parse import urlsplit

    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    outcome: list = []

    def probe():  # name lookup cannot be given a timeout: run it on a daemon thread
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(f"{host}:{port} is unreachable ({exc})")

    thread = threading.Thread(target=probe, daemon=True, name="genback-hub-probe")
    thread.start()
    thread.join(timeout)
    if not outcome:
        return f"{host}:{port} did not answer within {timeout:g} s"
    return outcome[0]


#: files one of which a cached repo holds: a model, a tokenizer alone, or a peft adapter
_REPO_MARKERS = ("config.json", "tokenizer_config.json", "tokenizer.json", "adapter_config.json")


def hf_hub_caches() -> list[str]:
    """The local Hugging Face Hub caches a Hub id is looked up in, in order: ``huggingface_hub``'s
    (``constants.HF_HUB_CACHE``, read once at its import: where transformers reads and writes),
    then the one the environment names now (``HF_HUB_CACHE``, else ``HF_HOME/hub``) when it differs:
    set after that import (by a test, a notebook, or a package such as tokenicer)."""
    try:
        from huggingface_hub import constants

        caches = [constants.HF_HUB_CACHE]
    except ImportError:
        caches = [os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")]
    if os.environ.get("HF_HUB_CACHE"):
        caches.append(os.path.expanduser(os.environ["HF_HUB_CACHE"]))
    elif os.environ.get("HF_HOME"):
        caches.append(os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub"))
    return list(dict.fromkeys(caches))


def cached_snapshot(repo_id: str) -> str | None:
    """The snapshot folder of Hub id ``repo_id`` (its ``main`` revision) in the first of
    :func:`hf_hub_caches` that holds one of a model's or tokenizer's files, else None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for cache in hf_hub_caches():
        for marker in _REPO_MARKERS:
            try:
                found = try_to_load_from_cache(repo_id, marker, cache_dir=cache)
            except ValueError:  # not a valid repo id (huggingface_hub's check)
                return None
            if isinstance(found, str):
                return os.path.dirname(found)
    return None
