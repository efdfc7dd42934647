"""The argument parser of the ``genback`` command line (:mod:`genback.cli`): its help texts,
one subcommand per command, and argument types whose errors name the option and the bad value
(one line, exit status 2).
"""

from __future__ import annotations

import argparse
import difflib
import math
import textwrap

from .lm_eval import LM_EVAL_HELP
from ..registry import DEFAULT_MODEL

DESCRIPTION = f"""\
genback: language-model probabilities for probabilistic programs, on your machine.

Each command loads a model (by default the embedded {DEFAULT_MODEL}, which needs no network),
asks it a question and prints the answer:

  models     list the embedded models and whether each is ready
  logprobs   the most likely next tokens after a prompt
  chars      the most likely next characters after a prompt (token-character trie)
  sample     run several samplers at once and show how their queries were batched
  eval       score a local JSONL task (multiple choice, perplexity, generation)
  lm-eval    run lm-evaluation-harness tasks with genback (lm-eval's own options)
"""

EPILOG = """\
examples:
  genback logprobs "The capital of France is"
  genback sample "Once upon a time" --particles 16 --max-tokens 32
  genback sample "Once upon a time" --greedy --max-tokens 16
  genback chars "The capital of Fr" --top-k 5
  genback eval tasks.jsonl --output results.json

Run 'genback COMMAND --help' for a command's options. Offline: embedded aliases and local
folders never touch the network; a Hub id ('org/name', or a legacy 'gpt2') loads from the local
Hugging Face cache, and fails at once with advice when it is not there and the Hub is off
(HF_HUB_OFFLINE=1) or unreachable. Add --debug to any command to see the Python traceback of an error.
"""

EVAL_FORMATS = """\
task file: one JSON object per line (JSONL); the keys of the lines decide the kind of task,
and every line of a file must be of the same kind:

  multiple choice   {"context": "Question: 2+2=?\\nAnswer:", "choices": [" 4", " 5"], "answer": 0}
      "answer" is the index of the right choice or the choice itself. Each choice is scored as
      the continuation of the context, appended as is (put the leading space in the choice).
      Prints acc (the choice with the highest log-likelihood is right) and acc_norm (highest
      log-likelihood per character of the choice).

  perplexity        {"text": "The quick brown fox jumps over the lazy dog."}
      Prints the total log-likelihood of all texts, token_perplexity, word_perplexity (per
      whitespace-separated word), byte_perplexity and bits_per_byte (per UTF-8 byte).

  generation        {"prompt": "Q: What is the capital of France?\\nA:", "target": " Paris",
                     "stop": ["\\n"], "max_new_tokens": 8}
      or {"messages": [{"role": "user", "content": "..."}], ...} for a chat-templated prompt.
      Optional keys: "target" (scored by exact match after stripping whitespace), "stop" (list of
      strings), "max_new_tokens" (else --max-new-tokens), "do_sample", "temperature", "seed",
      "top_k", "top_p" (greedy decoding unless "do_sample" is true). Prints exact_match (the
      stripped text equals the stripped target) over the lines that have a target.

--output FILE writes {"summary": {...}, "records": [one object per line]} as JSON.

example:
  genback eval tests/data/engine/mc.jsonl --limit 20
"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``genback logprobs: error: argument --top-k: ...``; an
    unknown option is reported by the subcommand it was given to, with the closest known option
    (``--topk``: did you mean ``--top-k``?)."""

    def error(self, message):
        self.exit(2, _one_line(self.prog, message, f" (see '{self.prog} --help')"))

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._subcommand(namespace) or self
            parser.error(f"unrecognized arguments: {' '.join(extras)}{parser._suggest(extras)}")
        return namespace

    def _subcommand(self, namespace) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(namespace, action.dest, None))
        return None

    def _suggest(self, extras: list[str]) -> str:
        """`` (did you mean --top-k?)`` for the first unknown option close to a known one."""
        known = [o for o in self._option_string_actions if o.startswith("--")]
        for arg in extras:
            if arg.startswith("-"):
                close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.6)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""


