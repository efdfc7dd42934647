"""Array layout of a token-character trie, built from one sort and one longest-common-prefix pass.

Nodes are the distinct prefixes of the vocabulary's words plus one leaf per vocabulary item.
Node ids follow the depth-first pre-order of the words in lexicographic order (a leaf comes
before its siblings' subtrees, as the empty continuation sorts first), so:

* the root is node 0;
* the words below any node are one contiguous slice ``[start, end)`` of the sorted word list
  ("leaf order"); node values are reductions over that slice.

Construction (no per-byte Python loop):

1. ``order`` = stable sort of the items by their letter sequences; ``lcp[k]`` = longest common
   prefix of sorted words ``k-1`` and ``k`` (``genback.trie.words``). For ``bytes`` / ``Token`` items (the usual case) both
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

from .words import SortedWords, sort_words

__all__ = ["TrieLayout", "build_layout"]


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


def _ranks_by_depth(owner: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Permutation sorting (depth, owner) lexicographically; owner is already non-decreasing.

    Depths fit in int16 for any real vocabulary, where numpy's stable sort is a radix sort
    (several times faster than the int64 merge sort)."""
    if len(depth) and depth.max() < 32767:
        depth = depth.astype(np.int16)
    return np.argsort(depth, kind="stable")


@dataclass
class _Inner:
    """The ``F`` inner nodes other than the root, in forward enumeration (= pre-order); int64."""

    count: np.ndarray  # (V,) nodes sorted word k creates: depths lcp[k]+1 .. len_k
    word: np.ndarray  # (F,) the sorted word creating each node
    depth: np.ndarray  # (F,)
    node: np.ndarray  # (F,) pre-order node id
    leaf: np.ndarray  # (V,) node id of sorted word k's leaf
    rank: np.ndarray  # (F,) permutation sorting the nodes by (depth, word)

    @property
    def num_nodes(self) -> int:
        """N: the root, the inner nodes and the leaves."""
        return 1 + len(self.word) + len(self.leaf)


@dataclass
class _PathIndex:
    """The inner nodes sorted by (depth, first word), to find the node at a depth on a word's path."""

    key: np.ndarray  # (F,) int64 depth * stride + first word, ascending
    node: np.ndarray  # (F,) int64 node id of each key
    stride: int  # V + 1

    def containing(self, depth_q: np.ndarray, word_q: np.ndarray) -> np.ndarray:
        """Node at depth ``depth_q`` (>= 1) on the path of sorted word ``word_q``; (Q,) int64."""
        pos = np.searchsorted(self.key, depth_q * self.stride + word_q, side="right") - 1
        return self.node[pos]


def _depth_runs(lo: np.ndarray, hi: np.ndarray):
    """The depths ``lo[k]+1 .. hi[k]`` of every word ``k``, word after word: ``(count, word, first,
    depth)``, ``count`` (V,) = ``max(hi - lo, 0)``, and per entry (F,) its word, the index of its
    word's first entry and its depth (int64)."""
    count = np.maximum(hi - lo, 0)
    word = np.repeat(np.arange(len(count), dtype=np.int64), count)
    first = np.repeat(np.cumsum(count) - count, count)
    depth = np.arange(len(word), dtype=np.int64) - first + np.repeat(lo + 1, count)
    return count, word, first, depth


def _inner_nodes(words: SortedWords) -> _Inner:
    """The inner nodes in forward enumeration (word k creates depths ``lcp[k]+1 .. len_k``) with
    their pre-order ids: root 0, then per word its new inner nodes followed by its leaf."""
    count, word, first, depth = _depth_runs(words.lcp, words.lengths)
    per_word = count + 1
    word_base = 1 + np.cumsum(per_word) - per_word  # id of word k's first new node
    node = np.repeat(word_base, count) + (np.arange(len(word)) - first)
    return _Inner(count, word, depth, node, word_base + count, _ranks_by_depth(word, depth))


