"""Tokenization of scoring requests, the lm-evaluation-harness way.

The conventions are those of lm-eval 0.4's causal ``HFLM`` (``TemplateLM._encode_pair``,
``HFLM.tok_encode``, ``lm_eval.utils.get_rolling_token_windows``), so that genback's
log-likelihoods equal ``HFLM``'s on the same model:

* a context is encoded with the tokenizer's default special tokens (no second BOS when the text
  already starts with the prefix token's text); a continuation never gets special tokens;
* trailing whitespace of the context moves to the start of the continuation, then
  ``context + continuation`` is encoded as a whole and the context's ids are cut off its front
  (so the continuation ids are the ones the joint text tokenizes to);
* an empty context is replaced by the *prefix token*: BOS, or EOS when there is no BOS;
* a rolling (perplexity) text is scored in disjoint windows of at most ``max_length`` predicted
  tokens, the first conditioned on the prefix token; the window rules (truncation and rolling
  windows) live in :mod:`genback.queries.window`, shared with ``AsyncLM``.

Evalution's own Transformers engine encodes the context and the continuation separately and
keeps trailing whitespace on the context; both conventions give the same ids for the usual
``"...Answer:"`` + ``" choice"`` requests. genback follows lm-eval (``pair_encoding="lm_eval"``,
the default) and offers Evalution's (``pair_encoding="separate"``). Requests that carry
``context_input_ids`` / ``continuation_input_ids`` are used as given.
"""

from __future__ import annotations

from ..queries.window import truncate_pair
from .checks import check_loglikelihood_request

__all__ = ["PAIR_ENCODINGS", "prefix_token_id", "encode_text", "encode_texts", "encode_pair",
           "encode_pairs", "encode_loglikelihood", "fit_ids"]

PAIR_ENCODINGS = ("lm_eval", "separate")


def prefix_token_id(tokenizer) -> int:
    """The token an empty context is scored from: BOS, or EOS when there is no BOS.

    Raises:
        ValueError: the tokenizer has neither.
    """
    if tokenizer.bos_token_id is not None:
        return int(tokenizer.bos_token_id)
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has neither a BOS nor an EOS token to score an empty context")
    return int(tokenizer.eos_token_id)


