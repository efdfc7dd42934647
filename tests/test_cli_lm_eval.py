"""``genback lm-eval``: lm-eval's command line with genback's model, and its one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from genback.cli.lm_eval import check_pretrained, explain, with_model

ROOT = Path(__file__).resolve().parents[1]


def _run(args, cwd):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "genback.cli", "lm-eval", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("genback lm-eval: error:")]


def test_model_is_added_to_run_only():
    assert with_model(["--tasks", "x"]) == ["--model", "genback", "--tasks", "x"]
    assert with_model(["run", "--tasks", "x"]) == ["run", "--model", "genback", "--tasks", "x"]
    assert with_model(["ls", "tasks"]) == ["ls", "tasks"]
    assert with_model(["--model=hf", "--tasks", "x"]) == ["--model=hf", "--tasks", "x"]


def test_a_folder_without_a_model_fails_before_lm_eval_starts(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"argument --model_args: pretrained=.*empty: folder .* "
                                         r"holds no model: none of config.json"):
        check_pretrained(["--model_args", f"pretrained={tmp_path / 'empty'},backend=hf"])
    with pytest.raises(ValueError, match="pretrained=gpt2: model 'gpt2' is a Hub id that is not in"):
        check_pretrained(["--model_args=pretrained=gpt2", "--tasks", "x"])
    check_pretrained(["--model_args", "pretrained=smollm2-135m"])  # an alias: not converted here
    check_pretrained(["--model", "hf", "--model_args", "pretrained=gpt2"])  # not genback's model


def test_explain_names_the_task_and_the_download():
    try:
        try:
            raise ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub (OfflineModeIsEnabled)")
        except ConnectionError as inner:
            raise RuntimeError("while building the task") from inner
    except RuntimeError as exc:
        line = explain(exc, "hellaswag", "HF_HUB_OFFLINE=1 is set")
    assert line.startswith("argument --tasks: the dataset of task(s) hellaswag could not be fetched: "
                           "the Hub cannot be used (HF_HUB_OFFLINE=1 is set)")
    assert explain(ValueError("Tasks not found: nosuch"), "nosuch", None).startswith(
        "argument --tasks: Tasks not found: nosuch (list the known tasks")
    assert explain(RuntimeError("boom"), "x", None) == "RuntimeError: boom"


def test_offline_dataset_and_empty_folder_fail_in_one_line(tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is in the [eval] extra")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "genback_hub_only.yaml").write_text(
        "task: genback_hub_only\ndataset_path: genback-no-such-org/no-such-dataset\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{q}}\"\n"
        "doc_to_choice: \"{{c}}\"\ndoc_to_target: 0\n")
    proc = _run(["--tasks", "genback_hub_only", "--include_path", str(tasks), "--limit", "1"],
                tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = _error_lines(proc.stderr)
    assert "the dataset of task(s) genback_hub_only could not be fetched" in line
    assert "genback-no-such-org/no-such-dataset" in line and "HF_HUB_OFFLINE=1" in line
    (tmp_path / "empty").mkdir()
    proc = _run(["--model_args", "pretrained=./empty", "--tasks", "x"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = _error_lines(proc.stderr)
    assert "pretrained=./empty: folder './empty' holds no model" in line


def test_help_shows_genbacks_model_args_and_an_example(tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is in the [eval] extra")
    proc = _run(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, _, theirs = proc.stdout.partition("lm-eval's options:")
    for key in ("pretrained=", "backend=hf|vllm|mlx|mock", "max_length=", "max_gen_toks=",
                "max_in_flight="):
        assert key in ours, key
    assert "genback lm-eval --model_args pretrained=smollm2-135m" in ours and "--include_path examples/own_data" in ours
    assert "--model_args" in theirs and "--tasks" in theirs  # lm-eval's own help follows


WITHOUT_LM_EVAL = ("import sys; sys.modules['lm_eval'] = None; from genback.cli import main; "
                   "sys.exit(main(sys.argv[1:]))")


def test_without_lm_eval_the_error_names_the_extra(tmp_path):
    """As on a machine without the [eval] extra: ``import lm_eval`` is blocked in that process."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", WITHOUT_LM_EVAL, "lm-eval", "--tasks", "x"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith("genback lm-eval: error: ImportError: ")
    assert 'pip install "genback[eval]"' in line, line


# -- embedded models whose packages are missing (not lm-eval, but the same one-line contract) ------


def test_models_and_load_name_a_missing_package(monkeypatch, tmp_path, capsys):
    import argparse

    from genback import registry
    from genback.cli import commands as cli

    monkeypatch.setenv("GENBACK_HOME", str(tmp_path))  # nothing converted yet
    absent = registry.EmbeddedModel(alias="absent-1m", package="genback_no_such_package_xyz",
                                    gguf_file="x.gguf", pip_install="pip install no-such-xyz==1.0",
                                    description="a model whose package is not installed")
    monkeypatch.setitem(registry.EMBEDDED_MODELS, "absent-1m", absent)
    assert registry.missing_packages("absent-1m") == ["genback_no_such_package_xyz"]
    assert registry.missing_packages("smollm2-135m") == []
    assert cli.cmd_models(argparse.Namespace()) == 0
    out = capsys.readouterr().out
    assert "missing: genback_no_such_package_xyz (install: pip install no-such-xyz==1.0)" in out
    assert "smollm2-135m" in out and "installed; converted on first use" in out
    with pytest.raises(cli.UsageError, match=r"argument --model: 'absent-1m' needs the package\(s\) "
                                              r"genback_no_such_package_xyz"):
        cli._check_model_name(argparse.Namespace(model="absent-1m"))
    assert "converting" not in capsys.readouterr().err
