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
