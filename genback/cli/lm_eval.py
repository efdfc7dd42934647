"""``genback lm-eval``: lm-evaluation-harness's own command line with genback's model registered.

Every argument goes to lm-eval unchanged (``--model genback`` is added when no ``--model`` is
given), except genback's ``--debug``. What goes wrong ends in one line on standard error, as in
the other commands: an unknown task, a task whose dataset cannot be fetched (named with the task
and the missing download), a model folder without a model. When the Hugging Face Hub cannot be
used (``HF_HUB_OFFLINE`` set, or the Hub unreachable within half a second) the run is put in
offline mode (``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1`` for this process, before lm-eval
and ``datasets`` are imported), so a missing dataset fails at once instead of after retries.
"""

from __future__ import annotations

import os
import sys

__all__ = ["HELP_HEADER", "LM_EVAL_HELP", "cmd_lm_eval"]

PROG = "genback lm-eval"

LM_EVAL_HELP = (
    "Run lm-evaluation-harness (lm-eval's own command line, the [eval] extra) with genback's "
    "model registered as 'genback'; every argument after 'lm-eval' goes to lm-eval, and "
    "'--model genback' is added when no --model is given. Example (offline, a local task "
    "folder, from the repository root): genback lm-eval --model_args pretrained=smollm2-135m "
    "--tasks my_qa --include_path examples/own_data --limit 20. genback's model_args: pretrained (alias, folder or Hub "
    "id), backend (hf, vllm, mlx, mock), max_length, max_gen_toks, max_in_flight (requests in "
    "flight; lm-eval's --batch_size is accepted and not used: genback batches by itself). "
    "Errors end in one line; add --debug for the traceback.")


HELP_HEADER = """\
genback lm-eval: lm-evaluation-harness's own command line with genback's model registered as
'genback' ('--model genback' is added when no --model is given). Every argument goes to lm-eval
unchanged; lm-eval's options follow below.

genback's --model_args (key=value,key=value):
  pretrained=NAME       embedded alias (default smollm2-135m), a local Hugging Face folder, or a
                        Hub id 'org/name' from the local HF cache
  backend=hf|vllm|mlx|mock
                        which genback backend serves the model (default hf)
  max_length=N          model window in tokens (default: the model's own)
  max_gen_toks=N        most new tokens for generation tasks without their own (default 256)
  max_in_flight=N       most requests of one call in flight at once (default 256); lm-eval's
                        --batch_size is accepted and not used: genback batches by itself
  other keys            options of the backend's from_name (e.g. kv_budget_bytes or
                        row_cache_size for hf)

example (offline: a task YAML over a local JSONL file, as in the repository's examples/own_data
and the docs page "Evaluate on your own data"), from the repository root:
  genback lm-eval --model_args pretrained=smollm2-135m,backend=hf --tasks my_qa \\
      --include_path examples/own_data --limit 20

genback's own option: --debug shows the Python traceback of an error instead of one line.

lm-eval's options:
"""


def _wants_help(args: list[str]) -> bool:
    """``--help`` / ``-h`` for lm-eval's run (not its ``ls`` / ``validate`` subcommands)."""
    return ("-h" in args or "--help" in args) and args[:1] not in (["ls"], ["validate"])


def _one_line(message: str, hint: str = "") -> str:
    return f"{PROG}: error: {' '.join(str(message).split())}{hint}\n"


