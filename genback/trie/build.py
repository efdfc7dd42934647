"""Array layout of a token-character trie, built from one sort and one longest-common-prefix pass.

Nodes are the distinct prefixes of the vocabulary's words plus one leaf per vocabulary item.
Node ids follow the depth-first pre-order of the words in lexicographic order (a leaf comes
before its siblings' subtrees, as the empty continuation sorts first), so:

* the root is node 0;
* the words below any node are one contiguous slice ``[start, end)`` of the sorted word list
  ("leaf order"); node values are reductions over that slice.

Construction (no per-byte Python loop):

1. ``order`` = stable sort of the items by their letter sequences; ``lcp[k]`` = longest common
   prefix of sorted words ``k-1`` and ``k``. For ``bytes`` / ``Token`` items (the usual case) both
   are integer work on the words' bytes read 8 at a time as big-endian ``uint64`` from one packed
   buffer: an integer argsort of the first 8 bytes, a Python sort of only the items tied on
   them, and LCP passes of 8 bytes (XOR, first non-zero byte); the sorted ``keys`` list is built
   only when ``lookup`` first needs it. Other items go through a padded letter matrix.
2. Word ``k`` creates the nodes at depths ``lcp[k]+1 .. len_k`` ("forward" enumeration, which is
   the pre-order) and closes the nodes at depths ``lcp[k+1]+1 .. len_k`` ("backward" enumeration).
   Ranked by (depth, word) both enumerations list the same nodes in the same order, which pairs
   every node's first word with its last word: ``[start, end)`` without a stack.
3. A node's parent is the previous pre-order node of the same word, or (for the first node a word
   creates) the node one level up found by binary search in the (depth, word)-sorted list.

Letters: a ``bytes`` / ``Token`` item's letters are its bytes (ints 0..255). Any other item is
iterated; letters that are ints in 0..255 are bytes, every other letter (e.g. genlm-control's
``EOS`` object, which iterates to itself) becomes a symbol code 256, 257, ... in order of first
appearance, sorting after all bytes. Symbols switch the keys to two bytes per letter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..tokenization.token import Token

__all__ = ["TrieLayout", "build_layout"]

_LCP_WIDTH = 32  # columns of the padded matrix; longer common prefixes are finished in Python


@dataclass
class TrieLayout:
    """Node arrays of a trie over ``V`` items with ``N`` nodes (int64 numpy arrays)."""

    num_items: int
    order: np.ndarray  # (V,) item index of the k-th word in leaf order
    leaf_of_item: np.ndarray  # (V,) leaf node of item i
    parent: np.ndarray  # (N,) parent node, -1 for the root
    depth: np.ndarray  # (N,) letters in the node's prefix (a leaf: its word's length)
    letter: np.ndarray  # (N,) code of the edge letter into the node; -1 root and leaves
    start: np.ndarray  # (N,) first leaf-order word below the node
    end: np.ndarray  # (N,) one past the last leaf-order word below the node
    is_leaf: np.ndarray  # (N,) bool
    item_of_node: np.ndarray  # (N,) item index of a leaf, -1 for inner nodes
    _keys: object  # list of sorted encoded words, or a function returning it (built on first use)
    width: int  # 1 (all items are bytes) or 2 (symbol letters present)
    symbols: list = field(default_factory=list)  # symbol code 256 + j -> letter object
    # lookup support: inner nodes sorted by (depth, first word)
    inner_key_sorted: np.ndarray = None
    inner_node_sorted: np.ndarray = None

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def keys(self) -> list:
        """(V,) sorted encoded words (plain ``bytes``, ``width`` bytes per letter); built on first use."""
        if callable(self._keys):
            self._keys = self._keys()
        return self._keys

    def decode_letter(self, code: int):
        """Letter object for a letter code (an int byte, or the original symbol object)."""
        return code if code < 256 else self.symbols[code - 256]

    def encode_prefix(self, prefix) -> bytes | None:
        """Encoded key of a letter sequence, or ``None`` if it has an unknown symbol."""
        if isinstance(prefix, (bytes, bytearray, memoryview)):
            prefix = bytes(prefix)
            if self.width == 1:
                return prefix
            return np.frombuffer(prefix, np.uint8).astype(">u2").tobytes()
        codes = []
        index = {id(s): j for j, s in enumerate(self.symbols)}
        for letter in prefix:
            if isinstance(letter, (int, np.integer)) and not isinstance(letter, bool) and 0 <= letter < 256:
                codes.append(int(letter))
            else:
                j = index.get(id(letter))
                if j is None:
                    j = next((j for j, s in enumerate(self.symbols) if s == letter), None)
                if j is None:
                    return None
                codes.append(256 + j)
        if self.width == 1:
            if any(c >= 256 for c in codes):
                return None
            return bytes(codes)
        return np.asarray(codes, dtype=">u2").tobytes()


def _encode_items(decode) -> tuple[list, int, list]:
    """Encode items as sortable byte keys. Returns (keys, width, symbols)."""
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
    if len(symbols) > 65535 - 256:
        raise ValueError(f"TokenCharacterTrie: too many distinct non-byte letters ({len(symbols)})")
    # Two bytes per letter (big-endian) keeps lexicographic order.
    plain = [i for i in range(len(keys)) if keys[i] is not None]
    if plain:
        lengths = np.fromiter((len(keys[i]) for i in plain), np.int64, len(plain))
        wide = np.frombuffer(b"".join(keys[i] for i in plain), np.uint8).astype(">u2").tobytes()
        bounds = np.concatenate([[0], np.cumsum(lengths * 2)]).tolist()
        for n, i in enumerate(plain):
            keys[i] = wide[bounds[n] : bounds[n + 1]]
    for i, codes in coded.items():
        keys[i] = np.asarray(codes, dtype=">u2").tobytes()
    return keys, 2, symbols


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


def _ranks_by_depth(owner: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Permutation sorting (depth, owner) lexicographically; owner is already non-decreasing.

    Depths fit in int16 for any real vocabulary, where numpy's stable sort is a radix sort
    (several times faster than the int64 merge sort)."""
    if len(depth) and depth.max() < 32767:
        depth = depth.astype(np.int16)
    return np.argsort(depth, kind="stable")


