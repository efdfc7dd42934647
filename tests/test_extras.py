"""Importing a part whose optional extra is missing says which extra and which pip command.

Each check runs in a fresh interpreter where the harness package cannot be imported (its entry in
``sys.modules`` is ``None``, exactly what Python does for a package that is absent), since the
packages themselves are installed in CI.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    ("lm_eval", "from genback.engine import GenbackLM", "GenbackLM", 'pip install "genback[eval]"'),
    ("lm_eval", "import genback.engine.lm_eval_model", "GenbackLM", 'pip install "genback[eval]"'),
    ("evalution", "from genback.engine import GenbackEvalutionEngine", "GenbackEvalutionEngine",
     'pip install "genback[eval]"'),
    ("vllm", "from genback.llm import AsyncVirtualLM; AsyncVirtualLM.from_name('smollm2-135m')",
     "AsyncVirtualLM", "genback[vllm]"),
    ("mlx_lm", "from genback.llm import AsyncMlxLM; AsyncMlxLM.from_name('smollm2-135m')",
     "AsyncMlxLM", "genback[mlx]"),
    ("peft", "from genback.llm import AsyncTransformer; from genback.llm.hf.lora import "
     "LoraAdapters; LoraAdapters(None).add('x')", "LoRA", "genback[lora]"),
]


@pytest.mark.parametrize("blocked,statement,part,command", CASES, ids=[c[1] for c in CASES])
def test_missing_extra_names_itself(blocked, statement, part, command):
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"
            f"try:\n    {statement}\n"
            "except ImportError as exc:\n    print('ImportError:', exc)\n"
            "else:\n    print('no error')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("ImportError:"), out.stdout
    assert part in line and command in line, line


def test_engine_core_needs_no_extra():
    code = ("import sys; sys.modules['lm_eval'] = None; sys.modules['evalution'] = None\n"
            "from genback.engine import GenbackEngine, LoglikelihoodRequest\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