def _slices(words: SortedWords, inner: _Inner) -> tuple[np.ndarray, np.ndarray]:
    """``(start, end)``, (N,) int64: every node's slice of the leaf order. The backward
    enumeration (word k closes depths ``lcp[k+1]+1 .. len_k``), ranked by (depth, word), lists
    the nodes in the forward ranking's order with each node's last word."""
    V, N = len(words.order), inner.num_nodes
    lcp_next = np.append(words.lcp[1:], 0)
    _, b_word, _, b_depth = _depth_runs(lcp_next, words.lengths)
    assert len(b_word) == len(inner.word)
    b_rank = _ranks_by_depth(b_word, b_depth)
    start = np.zeros(N, np.int64)
    end = np.full(N, V, np.int64)
    ranked = inner.node[inner.rank]
    start[ranked] = inner.word[inner.rank]
    end[ranked] = b_word[b_rank] + 1
    start[inner.leaf] = np.arange(V)
    end[inner.leaf] = np.arange(V) + 1
    return start, end


def _parents(words: SortedWords, inner: _Inner, index: _PathIndex) -> np.ndarray:
    """(N,) int64 parent of every node, -1 for the root: an inner node's previous pre-order node,
    unless it is the first its word creates; that node's and a leaf's are found in ``index``."""
    parent = np.full(inner.num_nodes, -1, np.int64)
    n_new, L = inner.count, words.lengths
    first_new = np.zeros(len(inner.word), bool)
    first_new[np.cumsum(n_new)[n_new > 0] - n_new[n_new > 0]] = True
    parent[inner.node[~first_new]] = inner.node[~first_new] - 1
    fd, fw = inner.depth[first_new], inner.word[first_new]
    par = np.zeros(len(fd), np.int64)
    deep = fd > 1
    par[deep] = index.containing(fd[deep] - 1, fw[deep])
    parent[inner.node[first_new]] = par
    # leaves: the node at depth L[k] on word k's path
    leaf_parent = np.zeros(len(L), np.int64)
    own = n_new > 0
    leaf_parent[own] = inner.leaf[own] - 1
    other = ~own & (L > 0)
    leaf_parent[other] = index.containing(L[other], np.flatnonzero(other))
    parent[inner.leaf] = leaf_parent
    return parent


def _empty_layout() -> TrieLayout:
    """The layout of an empty vocabulary: the root alone."""
    z = np.zeros(1, np.int64)
    return TrieLayout(0, np.zeros(0, np.int64), np.zeros(0, np.int64), np.array([-1]), z, np.array([-1]),
                      z, z.copy(), np.zeros(1, bool), np.array([-1]), [], 1, [],
                      np.zeros(0, np.int64), np.zeros(0, np.int64))


def build_layout(decode) -> TrieLayout:
    """Build the ``TrieLayout`` of a list of vocabulary items (see the module docstring)."""
    V = len(decode)
    if V == 0:
        return _empty_layout()
    words = sort_words(decode)
    inner = _inner_nodes(words)
    start, end = _slices(words, inner)
    index = _PathIndex(inner.depth[inner.rank] * (V + 1) + inner.word[inner.rank], inner.node[inner.rank], V + 1)
    N = inner.num_nodes
    depth = np.zeros(N, np.int64)
    depth[inner.node] = inner.depth
    depth[inner.leaf] = words.lengths
    letter = np.full(N, -1, np.int64)
    letter[inner.node] = words.flat[np.repeat(words.offsets, inner.count) + inner.depth - 1]
    is_leaf = np.zeros(N, bool)
    is_leaf[inner.leaf] = True
    item_of_node = np.full(N, -1, np.int64)
    item_of_node[inner.leaf] = words.order
    leaf_of_item = np.empty(V, np.int64)
    leaf_of_item[words.order] = inner.leaf
    return TrieLayout(
        num_items=V, order=words.order, leaf_of_item=leaf_of_item, parent=_parents(words, inner, index),
        depth=depth, letter=letter, start=start, end=end, is_leaf=is_leaf, item_of_node=item_of_node,
        _keys=words.keys, width=words.width, symbols=words.symbols,
        inner_key_sorted=index.key, inner_node_sorted=index.node,
    )