def build_layout(decode) -> TrieLayout:
    """Build the ``TrieLayout`` of a list of vocabulary items (see the module docstring)."""
    V = len(decode)
    if V == 0:
        z = np.zeros(1, np.int64)
        return TrieLayout(0, np.zeros(0, np.int64), np.zeros(0, np.int64), np.array([-1]), z, np.array([-1]),
                          z, z.copy(), np.zeros(1, bool), np.array([-1]), [], 1, [],
                          np.zeros(0, np.int64), np.zeros(0, np.int64))
    if all(issubclass(t, bytes) for t in set(map(type, decode))):
        # fast path (Token / bytes items): integer sort and 8-byte LCP passes, keys built lazily
        width, symbols = 1, []
        words = _ByteWords(decode)
        order = _sort_bytes(words, decode)
        lcp_prev = _lcp_bytes(words, order)
        L, flat, offsets = words.lengths[order], words.flat, words.offsets[order]
        order_list = order.tolist()

        def skeys():
            return [bytes(decode[i]) for i in order_list]
    else:
        keys, width, symbols = _encode_items(decode)
        order = np.asarray(sorted(range(V), key=keys.__getitem__), dtype=np.int64)
        skeys = [keys[i] for i in order.tolist()]
        maxlen = max(map(len, skeys)) // width
        mat, L, flat, offsets = _letters_matrix(skeys, width, max(1, min(maxlen, _LCP_WIDTH)))
        lcp_prev = _lcp(skeys, width, mat, L)
    lcp_next = np.append(lcp_prev[1:], 0)

    # Inner nodes, forward enumeration (= pre-order): word k creates depths lcp_prev[k]+1 .. L[k].
    n_new = np.maximum(L - lcp_prev, 0)
    f_word = np.repeat(np.arange(V, dtype=np.int64), n_new)
    f_first = np.repeat(np.cumsum(n_new) - n_new, n_new)
    f_depth = np.arange(len(f_word), dtype=np.int64) - f_first + np.repeat(lcp_prev + 1, n_new)
    # Backward enumeration: word k closes depths lcp_next[k]+1 .. L[k].
    n_close = np.maximum(L - lcp_next, 0)
    b_word = np.repeat(np.arange(V, dtype=np.int64), n_close)
    b_first = np.repeat(np.cumsum(n_close) - n_close, n_close)
    b_depth = np.arange(len(b_word), dtype=np.int64) - b_first + np.repeat(lcp_next + 1, n_close)
    assert len(b_word) == len(f_word)

    # Pre-order ids: root 0, then per word its new inner nodes followed by its leaf.
    per_word = n_new + 1
    word_base = 1 + np.cumsum(per_word) - per_word  # id of word k's first new node
    f_id = np.repeat(word_base, n_new) + (np.arange(len(f_word)) - f_first)
    leaf_id = word_base + n_new
    N = 1 + len(f_word) + V

    f_rank = _ranks_by_depth(f_word, f_depth)
    b_rank = _ranks_by_depth(b_word, b_depth)
    start = np.zeros(N, np.int64)
    end = np.full(N, V, np.int64)
    start[f_id[f_rank]] = f_word[f_rank]
    end[f_id[f_rank]] = b_word[b_rank] + 1
    start[leaf_id] = np.arange(V)
    end[leaf_id] = np.arange(V) + 1

    # Search structure: inner nodes sorted by (depth, first word).
    stride = V + 1
    inner_key_sorted = f_depth[f_rank] * stride + f_word[f_rank]
    inner_node_sorted = f_id[f_rank]

    def containing(depth_q: np.ndarray, word_q: np.ndarray) -> np.ndarray:
        """Node at depth ``depth_q`` (>= 1) on the path of sorted word ``word_q``."""
        pos = np.searchsorted(inner_key_sorted, depth_q * stride + word_q, side="right") - 1
        return inner_node_sorted[pos]

    parent = np.full(N, -1, np.int64)
    depth = np.zeros(N, np.int64)
    depth[f_id] = f_depth
    depth[leaf_id] = L
    # inner nodes: previous pre-order id unless first created by its word
    first_new = np.zeros(len(f_word), bool)
    first_new[np.cumsum(n_new)[n_new > 0] - n_new[n_new > 0]] = True
    parent[f_id[~first_new]] = f_id[~first_new] - 1
    fd = f_depth[first_new]
    fw = f_word[first_new]
    par = np.zeros(len(fd), np.int64)
    deep = fd > 1
    par[deep] = containing(fd[deep] - 1, fw[deep])
    parent[f_id[first_new]] = par
    # leaves: the node at depth L[k] on word k's path
    leaf_parent = np.zeros(V, np.int64)
    own = n_new > 0
    leaf_parent[own] = leaf_id[own] - 1
    other = ~own & (L > 0)
    leaf_parent[other] = containing(L[other], np.flatnonzero(other))
    parent[leaf_id] = leaf_parent

    letter = np.full(N, -1, np.int64)
    letter[f_id] = flat[np.repeat(offsets, n_new) + f_depth - 1]
    is_leaf = np.zeros(N, bool)
    is_leaf[leaf_id] = True
    item_of_node = np.full(N, -1, np.int64)
    item_of_node[leaf_id] = order
    leaf_of_item = np.empty(V, np.int64)
    leaf_of_item[order] = leaf_id
    return TrieLayout(
        num_items=V, order=order, leaf_of_item=leaf_of_item, parent=parent, depth=depth,
        letter=letter, start=start, end=end, is_leaf=is_leaf, item_of_node=item_of_node,
        _keys=skeys, width=width, symbols=symbols,
        inner_key_sorted=inner_key_sorted, inner_node_sorted=inner_node_sorted,
    )
