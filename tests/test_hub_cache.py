"""Hub ids load offline from a local Hugging Face cache.

The test builds a cache (``HF_HOME`` in a temp dir) holding genback's converted SmolLM2 under a
Hub id, written by ``huggingface_hub``'s own cache-layout functions (``_hub_standins.add_to_cache``:
blobs named by content hash, snapshot files linking to them, ``refs/main``), checks that
``huggingface_hub``'s own cache scanner accepts it, then loads the id in a fresh process with ``HF_HUB_OFFLINE=1``
(a new user's process: ``HF_HOME`` is read at import, nothing is patched).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _hub_standins import _commit, _gpt2_tokenizer_files, add_to_cache

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    from huggingface_hub import scan_cache_dir

    from genback.registry import resolve

    home = tmp_path_factory.mktemp("hf_home")
    add_to_cache(home / "hub", HUB_ID, Path(resolve("smollm2-135m")))
    info = scan_cache_dir(home / "hub")  # huggingface_hub's own reading of the cache
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == HUB_ID and repo.repo_type == "model"
    (revision,) = repo.revisions
    assert revision.commit_hash == _commit(HUB_ID) and revision.refs == frozenset({"main"})
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.file_name for f in revision.files}
    return home


_CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from genback.llm import AsyncTransformer, load_model_by_name
hub_id, backend = sys.argv[1], sys.argv[2]
if backend == "hf":
    lm = AsyncTransformer.from_name(hub_id)
else:
    lm = load_model_by_name(hub_id, backend=backend)
ids = lm.tokenizer.encode("The capital of France is")
row = lm.next_token_logprobs_sync(ids)
print(json.dumps({"top": lm.tokenizer.decode(int(row.argmax())), "row": row.tolist()[:2000],
                  "max": float(row.max())}))
lm.close()
"""


def _run_offline(hf_home: Path, backend: str) -> dict:
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    env.pop("TRANSFORMERS_CACHE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _CHILD, HUB_ID, backend], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_hub_id_loads_offline_from_local_cache(hf_home, module_smol_lm):
    got = _run_offline(hf_home, "hf")
    assert got["top"] == " Paris" and abs(got["max"] - (-0.258)) < 5e-3
    ids = module_smol_lm.tokenizer.encode("The capital of France is")
    want = module_smol_lm.next_token_logprobs_uncached(ids)[:2000]
    # 1e-4: the promise for SmolLM2 (README, Exactness); a fresh process may round differently
    assert (torch.tensor(got["row"]) - want).abs().max() < 1e-4


def test_hub_id_loads_offline_on_mlx(hf_home, module_smol_lm):
    pytest.importorskip("mlx_lm", reason='mlx-lm is not installed: pip install "genback[mlx]"')
    got = _run_offline(hf_home, "mlx")
    assert got["top"] == " Paris"
    ids = module_smol_lm.tokenizer.encode("The capital of France is")
    want = module_smol_lm.next_token_logprobs_uncached(ids)[:2000]
    assert (torch.tensor(got["row"]) - want).abs().max() < 1e-3


def test_resolve_finds_cached_id_and_rejects_uncached_one(hf_home, monkeypatch):
    from huggingface_hub import constants

    from genback.registry import resolve

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    assert resolve(HUB_ID) == str(hf_home / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
                                  / "snapshots" / _commit(HUB_ID))  # offline: its snapshot
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        resolve("HuggingFaceTB/SmolLM2-360M-Instruct")


def test_tokenizer_only_repo_resolves_offline(tmp_path, monkeypatch):
    """A Hub repo holding only a tokenizer (what MockAsyncLM.from_name needs) counts as cached."""
    from huggingface_hub import constants

    from genback.registry import resolve

    folder = tmp_path / "tok"
    folder.mkdir()
    _gpt2_tokenizer_files(folder)
    assert not (folder / "config.json").exists()
    add_to_cache(tmp_path / "hub", "someorg/tokenizer-only", folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve("someorg/tokenizer-only").endswith("snapshots/" + _commit("someorg/tokenizer-only"))
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        resolve("someorg/absent")
