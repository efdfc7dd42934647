"""The heap freeze at the first model's construction (genback.heap)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import gc, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel
sys.path.insert(0, {tests!r})
from _vocab_fixtures import gpt2_tokenizer
from genback.llm import AsyncTransformer
tok = gpt2_tokenizer()
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=16, n_layer=1, n_head=2)
before = gc.get_freeze_count()
lm = AsyncTransformer(GPT2LMHeadModel(cfg).eval(), tok)
after_first = gc.get_freeze_count()
kept = [{{}} for _ in range(5000)]  # tracked objects a second freeze would take
AsyncTransformer(GPT2LMHeadModel(cfg).eval(), tok)
print(before, after_first, gc.get_freeze_count())
"""


def _run(env_value):
    env = dict(os.environ)
    env.pop("GENBACK_GC_FREEZE", None)
    if env_value is not None:
        env["GENBACK_GC_FREEZE"] = env_value
    tests = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=tests)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [int(x) for x in out.stdout.split()[-3:]]


def test_first_model_freezes_the_loaded_heap_once():
    before, first, second = _run(None)
    assert before == 0
    assert first > 10_000  # torch, transformers and the model's objects
    # the second model does not freeze again: the 5,000 objects made in between stay
    # collectable (the permanent generation's count moves only by objects retracked meanwhile)
    assert abs(second - first) < 1_000


def test_gc_freeze_can_be_turned_off():
    assert _run("0") == [0, 0, 0]
