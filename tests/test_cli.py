"""The command-line main job on the real embedded model."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "genback.cli", *args], capture_output=True,
                          text=True, check=True, timeout=600).stdout


def test_logprobs_prints_paris_first(smol_lm):
    out = run("logprobs", "The capital of France is", "--top-k", "5")
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+\s+\d+", line)]
    assert len(rows) == 5
    rank, tid, prob, logprob, token = rows[0].split(None, 4)
    assert token == "' Paris'"
    row = smol_lm.next_token_logprobs_uncached(smol_lm.tokenizer.encode("The capital of France is"))
    assert int(tid) == int(row.argmax())
    assert abs(float(logprob) - float(row.max())) < 1e-3
    assert abs(float(prob) - math.exp(float(row.max()))) < 1e-3


@pytest.mark.slow
def test_sample_prints_completions_and_statistics():
    out = run("sample", "Once upon a time", "--particles", "4", "--max-tokens", "6")
    assert len(re.findall(r"^\[ ?\d\] Once upon a time", out, flags=re.M)) == 4
    stats = re.search(r"tokens forwarded (\d+) vs tokens in all queries (\d+)", out)
    assert stats and int(stats.group(1)) < int(stats.group(2))
    assert re.search(r"forwards \d+, mean batch size [\d.]+", out)
