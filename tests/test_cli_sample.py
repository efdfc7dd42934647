"""``genback sample``: its progress bar (on a terminal only, off with ``--quiet``), what ``--tree``
checks before any work, and that it draws what ``lm.batch_sample`` draws.

Each runs a real ``genback`` process (``python -m genback.cli``) offline; the progress bar's
terminal is a pseudo-terminal (``pty``) holding standard error.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
SAMPLE = ["sample", "Once upon a time", "--backend", "mock", "--particles", "3",
          "--max-tokens", "6", "--seed", "1"]


def _run_with_terminal_stderr(args: list[str]) -> tuple[int, str, str]:
    """Run genback with standard error on a pseudo-terminal; (status, stdout, what the terminal got)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 120 columns
    proc = subprocess.Popen([sys.executable, "-m", "genback.cli", *args], env=ENV,
                            stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the process closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out = proc.stdout.read()
    status = proc.wait(timeout=300)
    os.close(leader)
    return status, out, b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal():
    status, out, terminal = _run_with_terminal_stderr(SAMPLE)
    assert status == 0, terminal
    assert "sampling" in terminal and "tok/s" in terminal and "alive=" in terminal
    assert "alive=0" in terminal  # every particle finished
    assert "tok/s" not in out  # standard output holds only the answer


def test_quiet_and_a_pipe_show_no_bar():
    status, out, terminal = _run_with_terminal_stderr([*SAMPLE, "--quiet"])
    assert status == 0 and "tok/s" not in terminal and "alive=" not in terminal
    piped = subprocess.run([sys.executable, "-m", "genback.cli", *SAMPLE], env=ENV,
                           capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0 and "alive=" not in piped.stderr
    def completions(text):
        return [line for line in text.splitlines() if line.startswith("[")]

    assert completions(piped.stdout) == completions(out)  # the same draws, bar or no bar


def test_particles_draw_what_batch_sample_draws():
    from genback.llm import MockAsyncLM

    out = subprocess.run([sys.executable, "-m", "genback.cli", *SAMPLE], env=ENV,
                         capture_output=True, text=True, timeout=300).stdout
    lm = MockAsyncLM.from_name("smollm2-135m")
    ids = lm.tokenizer.encode("Once upon a time", add_special_tokens=False)
    eos = [lm.tokenizer.eos_token_id]
    want = asyncio.run(lm.batch_sample([ids] * 3, 6, eos, seed=1))
    lm.close()
    for i, tokens in enumerate(want):
        text = ("Once upon a time" + lm.tokenizer.decode(tokens)).replace("\n", "\\n")
        assert f"[{i:>2}] {text}\n" in out


@pytest.mark.parametrize("blocked", ["graphviz"])
def test_tree_without_graphviz_is_refused_before_loading(tmp_path, blocked):
    code = (f"import sys; sys.modules[{blocked!r}] = None; from genback.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "sample", "Once", "--tree",
                           str(tmp_path / "tree.gv")], env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "argument --tree: needs the graphviz package" in proc.stderr
    assert "loading" not in proc.stderr  # refused before the model was loaded
    assert not (tmp_path / "tree.gv").exists()
