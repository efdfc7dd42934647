"""``genback chars``: the next-character distribution from the trie, checked by brute force."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

torch.set_num_threads(1)

ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+(-?[\d.]+|-inf)\s+(.*)$")


def _first_char(b: bytes):
    """The first whole UTF-8 character of ``b``, or ``None`` if ``b`` ends inside it / is not UTF-8."""
    for k in range(1, min(4, len(b)) + 1):
        try:
            return b[:k].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return None


@pytest.mark.slow
def test_chars_top_next_characters_match_brute_force(smol_hf):
    from genback.llm import AsyncTransformer

    prompt = "The capital of Fr"
    out = subprocess.run([sys.executable, "-m", "genback.cli", "chars", prompt, "--top-k", "5"],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    rows = [m.groups() for m in map(ROW.match, out.splitlines()) if m]
    assert len(rows) == 5, out

    lm = AsyncTransformer(*smol_hf)
    probs = lm.next_token_logprobs_sync(lm.tokenizer.encode(prompt, add_special_tokens=False)).double().exp()
    by_char = defaultdict(float)
    for tok, p in zip(lm.byte_vocab, probs.tolist()):
        c = _first_char(bytes(tok))
        if c is not None:
            by_char[c] += p
    lm.close()
    expected = sorted(by_char.items(), key=lambda kv: -kv[1])[:3]
    got = [(ast.literal_eval(label.split(" (")[0]), float(prob)) for _, prob, _, label in rows]  # repr()s
    probs_shown = [p for _, p in got]
    assert probs_shown == sorted(probs_shown, reverse=True)
    for (char, p), (gchar, gp) in zip(expected, got):  # the top characters, in order, with their mass
        assert gchar == char and abs(gp - p) < 1e-3, (expected, got)
    total = float(re.search(r"all characters ([\d.]+)", out).group(1))
    assert abs(total - 1.0) < 1e-3