def encode_text(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` with the tokenizer's default special tokens, none added when ``text``
    already starts with the prefix token's text (lm-eval's ``HFLM.tok_encode``)."""
    prefix = tokenizer.decode(prefix_token_id(tokenizer))
    if prefix and text.startswith(prefix):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def encode_pair(tokenizer, context: str, continuation: str, mode: str = "lm_eval"
                ) -> tuple[list[int], list[int]]:
    """``(context_ids, continuation_ids)`` for scoring ``continuation`` after ``context``.

    Args:
        tokenizer: a Hugging Face tokenizer.
        context: the conditioning text ("" scores from the prefix token).
        continuation: the scored text.
        mode: ``"lm_eval"`` (joint encoding, see the module docstring) or ``"separate"``
            (Evalution: context and continuation encoded on their own).

    Returns:
        two lists of ids; the continuation list may be empty (the caller rejects it).

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in PAIR_ENCODINGS:
        raise ValueError(f"pair_encoding must be one of {PAIR_ENCODINGS}, got {mode!r}")
    if context == "":
        cont = list(tokenizer.encode(continuation, add_special_tokens=False))
        prefix = prefix_token_id(tokenizer)
        if cont and cont[0] == prefix:
            return cont[:1], cont[1:]
        return [prefix], cont
    if mode == "separate":
        return encode_text(tokenizer, context), list(
            tokenizer.encode(continuation, add_special_tokens=False))
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode_text(tokenizer, context + continuation)
    ctx = encode_text(tokenizer, context)
    return ctx, whole[len(ctx):]


def encode_texts(tokenizer, texts) -> dict[str, list[int]]:
    """:func:`encode_text` of every distinct str of ``texts``, as ``{text: ids}``: each text
    encoded once, all of them in at most two batched tokenizer calls (with and without its
    special tokens; a fast tokenizer encodes a batch in Rust, in parallel). The ids equal
    :func:`encode_text`'s, text by text.

    Raises:
        TypeError: an item of ``texts`` that is not a str.
        ValueError: the tokenizer has neither a BOS nor an EOS token.
    """
    prefix = tokenizer.decode(prefix_token_id(tokenizer))
    groups: tuple[dict, dict] = ({}, {})  # text -> ids: (default special tokens, none)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
        groups[bool(prefix) and text.startswith(prefix)][text] = None  # (encode_text's rule)
    for special, known in zip((True, False), groups):
        if known:
            batch = tokenizer(list(known), add_special_tokens=special)["input_ids"]
            known.update(zip(known, map(list, batch)))
    return {**groups[0], **groups[1]}


def encode_pairs(tokenizer, pairs) -> list[tuple[list[int], list[int]]]:
    """:func:`encode_pair` (``mode="lm_eval"``) of every ``(context, continuation)`` of ``pairs``,
    with each distinct text encoded once (:func:`encode_texts`): the choices of a question share
    their context's encoding, and the texts go to the tokenizer in batched calls. The ids are
    those of :func:`encode_pair`, pair by pair.

    Raises:
        ValueError: the tokenizer has neither a BOS nor an EOS token.
    """
    prefix_id = prefix_token_id(tokenizer)
    alone, texts, jobs = {}, {}, []  # continuations of empty contexts; the others' texts
    for context, continuation in pairs:
        if context == "":
            alone[continuation] = None
            jobs.append((None, continuation))
            continue
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces > 0:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        texts[context] = texts[context + continuation] = None
        jobs.append((context, context + continuation))
    if alone:  # (encoded without special tokens, as encode_pair does)
        batch = tokenizer(list(alone), add_special_tokens=False)["input_ids"]
        alone.update(zip(alone, map(list, batch)))
    texts = encode_texts(tokenizer, texts)
    out = []
    for context, text in jobs:
        if context is None:  # (an empty context: the prefix token, as encode_pair)
            cont = alone[text]
            out.append((cont[:1], cont[1:]) if cont and cont[0] == prefix_id
                       else ([prefix_id], list(cont)))
            continue
        ctx = texts[context]
        out.append((ctx, texts[text][len(ctx):]))
    return out


def encode_loglikelihood(tokenizer, request, mode: str, window: int
                         ) -> tuple[list[int], list[int]]:
    """``(context_ids, continuation_ids)`` of a ``LoglikelihoodRequest``, fitted to ``window``.

    Token-id fields are used as given; text fields are encoded with :func:`encode_pair` (both
    texts) or on their own (one text beside ids); an empty context becomes the prefix token.
    The pair is then cut on the left to the window (:func:`genback.queries.window.truncate_pair`).

    Raises:
        TypeError: a malformed request (:func:`.checks.check_loglikelihood_request`).
        ValueError: the continuation tokenizes to no tokens, or is longer than ``window``.
    """
    ctx, cont = check_loglikelihood_request(request)  # (the id fields, checked)
    if ctx is None and cont is None:
        ctx, cont = encode_pair(tokenizer, request.context or "", request.continuation or "", mode)
    else:
        if ctx is None:
            ctx = encode_text(tokenizer, request.context) if request.context else []
        if cont is None:
            cont = list(tokenizer.encode(request.continuation or "", add_special_tokens=False))
        if not ctx:
            ctx = [prefix_token_id(tokenizer)]
    if not cont:
        raise ValueError(f"continuation={request.continuation!r} (continuation_input_ids="
                         f"{request.continuation_input_ids!r}) tokenizes to no tokens; "
                         f"nothing to score")
    return truncate_pair(ctx, cont, window)


def fit_ids(tokenizer, pair, window: int) -> tuple[list[int], list[int]]:
    """A ``(context_ids, continuation_ids)`` pair that a tokenizer of the model made, fitted to
    ``window`` (:func:`genback.queries.window.truncate_pair`); an empty context becomes the prefix token.
    The ids are not checked item by item (the model's query check rejects ids outside its
    vocabulary).

    Raises:
        ValueError: an empty continuation, or one longer than ``window``.
    """
    ctx, cont = pair
    if not cont:
        raise ValueError("continuation_input_ids is empty; nothing to score")
    return truncate_pair(ctx or [prefix_token_id(tokenizer)], cont, window)
