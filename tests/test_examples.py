"""The example scripts run end to end with tiny settings."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_char_constrained_sampler_only_allowed_characters():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "char_constrained_sampler.py"), "--particles", "2",
         "--max-chars", "8", "--prompt", "The capital of France is"],
        capture_output=True, text=True, check=True, timeout=600, cwd=ROOT,
    ).stdout
    lines = re.findall(r"^\[(\d)\] log w\s+(\S+)\s+The capital of France is\|(.*)$", out, flags=re.M)
    assert len(lines) == 2, out
    for _, logw, text in lines:
        assert re.fullmatch(r"[a-z ]{1,8}", text), text
        assert float(logw) <= 0.0
    assert re.search(r"log Z estimate -?\d+\.\d+", out)


OWN_DATA = ROOT / "examples" / "own_data"


@pytest.mark.slow
def test_own_data_task_runs_with_genback_lm_eval(module_smol_lm, tmp_path):
    """``examples/own_data`` (docs: "Evaluate on your own data"): the documented command, run from
    the repository root, gives the accuracy that scoring each choice directly gives. (This is also the
    suite's end-to-end run of ``genback lm-eval``: ``python -m genback`` is the same ``main``.)"""
    pytest.importorskip("lm_eval", reason="lm-eval is in the [eval] extra")
    import json

    from genback.engine import GenbackEngine, LoglikelihoodRequest

    proc = subprocess.run(
        [sys.executable, "-m", "genback", "lm-eval", "--model_args", "pretrained=smollm2-135m",
         "--tasks", "my_qa", "--include_path", "examples/own_data", "--output_path", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"\|\s*my_qa\s*\|.*\|\s*acc\s*\|", proc.stdout), proc.stdout[-2000:]
    assert "genback" in proc.stdout  # lm-eval's header names the model ('--model genback' added)
    [results] = tmp_path.rglob("results_*.json")
    acc = json.loads(results.read_text())["results"]["my_qa"]["acc,none"]
    rows = [json.loads(line) for line in (OWN_DATA / "my_qa.jsonl").read_text().splitlines()]
    with GenbackEngine(lm=module_smol_lm).build() as s:
        right = 0
        for row in rows:
            lps = [o.logprob for o in s.loglikelihood(
                [LoglikelihoodRequest(f"Question: {row['question']}\nAnswer:", " " + c)
                 for c in row["choices"]])]
            right += max(range(len(lps)), key=lps.__getitem__) == row["answer"]
    assert acc == pytest.approx(right / len(rows), abs=1e-6)