def _one_line(prog: str, message: str, hint: str = "") -> str:
    text = " ".join(str(message).split())
    return f"{prog}: error: {text}{hint}\n"


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text!r}")
        return value

    parse.__name__ = f"int>={low}"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _prompt(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError(
            "is empty: give the text to continue, e.g. \"The capital of France is\"")
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "is only whitespace: give the text to continue, "
            "e.g. \"The capital of France is\"")
    return text


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("genback")
    except (ImportError, PackageNotFoundError):
        from .. import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``genback`` (one subcommand per ``cmd_*`` function)."""
    parser = _Parser(prog="genback", description=DESCRIPTION, epilog=EPILOG, formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"genback {_version()}",
                        help="print genback's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands (run 'genback COMMAND --help' for its options)")
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="show the Python traceback of an error instead of one line (default: off)")

    def add(name, help, description, parents=(), epilog=None):
        description = textwrap.fill(description, width=96)
        return sub.add_parser(name, help=help, description=description, epilog=epilog,
                              parents=[*parents, common], formatter_class=_Formatter)

    model_opts = _model_options()
    add("models", "list the embedded model aliases and whether each is ready",
        "List the embedded model aliases, whether each is converted and ready to load in seconds, "
        "and its cache folder.")
    _add_logprobs(add, model_opts)
    _add_chars(add, model_opts)
    _add_sample(add, model_opts)
    add("lm-eval", "run lm-evaluation-harness tasks with genback (lm-eval's own options)",
        LM_EVAL_HELP)
    _add_eval(add, model_opts)
    return parser


def _model_options() -> argparse.ArgumentParser:
    """The options of every command that loads a model: ``--model``, ``--backend`` (from
    :data:`genback.llm.backends.BACKENDS`), ``--verbose``, ``--threads``."""
    from ..llm.backends import BACKENDS

    model_opts = _Parser(add_help=False)
    model_opts.add_argument(
        "--model", default=DEFAULT_MODEL, metavar="NAME",
        help="embedded alias (see 'genback models'), a local Hugging Face folder, or a Hub id "
             "'org/name' from the local HF cache (default: %(default)s)")
    model_opts.add_argument(
        "--backend", default="hf", choices=list(BACKENDS),
        help="; ".join(f"{b.name}: {b.summary}" + (f" ({b.install})" if b.install else "")
                       for b in BACKENDS.values()) + " (default: %(default)s)")
    model_opts.add_argument("--verbose", action="store_true",
                            help="show the backend's own log lines (vLLM's engine log) on standard "
                                 "error; standard output holds only the answer (default: off, "
                                 "warnings and errors only)")
    model_opts.add_argument("--threads", type=_int_at_least(1), default=1, metavar="N",
                            help="torch CPU threads (default: %(default)s)")
    return model_opts


def _prompt_arg(p, what: str) -> None:
    p.add_argument("prompt", type=_prompt, metavar="PROMPT",
                   help=f"the text {what} (quote it; must not be empty)")


def _add_logprobs(add, model_opts) -> None:
    p = add("logprobs", "the most likely next tokens after a prompt",
            "Print the K most likely next tokens after PROMPT with their probabilities "
            "(one forward of the model).", [model_opts])
    _prompt_arg(p, "to continue")
    p.add_argument("--top-k", type=_int_at_least(1), default=10, metavar="K",
                   help="how many tokens to print, most likely first (default: %(default)s)")


def _add_chars(add, model_opts) -> None:
    p = add("chars", "the most likely next characters after a prompt",
            "Print the K most likely next characters after PROMPT: the probability of a character "
            "is the total next-token probability of the tokens whose text starts with it, summed "
            "over the token-character trie.", [model_opts])
    _prompt_arg(p, "to continue")
    p.add_argument("--top-k", type=_int_at_least(1), default=10, metavar="K",
                   help="how many characters to print, most likely first (default: %(default)s)")
    p.add_argument("--bytes", action="store_true",
                   help="group by first byte instead of whole UTF-8 characters (default: off)")


def _add_sample(add, model_opts) -> None:
    p = add("sample", "run concurrent samplers and print batching statistics",
            "Continue PROMPT with N particles at once, one token per step; their concurrent "
            "queries are batched and share the KV of their common prefix. Prints every "
            "completion, then forwards, batch sizes and tokens forwarded.", [model_opts])
    _prompt_arg(p, "every particle continues")
    p.add_argument("--particles", type=_int_at_least(1), default=16, metavar="N",
                   help="how many completions to draw concurrently (default: %(default)s)")
    p.add_argument("--max-tokens", type=_int_at_least(1), default=32, metavar="N",
                   help="most new tokens per particle; a particle also stops at the end-of-sequence "
                        "token (default: %(default)s)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--temperature", type=_positive_float, default=1.0, metavar="T",
                     help="sample from softmax(logprobs / T): below 1 sharper, above 1 flatter "
                          "(default: %(default)s)")
    how.add_argument("--greedy", action="store_true",
                     help="take the most likely token at each step instead of sampling "
                          "(every particle then writes the same text) (default: off)")
    p.add_argument("--seed", type=_int_at_least(0), default=0, metavar="S",
                   help="particle i samples with seed S + i, so runs repeat (default: %(default)s)")
    p.add_argument("--tree", metavar="FILE",
                   help="at the end, write a picture of the KV tree the particles left (hf "
                        "backend): FILE.gv / FILE.dot is Graphviz source; .svg, .png or .pdf "
                        "are rendered with Graphviz's dot program; checked before sampling "
                        "(default: no picture)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (tokens sampled, particles alive, tokens/s) on standard "
                        "error; it is shown only when standard error is a terminal (default: off)")


def _add_eval(add, model_opts) -> None:
    p = add("eval", "score a multiple-choice, perplexity or generation task from a JSONL file",
            "Run a local task file on a model and print its metrics.", [model_opts],
            epilog=EVAL_FORMATS)
    p.add_argument("task_file", metavar="TASK_FILE",
                   help="the JSONL task file (formats below)")
    p.add_argument("--kind", choices=["multiple_choice", "perplexity", "generation"],
                   help="task kind (default: decided by the keys of the lines)")
    p.add_argument("--limit", type=_int_at_least(1), default=None, metavar="N",
                   help="use only the first N lines (default: all)")
    p.add_argument("--max-new-tokens", type=_int_at_least(1), default=64, metavar="N",
                   help="generation: most new tokens for lines without \"max_new_tokens\" "
                        "(default: %(default)s)")
    p.add_argument("--max-length", type=_int_at_least(1), default=None, metavar="N",
                   help="model window in tokens (default: the model's own)")
    p.add_argument("--output", default=None, metavar="FILE",
                   help="write the summary and per-line results as JSON here (default: not written)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown)")