def _option(args: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` / ``--name=VALUE`` in ``args`` (the last one), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def with_model(args: list[str]) -> list[str]:
    """``args`` with ``--model genback`` added to lm-eval's ``run`` (explicit or implied) when
    no ``--model`` is given; lm-eval's other subcommands (``ls``, ``validate``) unchanged."""
    if args[:1] in (["ls"], ["validate"]) or any(a == "--model" or a.startswith("--model=")
                                                 for a in args):
        return list(args)
    if args[:1] == ["run"]:
        return ["run", "--model", "genback", *args[1:]]
    return ["--model", "genback", *args]


def _go_offline_if_needed() -> str | None:
    """Put this process in Hugging Face offline mode when the Hub cannot be used; the reason."""
    from ..registry import hub_offline_reason

    reason = hub_offline_reason()
    if reason is not None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return reason


def _is_download_error(exc: BaseException) -> bool:
    names = {type(e).__name__ for e in _chain(exc)}
    return bool(names & {"ConnectionError", "OfflineModeIsEnabled", "DatasetNotFoundError",
                         "LocalEntryNotFoundError", "ConnectTimeout", "DataFilesNotFoundError"})


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def explain(exc: BaseException, tasks: str | None, offline: str | None) -> str:
    """One line saying what failed in an lm-eval run, for the user (no traceback)."""
    text = f"{type(exc).__name__}: {exc}"
    if _is_download_error(exc):
        why = f"the Hub cannot be used ({offline})" if offline else "the download failed"
        return (f"argument --tasks: the dataset of task(s) {tasks or '?'} could not be fetched: "
                f"{why}: {text}; put the dataset in the Hugging Face datasets cache "
                f"(HF_HOME / HF_DATASETS_CACHE) or use a local task (--include_path)")
    if isinstance(exc, ValueError) and "Tasks not found" in str(exc):
        return (f"argument --tasks: {exc} (list the known tasks with 'genback lm-eval ls tasks'; "
                f"local task folders need --include_path)")
    return text


def check_pretrained(args: list[str]) -> None:
    """Fail before lm-eval indexes its tasks (tens of seconds) when genback's ``pretrained``
    model cannot be had: an unknown alias, a folder without a model, a Hub id not cached
    while the Hub is off (:func:`genback.registry.resolve`; embedded aliases are not converted
    here).

    Raises:
        ValueError: such a model, as ``argument --model_args: ...``.
    """
    from ..registry import EMBEDDED_MODELS, resolve

    model = _option(args, "--model")
    model_args = _option(args, "--model_args") or ""
    if model not in (None, "genback") or model_args.lstrip().startswith("{"):
        return
    opts = dict(kv.split("=", 1) for kv in model_args.split(",") if "=" in kv)
    name = opts.get("pretrained", "").strip()
    if name and name not in EMBEDDED_MODELS:
        try:
            resolve(name)
        except (TypeError, ValueError, OSError) as exc:
            raise ValueError(f"argument --model_args: pretrained={name}: {exc}") from exc


def cmd_lm_eval(args: list[str]) -> int:
    """``genback lm-eval ARGS...``: run lm-eval's CLI; returns the exit status (0 success,
    2 an ImportError of the [eval] extra or a bad argument, 1 another error)."""
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    offline = _go_offline_if_needed() if "-h" not in args and "--help" not in args else None
    try:  # genback's adapter first: its ImportError names the [eval] extra and its pip command
        from ..engine.lm_eval_model import register_lm_eval
        from lm_eval.__main__ import cli_evaluate
    except ImportError as exc:
        sys.stderr.write(_one_line(f"ImportError: {exc}"))
        return 2
    try:
        check_pretrained(args)
    except ValueError as exc:
        if debug:
            raise
        sys.stderr.write(_one_line(str(exc)))
        return 2
    register_lm_eval()
    if _wants_help(args):
        sys.stdout.write(HELP_HEADER)
        sys.stdout.flush()
    return _run_cli(cli_evaluate, with_model(args), debug, offline)


def _run_cli(cli_evaluate, args: list[str], debug: bool, offline: str | None) -> int:
    """Run lm-eval's CLI on ``args`` (as ``sys.argv``, restored after); returns 0 on success, the
    status of an argparse or ``--help`` exit as it is, 130 on Ctrl-C, and after one line on
    standard error (unless ``debug``, which raises) 2 for a bad argument or input, 1 for another
    error."""
    saved = sys.argv
    sys.argv = ["lm_eval", *args]
    try:
        cli_evaluate()
    except SystemExit as exc:  # argparse errors and --help exit through here
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        if debug:
            raise
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for users; --debug shows the traceback
        if debug:
            raise
        message = explain(exc, _option(args, "--tasks"), offline)
        bad_input = message.startswith("argument ") or isinstance(exc, (ValueError, OSError))
        sys.stderr.write(_one_line(message, " (run again with --debug for the traceback)"))
        return 2 if bad_input else 1
    finally:
        sys.argv = saved
    return 0
