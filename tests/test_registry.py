"""The embedded model cache: concurrent first use, interrupted conversion, exact reloads."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from genback.registry import EMBEDDED_MODELS, is_ready, model_dir, resolve

CONVERT = (
    "import sys, torch; from genback.registry import ensure_converted; "
    "print(ensure_converted('smollm2-135m'), flush=True)"
)


def _env(home):
    return {**os.environ, "GENBACK_HOME": str(home), "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_interrupted_then_concurrent_conversion(tmp_path, smol_hf):
    env = _env(tmp_path)
    # a conversion killed half-way is never taken for a finished one
    victim = subprocess.Popen([sys.executable, "-c", CONVERT], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and not list((tmp_path / "models").glob(".smollm2-135m.*")):
        time.sleep(0.2)
    time.sleep(2.0)  # let it write part of the folder
    victim.kill()
    victim.wait()
    assert not (tmp_path / "models" / "smollm2-135m" / "genback-ready.txt").exists()

    # two processes starting at once: both succeed, the lock makes one convert and one wait
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    final = tmp_path / "models" / "smollm2-135m"
    assert all(o[0].strip() == str(final) for o in outs)
    assert not list((tmp_path / "models").glob(".smollm2-135m.*"))  # stale temp folders gone

    # the converted folder gives the same log-probs as the session's model
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    model, tok = smol_hf
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.inference_mode():
        assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_resolution_rules(tmp_path, monkeypatch):
    monkeypatch.setenv("GENBACK_HOME", str(tmp_path))
    assert model_dir("smollm2-135m") == tmp_path / "models" / "smollm2-135m"
    assert not is_ready("smollm2-135m")
    with pytest.raises(ValueError, match="holds no model"):  # an empty folder
        resolve(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{}")
    assert resolve(str(tmp_path)) == str(tmp_path)  # an existing local model folder
    # Hub ids (returned unchanged when cached or the Hub is reachable): tests/test_offline.py
    with pytest.raises(ValueError, match="must be non-empty"):
        resolve("  ")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match="model 'gpt-17' is a Hub id that is not in the local"):
        resolve("gpt-17")  # a legacy Hub id without an organisation, not cached
    assert "smollm2-135m" in EMBEDDED_MODELS


def test_models_command_lists_aliases(tmp_path):
    out = subprocess.run([sys.executable, "-m", "genback.cli", "models"], env=_env(tmp_path),
                         capture_output=True, text=True, check=True).stdout
    assert "smollm2-135m" in out and " no " in out  # not converted in this fresh home
    # one column per field: every alias row's description starts where the header's does
    header, *rows = [ln for ln in out.splitlines() if not ln.startswith(" ")]
    column = header.index("description")
    assert [r[column:].split(" (")[0].split(" ")[0] for r in rows] == [
        m.description.split(" ")[0] for m in EMBEDDED_MODELS.values()]
