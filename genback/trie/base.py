"""``TokenCharacterTrie``: vocabulary-wide sums and maxes at every byte prefix, on the CPU.

Every node's tokens are one contiguous slice of the words in lexicographic order (see
``genback.trie.build``), so all node values are range reductions over the weights permuted into
that order. Sums and maxes read each distinct slice (a chain of single-child nodes shares one) as
a few aligned power-of-two blocks of a segment tree (``genback.trie.blocks``); log-sum-exp
combines children level by level with a max shift (``genback.trie.plan``). Accumulation is float64.

Public attributes keep genlm-backend 0.3.1's meaning (its clients, e.g. genlm-control, read them):

* ``root``: node id of the root (0 here; genlm-backend numbers nodes differently, use ``root``);
* ``children[node]``: dict ``letter -> child`` for inner edges (``letter`` an int byte, or a
  non-byte letter object such as genlm-control's ``EOS``) and ``(None, i) -> leaf`` for the leaf
  of ``decode[i]``;
* ``node2prefix[node]``: list of the letters on the path (a leaf has its parent's prefix);
* ``word2leaf``: ``(byte_string, token_id) -> leaf`` for ``Token`` items, ``item -> leaf`` for
  plain ``bytes`` and other items; ``leaf2word`` is its inverse;
* ``idx_to_leaf``: ``(V, 2)`` int array of ``(i, leaf of decode[i])``; ``token_id_to_leaf``: ``(V,)``
  int array, ``token_id_to_leaf[i]`` = leaf of ``decode[i]`` (``i`` is the position in ``decode``,
  which equals the token id for ``decode_vocab`` vocabularies).

``children``, ``node2prefix``, ``word2leaf`` and ``leaf2word`` are Python dicts built on first
access (hundreds of ms for a 262k vocabulary); the reductions never need them.
"""

from __future__ import annotations

import bisect
import operator
import warnings
from functools import cached_property

import numpy as np

from ..tokenization.token import Token
from .blocks import make_block_plan, run_block_plan
from .build import build_layout
from .plan import make_plan, run_plan
from .weights import as_weight_matrix

__all__ = ["TokenCharacterTrie"]

_token_id = operator.attrgetter("token_id")


def _check_token_ids(ids: list) -> None:
    """Raise ``ValueError`` naming the first repeated ``Token`` id in ``ids``."""
    if len(ids) != len(set(ids)):
        seen: set = set()
        dup = next(i for i in ids if i in seen or seen.add(i))
        raise ValueError(f"TokenCharacterTrie: Duplicate word in vocabulary: duplicate "
                         f"Token id {dup} in decode")


