"""Exact byte strings of a Hugging Face tokenizer's vocabulary.

``get_byte_vocab(tokenizer)`` returns ``list[bytes]`` with ``vocab[i]`` the exact bytes token ``i``
stands for; ``decode_vocab(tokenizer)`` returns ``(list[Token], list[str])``. Supported families:

* **byte-level BPE** (GPT-2, SmolLM2, Llama-3, Qwen, ...): every character of a token string is one
  byte through the GPT-2 byte-to-unicode table (Radford et al. 2019, ``bytes_to_unicode`` in
  openai/gpt-2 ``encoder.py``). Every character of an ordinary token must be in the table, else
  ``ValueError``.
* **SentencePiece-style** (Gemma, Llama-2, Mistral; the decoder replaces ``▁`` or is a ``Metaspace``):
  ``▁`` (U+2581) is a space, ``<0xNN>`` byte-fallback tokens are byte ``0xNN``, everything else is
  its UTF-8 text.
* **added / special tokens** (``<|im_end|>``, ``<eos>``) are the UTF-8 text of their content.

The family is read from the fast tokenizer's JSON (``tokenizer.backend_tokenizer``: decoder,
pre-tokenizer, model); slow tokenizers are recognised by ``byte_decoder`` (GPT-2 style) or
``sp_model`` (SentencePiece). Anything else (WordPiece's ``##`` continuation, whose bytes depend on
the neighbouring token) raises ``ValueError``: a wrong vocabulary is never returned silently.
After decoding, a sample of tokens is checked against the tokenizer's own decoder.

Padding: models often have more logit rows than tokenizer entries (SmolLM2's config rounds up,
Qwen pads to a multiple of 128). With ``vocab_size=V`` larger than the tokenizer's vocabulary, ids
without a tokenizer entry get the explicit placeholder ``PAD_TEMPLATE % id``, e.g.
``b"<|genback_pad_49152|>"``: distinct per id, never empty, and never produced by encoding text
that does not contain it. A ``vocab_size`` smaller than the tokenizer's vocabulary raises
``ValueError`` (never a silent truncation).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from .token import Token

__all__ = ["decode_vocab", "get_byte_vocab", "bytes_to_unicode", "PAD_TEMPLATE", "ByteVocabError",
           "ByteDecoderError", "check_byte_decoder"]

#: Placeholder bytes for ids the tokenizer does not define (``PAD_TEMPLATE % token_id``).
PAD_TEMPLATE = b"<|genback_pad_%d|>"

_SPIECE_SPACE = "\u2581"  # "▁"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_FALLBACKS = ("tokenizer", "latin1", "replace")


class ByteVocabError(ValueError):
    """The tokenizer's token bytes cannot be recovered exactly (a ``ValueError``)."""


#: genlm-backend's name (``genlm.backend.tokenization.bytes``) for the failure genback reports as
#: :class:`ByteVocabError`: the tokenizer's byte decoder cannot map its tokens back to bytes.
ByteDecoderError = ByteVocabError


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable-character table (256 entries, a bijection).

    Printable Latin-1 bytes map to themselves; the remaining 68 bytes map to U+0100 onwards in
    byte order (the construction of openai/gpt-2 ``encoder.py``).
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def _tokenizer_json(tokenizer) -> dict | None:
    """Decoder, pre-tokenizer and model settings of a fast tokenizer (without the vocabulary).

    Each component is read alone (cheap); only when one cannot be read that way is the whole
    tokenizer serialised (``backend_tokenizer.to_str()``, seconds for a 262k vocabulary)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec: dict = {}
    for key in ("decoder", "pre_tokenizer"):
        component = getattr(backend, key, None)
        state = component.__getstate__() if component is not None else "null"
        if not isinstance(state, (str, bytes)):
            return _tokenizer_json_whole(backend)
        spec[key] = json.loads(state)
    model = backend.model
    spec["model"] = {
        "type": type(model).__name__,
        "byte_fallback": bool(getattr(model, "byte_fallback", False)),
    }
    return spec


def _tokenizer_json_whole(backend) -> dict:
    text = backend.to_str()
    full = json.loads(text) if isinstance(text, (str, bytes)) else {}
    model = full.get("model") or {}
    return {"decoder": full.get("decoder"), "pre_tokenizer": full.get("pre_tokenizer"),
            "model": {"type": model.get("type"), "byte_fallback": bool(model.get("byte_fallback"))}}


def _components(node) -> list[dict]:
    """Flatten a tokenizers JSON component (``Sequence`` of decoders / pre-tokenizers)."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        out = []
        for key in ("decoders", "pretokenizers", "normalizers"):
            for child in node.get(key) or []:
                out.extend(_components(child))
        return out
    return [node]


