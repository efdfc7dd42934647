"""Offline behaviour of model names: a Hub id that cannot be had fails at once, with advice.

No test here touches the network: the Hub is either switched off (``HF_HUB_OFFLINE=1``) or
pointed at a local port where nothing listens (``HF_ENDPOINT``), which refuses at once.
"""

from __future__ import annotations

import socket

import pytest

from genback import registry
from genback.registry import check_hub_id_available, hub_offline_reason, resolve


@pytest.fixture
def closed_port():
    with socket.socket() as s:  # a port that was free a moment ago: connecting is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def _cache_model(cache, repo_id):
    """Lay out a Hub id in a Hugging Face cache as ``hf download`` would (refs + snapshot)."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")


def test_hub_id_with_hub_off_fails_with_advice(monkeypatch, empty_hf_cache):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    probes = []
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: probes.append(a))
    with pytest.raises(ValueError) as info:
        resolve("someorg/somemodel")
    message = str(info.value)
    assert "HF_HUB_OFFLINE=1 is set" in message
    assert "not in the local Hugging Face cache" in message and str(empty_hf_cache) in message
    assert "local folder" in message and "HF_HUB_CACHE" in message and "smollm2-135m" in message
    assert "\n" not in message
    assert probes == []  # switched off: no connection is even tried


def test_hub_id_with_hub_unreachable_fails_with_advice(monkeypatch, empty_hf_cache, closed_port):
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy",
                "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port}")
    assert f"127.0.0.1:{closed_port} is unreachable" in hub_offline_reason()
    with pytest.raises(ValueError, match=f"127.0.0.1:{closed_port} is unreachable"):
        resolve("someorg/somemodel")


def test_cached_hub_id_is_its_snapshot_offline(monkeypatch, empty_hf_cache):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _cache_model(empty_hf_cache, "someorg/cached-model")
    snapshot = empty_hf_cache / "models--someorg--cached-model" / "snapshots" / ("0" * 40)
    assert resolve("someorg/cached-model") == str(snapshot)  # the files transformers would read
    check_hub_id_available("someorg/cached-model")  # no error


@pytest.mark.parametrize("value,off", [("1", True), ("true", True), ("ON", True), ("0", False), ("", False)])
def test_offline_flag_values(monkeypatch, value, off, closed_port):
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port}")
    reason = hub_offline_reason()
    assert ("HF_HUB_OFFLINE" in (reason or "")) == off
    assert reason is not None  # off, or the (closed) endpoint is unreachable


def test_embedded_aliases_and_folders_never_probe_the_hub(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(registry, "hub_offline_reason", lambda *a, **k: calls.append(a))
    (tmp_path / "config.json").write_text("{}")  # a model folder (resolve refuses empty ones)
    assert resolve(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="neither an embedded alias"):
        resolve("./no/such/folder")
    assert calls == []