class TokenCharacterTrie:
    """Trie of a vocabulary's byte strings with vectorised per-node reductions.

    Args:
        decode: list of vocabulary items; ``decode[i]`` is the item whose weight is ``ws[i]``.
            Items are ``Token`` (from ``decode_vocab``), plain ``bytes`` (two equal byte strings
            are then a ``ValueError``; use ``Token`` to keep duplicates), or any iterable of
            hashable letters (e.g. genlm-control's ``EOS``, which iterates to itself: one
            non-byte edge below the root).

    Raises:
        TypeError: ``decode`` is not a sequence or an item is not iterable.
        ValueError: two items have the same ``word2leaf`` key (equal plain bytes, or a repeated
            ``Token`` id).

    Weight arguments (all reduction methods): ``ws`` has shape ``(V,)`` and ``W`` shape ``(B, V)``
    with ``V = len(decode)``; numpy arrays, torch tensors (any device; copied to the CPU), or
    nested lists. Floating dtypes are used as float64; integer dtypes are cast to float64; bool,
    complex and object dtypes raise ``TypeError``; NaN raises ``ValueError``. ``-inf`` is allowed
    everywhere (log weights).
    """

    def __init__(self, decode):
        try:
            decode = list(decode)
        except TypeError:
            raise TypeError(f"TokenCharacterTrie: decode must be a sequence, got {type(decode).__name__}") from None
        self.decode = decode
        self._layout = lay = build_layout(decode)
        self._check_duplicates()
        self.root = 0
        self.num_nodes = lay.num_nodes
        self.num_tokens = len(decode)
        self.token_id_to_leaf = lay.leaf_of_item
        self.idx_to_leaf = np.stack([np.arange(len(decode)), lay.leaf_of_item], axis=1)
        self.ordering = np.arange(lay.num_nodes - 1, -1, -1)  # children before parents
        self._blocks = make_block_plan(lay)

    @cached_property
    def _plan(self):
        """Level-wise plan (``genback.trie.plan``) for log-sum-exp; lazy."""
        return make_plan(self._layout)

    # ----------------------------------------------------------------- structure
    def _check_duplicates(self) -> None:
        """Raise ``ValueError`` when two items have the same ``word2leaf`` key (a repeated
        ``Token`` id, equal plain bytes, or a repeated other item); warn (``DeprecationWarning``)
        when plain bytes are given."""
        if set(map(type, self.decode)) == {Token}:  # fast path: only ids can repeat
            _check_token_ids(list(map(_token_id, self.decode)))
            return
        tokens = [x for x in self.decode if isinstance(x, Token)]
        _check_token_ids([x.token_id for x in tokens])
        if len(tokens) == len(self.decode):
            return
        plain = [Token.is_plain_bytes(x) for x in self.decode]
        if any(plain):
            warnings.warn(
                "Passing plain bytes to TokenCharacterTrie is deprecated (genlm-backend's "
                "wording): use Token objects from decode_vocab(), which keep equal byte strings "
                "apart",
                DeprecationWarning, stacklevel=4)
        self._check_plain_bytes(plain)
        other = [x for x in self.decode if not isinstance(x, bytes)]
        if len(other) != len(set(other)):
            raise ValueError("TokenCharacterTrie: Duplicate word in vocabulary: a repeated "
                             "non-bytes item in decode")

    def _check_plain_bytes(self, plain: list) -> None:
        """Raise ``ValueError`` naming two equal plain-bytes items (``plain[i]``: ``decode[i]``
        is plain bytes); equal byte strings are adjacent in leaf order."""
        prev = None
        for k in self._layout.order.tolist():
            if plain[k]:
                if prev is not None and self.decode[prev] == self.decode[k]:
                    raise ValueError(
                        f"TokenCharacterTrie: Duplicate word in vocabulary: duplicate bytes "
                        f"{self.decode[k]!r} in decode (positions {prev} and {k}); use Token "
                        "objects to keep duplicates"
                    )
                prev = k

    def _word_key(self, item):
        return (bytes(item), item.token_id) if isinstance(item, Token) else item

    @cached_property
    def children(self) -> list[dict]:
        """``children[node]``: ``{letter: child, (None, i): leaf}`` (see the module docstring).

        Each dict lists its edges in the order of their first item in ``decode`` (the order in
        which inserting ``decode[0], decode[1], ...`` one by one would add them, as genlm-backend
        does), so clients that iterate a node's edges and draw from them (genlm-control's
        ``EagerSetSampler``) draw the same edge for the same random number.
        """
        lay = self._layout
        out = [{} for _ in range(lay.num_nodes)]
        if lay.num_nodes <= 1:
            return out
        # first item below each node = min position in decode over its slice (a range max of -i)
        first = -run_block_plan(self._blocks, -np.arange(self.num_tokens, dtype=np.float64)[None, :], "max")[0]
        nodes = (np.argsort(first[1:], kind="stable") + 1).tolist()
        parent = lay.parent.tolist()
        letter = lay.letter.tolist()
        item = lay.item_of_node.tolist()
        for n in nodes:
            key = (None, item[n]) if item[n] >= 0 else lay.decode_letter(letter[n])
            out[parent[n]][key] = n
        return out

    @cached_property
    def node2prefix(self) -> dict[int, list]:
        lay = self._layout
        out = {0: []}
        parent = lay.parent.tolist()
        letter = lay.letter.tolist()
        leaf = lay.is_leaf.tolist()
        for n in range(1, lay.num_nodes):  # parents precede children in pre-order
            p = out[parent[n]]
            out[n] = p if leaf[n] else p + [lay.decode_letter(letter[n])]
        return out

    @cached_property
    def word2leaf(self) -> dict:
        return {self._word_key(x): int(leaf) for x, leaf in zip(self.decode, self.token_id_to_leaf.tolist())}

    @cached_property
    def leaf2word(self) -> dict:
        return {leaf: word for word, leaf in self.word2leaf.items()}

    def lookup(self, prefix) -> int | None:
        """Node id of a prefix (``bytes``, or a sequence of letters), or ``None`` if no token starts with it.

        O(len(prefix) · log V) by binary search over the sorted words; never builds ``children``.
        """
        lay = self._layout
        key = lay.encode_prefix(prefix)
        if key is None:
            return None
        if not key:
            return self.root
        k = bisect.bisect_left(lay.keys, key)
        if k >= lay.num_items or not lay.keys[k].startswith(key):
            return None
        d = len(key) // lay.width
        pos = np.searchsorted(lay.inner_key_sorted, d * (lay.num_items + 1) + k, side="right") - 1
        return int(lay.inner_node_sorted[pos])

    def node_tokens(self, node: int) -> np.ndarray:
        """Positions in ``decode`` of all items below ``node`` (int64 array, leaf order)."""
        lay = self._layout
        return lay.order[lay.start[node] : lay.end[node]]

    @property
    def node_depth(self) -> np.ndarray:
        """(num_nodes,) int64: prefix length in letters (leaves: their word's length)."""
        return self._layout.depth

    @property
    def node_parent(self) -> np.ndarray:
        """(num_nodes,) int64 parent ids (-1 for the root)."""
        return self._layout.parent

    @property
    def leaf_mask(self) -> np.ndarray:
        """(num_nodes,) bool, True at leaves."""
        return self._layout.is_leaf

    # ----------------------------------------------------------------- reductions
    def _reduce(self, W: np.ndarray, op: str, name: str) -> np.ndarray:
        if self.num_tokens == 0:
            return np.full((W.shape[0], 1), 0.0 if op == "sum" else -np.inf)
        if op == "logsumexp":
            out = run_plan(self._plan, W, op)
        else:
            out = run_block_plan(self._blocks, W, op)
        if np.isnan(out[:, 0]).any():  # a NaN weight always reaches the root (so can inf - inf)
            self._raise_if_nan(W, name)
        return out

    @staticmethod
    def _raise_if_nan(W: np.ndarray, name: str) -> None:
        bad = np.argwhere(np.isnan(W))
        if len(bad):
            r, c = bad[0]
            where = f"[{c}]" if W.shape[0] == 1 else f"[{r}, {c}]"
            raise ValueError(f"TokenCharacterTrie: {name}{where} is NaN ({len(bad)} NaN weights)")

    def batch_weight_sum(self, W) -> np.ndarray:
        """Sum of the weights of all tokens below each node, for each row.

        Args:
            W: weights, shape ``(B, V)`` (see the class docstring for accepted types).

        Returns:
            float64 numpy array ``(B, num_nodes)``; ``out[b, n] = sum(W[b, i] for i below n)``
            (a leaf holds its own token's weight).

        Raises:
            TypeError / ValueError: bad type, dtype, shape, or a NaN weight.
        """
        W = as_weight_matrix(W, self.num_tokens, "W", batched=True)
        return self._reduce(W, "sum", "W")

    def batch_weight_max(self, W) -> np.ndarray:
        """Max of the weights of all tokens below each node: ``(B, V) -> (B, num_nodes)`` float64.

        Correct for negative and ``-inf`` weights (an all ``-inf`` subtree gives ``-inf``).
        """
        W = as_weight_matrix(W, self.num_tokens, "W", batched=True)
        return self._reduce(W, "max", "W")

    def batch_weight_logsumexp(self, W) -> np.ndarray:
        """``log(sum(exp(W[b, i]) for i below n))`` for log weights: ``(B, V) -> (B, num_nodes)`` float64.

        Children are combined with the usual max shift at every level (``genback.trie.plan``), so
        nothing underflows; all ``-inf`` below a node gives ``-inf``; a ``+inf`` weight gives ``+inf``.
        """
        W = as_weight_matrix(W, self.num_tokens, "W", batched=True)
        return self._reduce(W, "logsumexp", "W")

    def weight_sum(self, ws) -> np.ndarray:
        """``batch_weight_sum`` of one row: ``(V,) -> (num_nodes,)`` float64 numpy array."""
        return self._reduce(as_weight_matrix(ws, self.num_tokens, "ws", batched=False), "sum", "ws")[0]

    def weight_max(self, ws) -> np.ndarray:
        """``batch_weight_max`` of one row: ``(V,) -> (num_nodes,)`` float64 numpy array."""
        return self._reduce(as_weight_matrix(ws, self.num_tokens, "ws", batched=False), "max", "ws")[0]

    def weight_logsumexp(self, ws) -> np.ndarray:
        """``batch_weight_logsumexp`` of one row: ``(V,) -> (num_nodes,)`` float64 numpy array."""
        return self._reduce(as_weight_matrix(ws, self.num_tokens, "ws", batched=False), "logsumexp", "ws")[0]

    # ----------------------------------------------------------------- display
    def visualize(self, ws=None, prefix=b"", max_nodes: int = 200):
        """Graphviz drawing of the subtree below ``prefix`` (at most ``max_nodes`` nodes, pre-order).

        Args:
            ws: optional node values, shape ``(num_nodes,)`` (e.g. ``weight_sum(p)``), shown in
                each node and as green shading relative to the largest shown value.
            prefix: bytes (or letters) of the subtree's root; ``b""`` is the whole trie.
            max_nodes: cap on drawn nodes (a 49k vocabulary has ~200k nodes).

        Returns:
            ``graphviz.Digraph`` (rendering to a file needs the ``dot`` binary; the object does not).

        Raises:
            ImportError: the ``graphviz`` Python package is missing.
            ValueError: ``ws`` has the wrong length, ``prefix`` is not in the trie, or
                ``max_nodes < 1``.
        """
        try:
            import graphviz
        except ImportError as e:  # pragma: no cover
            raise ImportError("TokenCharacterTrie.visualize needs `pip install graphviz`") from e
        ws = self._visualize_weights(ws, max_nodes)
        top = self.lookup(prefix)
        if top is None:
            raise ValueError(f"visualize: prefix {prefix!r} is not a prefix of any token")
        last = self._shown_end(top, max_nodes)
        peak = max((ws[n] for n in range(top, last)), default=0.0) if ws is not None else 0.0
        dot = graphviz.Digraph(comment="token character trie")
        dot.attr(rankdir="LR")
        for n in range(top, last):
            self._draw_node(dot, n, top, ws, peak)
        if last < self.num_nodes and self._is_below(last, top):
            dot.node("more", f"... {self.num_nodes} nodes in all", shape="plaintext")
        return dot

    def _visualize_weights(self, ws, max_nodes: int):
        """``visualize``'s checked ``ws``: None, or a float64 ``(num_nodes,)`` numpy array."""
        if max_nodes < 1:
            raise ValueError(f"visualize: max_nodes must be >= 1, got {max_nodes}")
        if ws is not None:
            ws = np.asarray(ws.detach().cpu() if hasattr(ws, "detach") else ws, dtype=np.float64)
            if ws.shape != (self.num_nodes,):
                raise ValueError(f"visualize: ws must have shape ({self.num_nodes},), got {ws.shape}")
        return ws

    def _shown_end(self, top: int, max_nodes: int) -> int:
        """One past the last node ``visualize`` draws: the subtree below ``top`` is a contiguous
        pre-order id range, cut at ``max_nodes`` nodes."""
        last = top + 1
        while last < self.num_nodes and last - top < max_nodes and self._is_below(last, top):
            last += 1
        return last

    def _draw_node(self, dot, n: int, top: int, ws, peak: float) -> None:
        """Add node ``n`` to ``dot`` (its id, prefix and value, shaded green relative to
        ``peak``) and, below ``top``, the edge from its parent (its letter, or the leaf's item)."""
        lay = self._layout
        label = f"{n}\n{bytes(self._prefix_bytes(n))!r}" if lay.width == 1 else f"{n}"
        attrs = {"shape": "doublecircle" if lay.is_leaf[n] else "circle"}
        if ws is not None:
            label += f"\n{ws[n]:.4g}"
            if peak > 0 and np.isfinite(ws[n]) and ws[n] > 0:
                g = int(255 * (1 - min(ws[n] / peak, 1.0)))
                attrs.update(style="filled", fillcolor=f"#{g:02x}ff{g:02x}")
        dot.node(str(n), label, **attrs)
        if n != top:
            item = lay.item_of_node[n]
            edge = f"end ({item})" if item >= 0 else repr(lay.decode_letter(int(lay.letter[n])))
            dot.edge(str(lay.parent[n]), str(n), label=edge)

    def _is_below(self, n: int, top: int) -> bool:
        lay = self._layout
        return lay.start[top] <= lay.start[n] and lay.end[n] <= lay.end[top] and n > top

    def _prefix_bytes(self, n: int) -> list:
        lay = self._layout
        k = lay.start[n]
        d = lay.depth[n] if not lay.is_leaf[n] else len(lay.keys[k]) // lay.width
        return list(lay.keys[k][:d])

    def __len__(self) -> int:
        return self.num_nodes

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.num_tokens} tokens, {self.num_nodes} nodes)"
