"""The model window: how many tokens a forward may take, counted one way everywhere.

A scored pair ``(context, continuation)`` needs one forward over ``context + continuation[:-1]``:
the last continuation token is only a target, never an input. Everything that checks or fits a
request against the window (``AsyncLM``'s query checks, the evaluation session's truncation and
rolling windows) counts these *inputs* with the functions below, so they cannot disagree by a
token.

The rules are those of lm-evaluation-harness's causal ``HFLM`` (facts, restated):

* a pair longer than the window is cut on the left: the inputs are
  ``(context + continuation)[-(window + 1):][:-1]``, so at most ``window`` inputs, and the
  continuation is kept whole; a continuation longer than the window cannot be scored;
* a rolling (perplexity) text of ``n`` tokens is scored in disjoint windows: the first predicts
  ``tokens[:window]`` from ``[prefix] + tokens[:window - 1]``, each later one predicts the next
  (up to) ``window`` tokens from the ``window`` tokens before its last target
  (``lm_eval.utils.get_rolling_token_windows`` with ``context_len=1`` followed by
  ``make_disjoint_window``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

__all__ = ["pair_inputs", "check_pair", "context_too_long", "truncate_pair", "rolling_windows"]


def _check_window(window) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int (tokens), got {window!r}")
    return window


def pair_inputs(n_context: int, n_continuation: int) -> int:
    """Tokens the forward of a scored pair takes: ``n_context + n_continuation - 1``."""
    return n_context + n_continuation - 1


def context_too_long(n_tokens: int, window: int, name: str = "token_ids") -> ValueError:
    """The ``ValueError`` (returned, for the caller to raise) of a context of ``n_tokens``
    tokens, more than a window of ``window``, that would be a forward's inputs whole (a
    next-token query's context)."""
    return ValueError(f"{name} has {n_tokens} tokens, more than the model's context of {window}")


def check_pair(n_context: int, n_continuation: int, window: int | None,
               names: tuple[str, str] = ("context_ids", "continuation_ids")) -> None:
    """Raise unless a pair of these lengths fits a window of ``window`` inputs.

    Args:
        n_context: context length in tokens (>= 1).
        n_continuation: continuation length in tokens (>= 1).
        window: the model's window in tokens; None or 0 means no limit.
        names: how the two parts are called in the message.

    Raises:
        ValueError: ``pair_inputs(n_context, n_continuation) > window``; the message gives both
            lengths, the inputs and the window.
    """
    if not window:
        return
    inputs = pair_inputs(n_context, n_continuation)
    if inputs > window:
        raise ValueError(
            f"{names[0]} + {names[1]} has {n_context} + {n_continuation} tokens: the forward "
            f"takes {inputs} inputs ({names[0]} + {names[1]}[:-1]), more than the model's "
            f"window of {window}")


def truncate_pair(ctx: Sequence[int], cont: Sequence[int], window: int | None
                  ) -> tuple[list[int], list[int]]:
    """Left-truncate the context so that the pair's forward takes at most ``window`` inputs.

    Args:
        ctx: context ids (non-empty).
        cont: continuation ids (non-empty).
        window: the model's window in tokens; None or 0 means no limit.

    Returns:
        The pair `(context, continuation)` as new lists, the continuation whole and the
            context cut to its last `window + 1 - len(cont)` tokens when the pair is too long
            (at least one token), else whole.

    Raises:
        ValueError: the continuation alone has more than ``window`` tokens (it would need more
            than ``window`` inputs even after one context token).
    """
    ctx, cont = list(ctx), list(cont)
    if not window or pair_inputs(len(ctx), len(cont)) <= window:
        return ctx, cont
    window = _check_window(window)
    if len(cont) > window:
        raise ValueError(f"the continuation has {len(cont)} tokens, more than the model's window "
                         f"of {window} tokens: it cannot be scored (the context is truncated, "
                         f"never the continuation)")
    return ctx[len(ctx) + len(cont) - window - 1:], cont


def rolling_windows(tokens: Sequence[int], prefix: int, window: int
                    ) -> Iterator[tuple[list[int], list[int]]]:
    """Disjoint ``(context, targets)`` windows that score every token of ``tokens`` once.

    Each window's forward (``context + targets[:-1]``) takes at most ``window`` inputs; the
    first is conditioned on ``[prefix]`` (module docstring).

    Args:
        tokens: the text's ids (may be empty: no windows).
        prefix: the token the first window starts from (BOS, else EOS).
        window: the model's window in tokens (>= 1).

    Raises:
        ValueError: ``window`` is not a positive int.
    """
    window = _check_window(window)
    tokens = list(tokens)
    n = len(tokens)
    if n == 0:
        return
    first = min(window, n)
    yield [prefix], tokens[:first]
    done = first
    while done < n:
        end = min(n, done + window)
        # inputs tokens[end - 1 - window : end - 1]: the ones before the targets are context
        yield tokens[end - 1 - window: done], tokens[done:end]
        done = end
