"""Step 1 of the trie's construction (``genback.trie.build``, whose module docstring describes
it): the vocabulary's words in lexicographic order and the longest common prefixes of neighbours.

``bytes`` / ``Token`` items are read from one packed buffer (``_ByteWords``); other items are
encoded as byte keys first (``_encode_items``), sorted in Python and compared through a padded
letter matrix (``_letters_matrix``, ``_lcp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SortedWords", "sort_words"]

_LCP_WIDTH = 32  # columns of the padded matrix; longer common prefixes are finished in Python


@dataclass
class SortedWords:
    """``V`` vocabulary items as words in leaf (lexicographic, stable) order."""

    order: np.ndarray  # (V,) int64 item index of the k-th sorted word
    lcp: np.ndarray  # (V,) int64 letters sorted word k shares with word k-1; lcp[0] = 0
    lengths: np.ndarray  # (V,) int64 letters of sorted word k
    flat: np.ndarray  # letter codes (uint8, or big-endian uint16 at width 2), read at offsets
    offsets: np.ndarray  # (V,) int64 index in flat of sorted word k's first letter
    keys: object  # (V,) sorted encoded words, or a function returning them (built on first use)
    width: int  # bytes per letter in a key: 1, or 2 with symbol letters
    symbols: list  # symbol code 256 + j -> letter object


def sort_words(decode) -> SortedWords:
    """Sort a non-empty list of vocabulary items (letters as in ``genback.trie.build``)."""
    if all(issubclass(t, bytes) for t in set(map(type, decode))):
        return _sort_byte_items(decode)
    return _sort_encoded_items(decode)


def _sort_byte_items(decode) -> SortedWords:
    """``sort_words`` of ``bytes`` / ``Token`` items: integer sort and 8-byte LCP passes, keys
    built lazily."""
    words = _ByteWords(decode)
    order = _sort_bytes(words, decode)
    lcp = _lcp_bytes(words, order)
    order_list = order.tolist()

    def keys():
        return [bytes(decode[i]) for i in order_list]

    return SortedWords(order, lcp, words.lengths[order], words.flat, words.offsets[order], keys, 1, [])


def _sort_encoded_items(decode) -> SortedWords:
    """``sort_words`` of items with non-byte letters: encoded keys, a Python sort, and the LCP
    of a padded letter matrix."""
    keys, width, symbols = _encode_items(decode)
    order = np.asarray(sorted(range(len(decode)), key=keys.__getitem__), dtype=np.int64)
    skeys = [keys[i] for i in order.tolist()]
    maxlen = max(map(len, skeys)) // width
    mat, lengths, flat, offsets = _letters_matrix(skeys, width, max(1, min(maxlen, _LCP_WIDTH)))
    return SortedWords(order, _lcp(skeys, width, mat, lengths), lengths, flat, offsets, skeys, width, symbols)


def _encode_items(decode) -> tuple[list, int, list]:
    """Encode items as sortable byte keys. Returns (keys, width, symbols).

    Width 1 when every item is bytes-like (its key is its bytes); else width 2: every letter two
    big-endian bytes, bytes 0..255 and symbol ``j`` as ``256 + j`` (which keeps lexicographic
    order).

    Raises:
        TypeError: an item that is neither bytes nor iterable, or an unhashable letter.
        ValueError: more than 65279 distinct symbol letters.
    """
    if all(isinstance(x, bytes) for x in decode):  # fast path: Token / bytes only
        return list(map(bytes, decode)), 1, []
    keys = []
    generic = []
    for i, item in enumerate(decode):
        if isinstance(item, (bytes, bytearray, memoryview)):  # Token: plain bytes (Token orders by id)
            keys.append(bytes(item))
        else:
            keys.append(None)
            generic.append(i)
    if not generic:
        return keys, 1, []
    symbols, coded = _symbol_codes(decode, generic)
    if len(symbols) > 65535 - 256:
        raise ValueError(f"TokenCharacterTrie: too many distinct non-byte letters ({len(symbols)})")
    _widen_plain(keys)
    for i, codes in coded.items():
        keys[i] = np.asarray(codes, dtype=">u2").tobytes()
    return keys, 2, symbols


def _symbol_codes(decode, generic: list) -> tuple[list, dict]:
    """Letter codes of the non-bytes items ``decode[i]``, ``i`` in ``generic``: ``(symbols,
    {i: [code, ...]})``, a byte letter (int 0..255) its value, any other letter ``256 + j``
    with ``symbols[j]`` the letter (numbered in order of first appearance)."""
    symbols: list = []
    symbol_index: dict = {}
    coded = {}
    for i in generic:
        item = decode[i]
        try:
            letters = list(item)
        except TypeError:
            raise TypeError(
                f"TokenCharacterTrie: decode[{i}] = {item!r} is neither bytes, a Token, nor iterable"
            ) from None
        codes = []
        for letter in letters:
            if isinstance(letter, (int, np.integer)) and not isinstance(letter, bool) and 0 <= letter < 256:
                codes.append(int(letter))
                continue
            try:
                j = symbol_index.setdefault(letter, len(symbols))
            except TypeError:
                raise TypeError(
                    f"TokenCharacterTrie: decode[{i}] has an unhashable letter {letter!r}"
                ) from None
            if j == len(symbols):
                symbols.append(letter)
            codes.append(256 + j)
        coded[i] = codes
    return symbols, coded


def _widen_plain(keys: list) -> None:
    """Rewrite the bytes keys (the entries that are not None) in place with two bytes per letter
    (big-endian, so lexicographic order is kept), in one numpy pass over all of them."""
    plain = [i for i in range(len(keys)) if keys[i] is not None]
    if plain:
        lengths = np.fromiter((len(keys[i]) for i in plain), np.int64, len(plain))
        wide = np.frombuffer(b"".join(keys[i] for i in plain), np.uint8).astype(">u2").tobytes()
        bounds = np.concatenate([[0], np.cumsum(lengths * 2)]).tolist()
        for n, i in enumerate(plain):
            keys[i] = wide[bounds[n] : bounds[n + 1]]


def _letters_matrix(keys: list, width: int, ncols: int):
    """Sorted keys as a zero-padded (V, ncols) letter matrix, plus lengths, flat letters, offsets."""
    dtype = np.uint8 if width == 1 else np.dtype(">u2")
    flat = np.frombuffer(b"".join(keys), dtype)
    lengths = np.fromiter(map(len, keys), np.int64, len(keys)) // width
    offsets = np.cumsum(lengths) - lengths
    mat = np.zeros((len(keys), ncols), np.uint8 if width == 1 else np.uint16)
    short = lengths <= ncols
    if short.all():
        rows = np.repeat(np.arange(len(keys), dtype=np.int64), lengths)
        cols = np.arange(len(flat), dtype=np.int64) - np.repeat(offsets, lengths)
        mat[rows, cols] = flat
    else:
        clip = np.minimum(lengths, ncols)
        rows = np.repeat(np.arange(len(keys), dtype=np.int64), clip)
        cols = np.arange(int(clip.sum()), dtype=np.int64) - np.repeat(np.cumsum(clip) - clip, clip)
        mat[rows, cols] = flat[np.repeat(offsets, clip) + cols]
    return mat, lengths, flat, offsets


def _lcp(keys: list, width: int, mat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """lcp[k] = common prefix (letters) of sorted words k-1 and k; lcp[0] = 0.

    The padding value of ``mat`` is irrelevant: the first mismatch is clamped to both lengths.
    """
    V = len(keys)
    lcp = np.zeros(V, np.int64)
    if V < 2:
        return lcp
    ncols = mat.shape[1]
    neq = mat[1:] != mat[:-1]
    first = np.where(neq.any(axis=1), neq.argmax(axis=1), ncols)
    lcp[1:] = np.minimum(first, np.minimum(lengths[1:], lengths[:-1]))
    for k in np.flatnonzero(lcp[1:] >= ncols) + 1:  # long shared prefixes (rare)
        a, b = keys[k - 1], keys[k]
        n = min(len(a), len(b)) // width
        j = ncols
        while j < n and a[j * width : (j + 1) * width] == b[j * width : (j + 1) * width]:
            j += 1
        lcp[k] = j
    return lcp


_BYTE_MASKS = np.array([0] + [((1 << (8 * k)) - 1) << (64 - 8 * k) for k in range(1, 9)], dtype=np.uint64)


class _ByteWords:
    """Words (bytes) packed in one buffer, read 8 bytes at a time as big-endian ``uint64``.

    ``chunk(k, c)`` = bytes ``[8c, 8c + 8)`` of words ``k`` (an index array), zero-padded past the
    word's end. Zero padding orders a word before its extensions, so comparing chunks is
    lexicographic byte order except that ``b"a"`` and ``b"a\\x00"`` tie (ties are settled by the
    callers with the lengths or the real bytes).
    """

    def __init__(self, decode):
        blob = b"".join(decode)
        self.lengths = np.fromiter(map(len, decode), np.int64, len(decode))
        self.offsets = np.cumsum(self.lengths) - self.lengths
        self.flat = np.zeros(len(blob) + 8, np.uint8)
        self.flat[: len(blob)] = np.frombuffer(blob, np.uint8)
        # window[i] = the 8 bytes starting at byte i (unaligned strided view, no copy)
        self.window = np.ndarray((len(blob) + 1,), dtype=">u8", buffer=self.flat, strides=(1,))
        self.size = len(blob)

    def chunk(self, k: np.ndarray, c: int) -> np.ndarray:
        rem = np.clip(self.lengths[k] - 8 * c, 0, 8)
        x = self.window[np.minimum(self.offsets[k] + 8 * c, self.size)].astype(np.uint64)
        return x & _BYTE_MASKS[rem]


def _sort_bytes(words: _ByteWords, decode) -> np.ndarray:
    """Stable lexicographic argsort of byte words: one integer sort on the first 8 bytes, then a
    Python sort of only the items whose first 8 bytes tie with a neighbour's."""
    V = len(decode)
    k0 = words.chunk(np.arange(V), 0)
    order = np.argsort(k0)
    sk = k0[order]
    eq = sk[1:] == sk[:-1]
    tie = np.zeros(V, bool)
    tie[1:] |= eq
    tie[:-1] |= eq
    pos = np.flatnonzero(tie)
    if len(pos):
        # tied items occupy runs of positions in k0 order; sorting all of them by (bytes, index)
        # and writing them back in position order keeps every run in place
        items = np.sort(order[pos]).tolist()
        plain = [bytes(decode[i]) for i in items]
        ranked = sorted(range(len(items)), key=plain.__getitem__)
        order[pos] = np.asarray(items, np.int64)[ranked]
    return order


def _lcp_bytes(words: _ByteWords, order: np.ndarray) -> np.ndarray:
    """lcp[k] = common prefix (bytes) of sorted words k-1 and k; lcp[0] = 0. 8 bytes per pass."""
    V = len(order)
    L = words.lengths[order]
    lcp = np.zeros(V, np.int64)
    active = np.arange(1, V)
    c = 0
    while len(active):
        a, b = order[active], order[active - 1]
        x = words.chunk(a, c) ^ words.chunk(b, c)
        diff = x != 0
        if diff.any():
            d = active[diff]
            first = (x[diff].astype(">u8").view(np.uint8).reshape(-1, 8) != 0).argmax(axis=1)
            lcp[d] = 8 * c + first
        same = active[~diff]
        lcp[same] = 8 * (c + 1)
        active = same[np.minimum(L[same], L[same - 1]) > 8 * (c + 1)]
        c += 1
    lcp[1:] = np.minimum(lcp[1:], np.minimum(L[1:], L[:-1]))
    return lcp