def _detect_family(tokenizer, spec: dict | None) -> str:
    """Return ``"byte_level"`` or ``"sentencepiece"``; raise ``ByteVocabError`` otherwise."""
    if spec is not None:
        parts = _components(spec.get("decoder")) + _components(spec.get("pre_tokenizer"))
        types = {p.get("type") for p in parts}
        model = spec.get("model") or {}
        if "ByteLevel" in types:
            return "byte_level"
        spiece_replace = any(
            p.get("type") == "Replace" and (p.get("pattern") or {}).get("String") == _SPIECE_SPACE
            for p in _components(spec.get("decoder"))
        )
        if "Metaspace" in types or spiece_replace or model.get("byte_fallback"):
            return "sentencepiece"
        raise ByteVocabError(
            "decode_vocab: cannot recover token bytes for tokenizer "
            f"{getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r}: model "
            f"{model.get('type')!r} with decoder/pre-tokenizer types {sorted(t for t in types if t)} "
            "is neither ByteLevel nor SentencePiece (byte-level BPE or SentencePiece-style)"
        )
    if getattr(tokenizer, "byte_decoder", None) is not None:
        return "byte_level"
    if getattr(tokenizer, "sp_model", None) is not None:
        return "sentencepiece"
    raise ByteVocabError(
        f"decode_vocab: tokenizer of type {type(tokenizer).__name__} has no backend_tokenizer, "
        "byte_decoder or sp_model; its token bytes cannot be recovered"
    )


def _id_to_string(tokenizer) -> tuple[dict[int, str], dict[int, str]]:
    """(ordinary tokens, added tokens): id → token string as stored in the vocabulary."""
    vocab = tokenizer.get_vocab()
    added = {}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for i, added_token in decoder.items():
        added[int(i)] = str(getattr(added_token, "content", added_token))
    ordinary = {int(i): s for s, i in vocab.items() if int(i) not in added}
    return ordinary, added


def _byte_level(s: str, token_id: int, table: dict[str, int]) -> bytes:
    try:
        return bytes(table[c] for c in s)
    except KeyError:
        bad = next(c for c in s if c not in table)
        raise ByteVocabError(
            f"decode_vocab: token {token_id} {s!r} has character {bad!r} (U+{ord(bad):04X}) outside "
            "the byte-level BPE byte-to-unicode table"
        ) from None


def _sentencepiece(s: str) -> bytes:
    m = _BYTE_FALLBACK.fullmatch(s)
    if m:
        return bytes([int(m.group(1), 16)])
    return s.replace(_SPIECE_SPACE, " ").encode("utf-8")


