"""Every command of README.md and docs/ runs as written from the repository root.

The commands are the lines of the fenced shell blocks (```bash, ```sh, ```console) and the
four-space-indented command lines of README.md and every page under docs/, with ``\\``
continuations joined, trailing ``# comments`` dropped and ``&&`` chains split into their steps.
(Commands quoted inline in prose are fragments or error messages; the mistakes table of
docs/cli.md is run by tests/test_cli_errors.py.) Each step is checked as follows:

* ``genback ...`` and ``python ...`` run for real, from the repository root, offline
  (``HF_HUB_OFFLINE=1``), as ``python -m genback.cli`` of this checkout, and must exit 0 --
  except the ones that need what no CI machine has (a GPU, several processes on GPUs, a model or
  dataset from the Hub: the commands of :data:`NEEDS_MORE`), whose arguments are parsed by the
  same parsers instead (genback's, lm-eval's), and ``python -m pytest -q``, the test suite
  itself, which is collected (``--collect-only``) instead of run.
* ``pip install`` / ``pip uninstall`` are checked without installing: every requirement parses
  (``packaging``), every ``-r`` file exists and its lines parse, every path of ``-e`` exists and
  every extra named (``.[dev,eval]``, ``genback[vllm]``) is defined in pyproject.toml, and
  ``--index-url`` is an https URL.
* ``mkdocs build --strict`` must be what .ci/run runs (it builds the site after the tests, with
  the ``docs`` extra the test run does not have); ``hf``, ``torchrun`` and ``accelerate launch``
  must exist and take the options the command gives (their ``--help``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|console|shell)\n(.*?)^```", re.S | re.M)
INDENTED = re.compile(r"^    ((?:pip|genback|python) .*)$", re.M)

# commands (a substring identifies each) that need a GPU, GPUs, or the Hub: parsed, not run
NEEDS_MORE = {
    "--device cuda:0": "a CUDA GPU and SmolLM2-1.7B from the Hub",
    "--tasks hellaswag": "the hellaswag dataset from the Hub",
    "--model ./smollm2-360m": "SmolLM2-360M downloaded by the hf download line before it",
}


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _commands() -> list[tuple[str, str]]:
    """``(where, step)`` of every documented command step, in page order."""
    found = []
    for page in _pages():
        text = page.read_text()
        where = str(page.relative_to(ROOT))
        blocks = [m.group(1) for m in SHELL_BLOCK.finditer(text)]
        lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
        lines += [m.group(1) for m in INDENTED.finditer(text)]
        for line in lines:
            line = re.sub(r"\s+#\s.*$", "", line).strip()  # a trailing comment
            if not line or line.startswith("#"):
                continue
            for step in line.split(" && "):
                found.append((where, " ".join(step.split())))
    return found


COMMANDS = _commands()


def _extras() -> set[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def _check_requirement(spec: str) -> None:
    from packaging.requirements import Requirement

    req = Requirement(spec)
    if req.name == "genback" or spec.startswith("."):
        assert req.extras <= _extras(), f"{spec}: unknown extras {req.extras - _extras()}"


def _check_pip(argv: list[str]) -> None:
    assert argv[1] in ("install", "uninstall"), argv
    args = iter(argv[2:])
    for arg in args:
        if arg in ("-r", "--requirement"):
            path = ROOT / next(args)
            assert path.is_file(), path
            for line in path.read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    _check_requirement(line)
        elif arg in ("-e", "--editable"):
            target = next(args)
            path, _, extras = target.partition("[")
            assert (ROOT / path).is_dir(), target
            if extras:
                named = set(extras.rstrip("]").split(","))
                assert named <= _extras(), f"{target}: unknown extras {named - _extras()}"
        elif arg in ("--index-url", "--extra-index-url"):
            assert next(args).startswith("https://")
        elif arg.startswith("-"):
            assert arg in ("--no-deps", "-y", "-q", "-U", "--upgrade"), arg
        else:
            _check_requirement(arg)


def _check_parsed(argv: list[str]) -> None:
    """The arguments of a genback command that cannot run here, parsed as genback parses them."""
    if argv[:3] == ["python", "-m", "genback.engine.lm_eval_model"]:  # lm-eval's CLI, registered
        rest = ["lm-eval", *argv[3:]]
    else:  # genback ..., torchrun / accelerate launch ... -m genback ...
        rest = argv[argv.index("genback") + 1:]
    if rest[:1] == ["lm-eval"]:
        pytest.importorskip("lm_eval", reason='lm-eval is in the [eval] extra')
        from lm_eval._cli.harness import HarnessCLI  # lm-eval's own parser

        from genback.cli.lm_eval import with_model

        parsed = HarnessCLI()._parser.parse_args(["run", *with_model(rest[1:])])
        assert parsed.model == "genback" and parsed.tasks
        return
    from genback.cli.parser import build_parser

    build_parser().parse_args(rest)


def _help_mentions(argv: list[str], *options: str) -> None:
    out = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    for option in options:
        assert option in out.stdout, (argv, option)


@pytest.mark.slow
@pytest.mark.parametrize("where,step", COMMANDS, ids=[f"{w}: {s[:60]}" for w, s in COMMANDS])
def test_documented_command_runs_from_the_root(where, step):
    argv = shlex.split(step)
    tool = argv[0]
    if tool == "pip":
        _check_pip(argv)
    elif tool == "mkdocs":
        assert step in (ROOT / ".ci" / "run").read_text(), step
    elif tool == "hf":
        _help_mentions(["hf", argv[1]], "--local-dir")
    elif tool == "torchrun":
        _help_mentions(["torchrun"], "--nproc_per_node")
        _check_parsed(argv)
    elif tool == "accelerate":
        _help_mentions(["accelerate", "launch"], "--num_processes")
        _check_parsed(argv)
    elif argv[:3] == ["python", "-m", "pytest"]:
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0"],
                             cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
        assert out.returncode == 0 and " tests collected" in out.stdout, out.stdout[-2000:]
    elif any(key in step for key in NEEDS_MORE):
        _check_parsed(argv)
        if argv[0] == "python":
            _help_mentions([sys.executable, *argv[1:3]])
    else:
        assert tool in ("genback", "python"), f"{where}: no check for {step!r}"
        run = [sys.executable, "-m", "genback.cli", *argv[1:]] if tool == "genback" \
            else [sys.executable, *argv[1:]]
        out = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
        assert out.returncode == 0, f"{where}: {step}\n{out.stderr[-3000:]}"


def test_the_commands_were_found():
    """The extraction finds the pages' commands (so a changed page format cannot empty the list)."""
    steps = [s for _, s in COMMANDS]
    assert 'genback logprobs "The capital of France is"' in steps
    assert any(s.startswith("genback lm-eval") and "examples/own_data" in s for s in steps)
    assert sum(s.startswith("pip ") for s in steps) >= 10
    assert any(s == "python -m pytest -q" for s in steps)