def _check_against_decoder(tokenizer, vocab: list[bytes | None], added: dict[int, str]) -> None:
    """Compare up to ~2000 evenly spaced tokens with the tokenizer's own single-token decode.

    Only tokens whose bytes are valid UTF-8 can be compared. A decoder that strips one leading
    space (Llama-2's ``Strip`` decoder) is tolerated.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    candidates = [i for i in range(len(vocab)) if vocab[i] is not None and i not in added]
    if backend is None or not candidates:
        return
    step = max(1, len(candidates) // 2000)
    ids, expected = [], []
    for i in candidates[::step]:
        try:
            expected.append(vocab[i].decode("utf-8"))
        except UnicodeDecodeError:
            continue
        ids.append(i)
    decoded = backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    bad = [
        (i, e, d)
        for i, e, d in zip(ids, expected, decoded)
        if d != e and not (e.startswith(" ") and d == e[1:])
    ]
    if bad:
        raise ByteVocabError(
            f"decode_vocab: recovered bytes disagree with the tokenizer's decoder for {len(bad)} of "
            f"{len(ids)} checked tokens, e.g. (id, expected, decoded) {bad[:3]}"
        )


def check_byte_decoder(tokenizer, byte_decoder: dict) -> None:
    """Check that ``byte_decoder`` (token character -> byte) decodes ``tokenizer``'s tokens.

    ``byte_decoder`` is a byte-level BPE table such as GPT-2's (``{"Ġ": 32, "a": 97, ...}``;
    :func:`bytes_to_unicode` inverted). Every character of every ordinary (non-added) token must
    map to an int byte 0..255, and the bytes so recovered must agree with the tokenizer's own
    decoder on a sample of tokens. Returns None when it does.

    Raises:
        TypeError: ``byte_decoder`` is not a dict.
        ByteDecoderError: (a ``ValueError``) a value that is not a byte, a token character
            missing from the table, or a disagreement with the tokenizer's decoder.
    """
    if not isinstance(byte_decoder, dict):
        raise TypeError(f"check_byte_decoder: byte_decoder must be a dict, got "
                        f"{type(byte_decoder).__name__}")
    for c, b in byte_decoder.items():
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= 255:
            raise ByteDecoderError(f"check_byte_decoder: byte_decoder[{c!r}] = {b!r} is not a "
                                   "byte (an int 0..255)")
    ordinary, added = _id_to_string(tokenizer)
    vocab: list[bytes | None] = [None] * (max([*ordinary, *added], default=-1) + 1)
    for i, s in ordinary.items():
        missing = next((c for c in s if c not in byte_decoder), None)
        if missing is not None:
            raise ByteDecoderError(f"check_byte_decoder: token {i} {s!r} has character "
                                   f"{missing!r} (U+{ord(missing):04X}) missing from byte_decoder")
        vocab[i] = bytes(byte_decoder[c] for c in s)
    _check_against_decoder(tokenizer, vocab, added)


def get_byte_vocab(tokenizer, vocab_size: int | None = None) -> list[bytes]:
    """Exact bytes of every token id of ``tokenizer``.

    Args:
        tokenizer: a Hugging Face tokenizer (fast, or a slow GPT-2 / SentencePiece tokenizer).
        vocab_size: the model's logit width; ``None`` means the tokenizer's size
            (``max id + 1``). Larger values pad with ``PAD_TEMPLATE % id``.

    Returns:
        ``list[bytes]`` of length ``vocab_size`` (or ``max id + 1``); element ``i`` is token
        ``i``'s bytes. Ids inside the range that the tokenizer does not define are padded too.

    Raises:
        ByteVocabError: (a ``ValueError``) an unsupported tokenizer family, a byte-level token
            with a character outside the byte-to-unicode table, a disagreement with the
            tokenizer's decoder, or ``vocab_size`` smaller than the tokenizer's vocabulary.
        TypeError: ``vocab_size`` is not an int.
    """
    family = _detect_family(tokenizer, _tokenizer_json(tokenizer))
    ordinary, added = _id_to_string(tokenizer)
    n = _vocab_length(max([*ordinary, *added], default=-1) + 1, vocab_size)
    vocab: list[bytes | None] = [None] * n
    if family == "byte_level":
        table = _unicode_to_byte()
        for i, s in ordinary.items():
            vocab[i] = _byte_level(s, i, table)
    else:
        for i, s in ordinary.items():
            vocab[i] = _sentencepiece(s)
    for i, s in added.items():
        vocab[i] = s.encode("utf-8")
    _check_against_decoder(tokenizer, vocab, added)
    return [PAD_TEMPLATE % i if b is None else b for i, b in enumerate(vocab)]


def _vocab_length(n_tok: int, vocab_size: int | None) -> int:
    """The byte vocabulary's length: ``vocab_size`` checked against the tokenizer's ``n_tok``
    ids, or ``n_tok`` when None."""
    if vocab_size is None:
        return n_tok
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"decode_vocab: vocab_size must be an int, got {vocab_size!r}")
    if vocab_size < n_tok:
        raise ValueError(
            f"decode_vocab: vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
            f"({n_tok} ids); refusing to truncate"
        )
    return vocab_size


def decode_vocab(tokenizer, byte2str_fallback: str = "tokenizer", vocab_size: int | None = None):
    """Byte and string forms of a tokenizer's vocabulary.

    Args:
        tokenizer: a Hugging Face tokenizer (see ``get_byte_vocab``).
        byte2str_fallback: how ``str_vocab`` renders a token whose bytes are not valid UTF-8:
            ``"tokenizer"`` (the tokenizer's own token string, e.g. ``"<0xE2>"`` or ``"Ġâ"``),
            ``"latin1"`` (bytes decoded as Latin-1), or ``"replace"`` (UTF-8 with U+FFFD).
        vocab_size: the model's logit width (see ``get_byte_vocab``: larger pads, smaller raises).

    Returns:
        ``(byte_vocab, str_vocab)``: ``byte_vocab[i] == Token(i, bytes_i)`` (``list[Token]``; a
        ``Token`` is a ``bytes`` subclass, so ``b"".join`` and iteration work; duplicates of the
        same bytes stay distinct by id) and ``str_vocab[i]`` a ``str``. Both have the same length.
        The bytes are canonical; ``str_vocab`` is for display.

    Raises:
        ValueError: unknown ``byte2str_fallback``, or any ``get_byte_vocab`` error.
    """
    if byte2str_fallback not in _FALLBACKS:
        raise ValueError(
            f"decode_vocab: byte2str_fallback must be one of {_FALLBACKS}, got {byte2str_fallback!r}"
        )
    try:
        raw = get_byte_vocab(tokenizer, vocab_size=vocab_size)
    except ByteVocabError as exc:
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ByteVocabError(f"Could not decode byte representation of tokenizer {name!r}: "
                             f"{exc}") from exc
    return [Token(i, b) for i, b in enumerate(raw)], _str_vocab(tokenizer, raw, byte2str_fallback)


def _str_vocab(tokenizer, raw: list[bytes], byte2str_fallback: str) -> list[str]:
    """``decode_vocab``'s ``str_vocab``: each token's bytes as UTF-8 text, or its fallback."""
    str_vocab = []
    for i, b in enumerate(raw):
        try:
            s = b.decode("utf-8")
        except UnicodeDecodeError:
            s = _fallback_str(tokenizer, i, b, byte2str_fallback)
        str_vocab.append(s)
    return str_vocab


def _fallback_str(tokenizer, token_id: int, b: bytes, byte2str_fallback: str) -> str:
    """``str_vocab``'s entry for token bytes ``b`` that are not valid UTF-8 (see
    ``decode_vocab``'s ``byte2str_fallback``; a tokenizer without a string for the id gives
    UTF-8 with U+FFFD)."""
    if byte2str_fallback == "latin1":
        return b.decode("latin-1")
    if byte2str_fallback == "replace":
        return b.decode("utf-8", errors="replace")
    s = tokenizer.convert_ids_to_tokens(token_id)
    return s if isinstance(s, str) else b.decode("utf-8", errors="replace")
