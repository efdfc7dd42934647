"""A picture of the KV tree: which prefixes the cached contexts share (graphviz).

SMC users debug particle collapse and prompt reuse by looking at the tree their particles left:
one box per tree node (its edge's token count, its KV bytes, how many recently asked contexts
end at or below it; pinned nodes drawn with a double border), each edge labelled with its
tokens' decoded text, the root's first edge (usually the prompt) shortened. The trie's picture
(:meth:`genback.trie.TokenCharacterTrie.visualize`) is drawn the same way.

Building the ``graphviz.Digraph`` needs only the ``graphviz`` Python package; rendering it to a
file needs Graphviz's ``dot`` program.
"""

from __future__ import annotations

from typing import Callable


def _short(text: str, limit: int) -> str:
    """``text`` as a label of at most about ``limit`` characters (the middle elided)."""
    text = repr(text)[1:-1]
    if len(text) <= limit:
        return text
    head = max(1, limit * 2 // 3)
    return text[:head] + " … " + text[-(limit - head):]


def live_counts(tree, adapter=None) -> dict:
    """``{node: n}``: how many recently asked contexts (the tree's :class:`~.ends.Ends`) end
    exactly at each node, counting only notes that still hold (the node is in the tree and ends
    where the context does)."""
    counts: dict = {}
    for tokens, node, key in tree.ends.entries():
        if key == adapter and node.slots is not None and node.depth == len(tokens):
            counts[node] = counts.get(node, 0) + 1
    return counts


def draw(tree, token_text: Callable[[list], str], max_nodes: int = 200, adapter=None,
         prompt_chars: int = 48, edge_chars: int = 24):
    """The KV tree under ``adapter`` as a ``graphviz.Digraph`` (left to right).

    Args:
        tree: a :class:`~.kvtree.KVTree`.
        token_text: token ids -> text (the tokenizer's ``decode``), for the edge labels.
        max_nodes: most nodes drawn, in depth-first order (children by first token); a note
            says how many more there are.
        prompt_chars / edge_chars: label lengths of the root's edges and of the others.

    Returns:
        The digraph; its ``graph_attr["comment"]`` holds the drawn and total counts of nodes and
        tokens (``"nodes=.. tokens=.. drawn_nodes=.. drawn_tokens=.."``).

    Raises:
        ImportError: the ``graphviz`` package is missing (``pip install graphviz``).
        ValueError: ``max_nodes < 1``.
    """
    try:
        import graphviz
    except ImportError as exc:  # pragma: no cover
        raise ImportError("visualize_cache needs `pip install graphviz`") from exc
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise ValueError(f"max_nodes must be a positive int, got {max_nodes!r}")
    root = tree.root_of(adapter)
    order, stack = [], [root]  # depth-first, children by first token
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children[t] for t in sorted(node.children, reverse=True))
    live = live_counts(tree, adapter)
    under = dict(live)
    for node in reversed(order):  # children before parents: sums of live contexts below
        if node.parent is not None:
            under[node.parent] = under.get(node.parent, 0) + under.get(node, 0)
    shown = order[: max_nodes + 1]  # (the root is not counted)
    ids = {node: f"n{i}" for i, node in enumerate(shown)}
    dot = graphviz.Digraph(comment="KV tree")
    dot.attr(rankdir="LR")
    dot.attr("node", shape="box", fontsize="10")
    total_tokens = sum(len(n.edge) for n in order[1:])
    dot.node("n0", f"root\n{len(order) - 1} nodes, {total_tokens} tokens\n"
                   f"{under.get(root, 0)} live", shape="ellipse")
    drawn_tokens = 0
    for node in shown[1:]:
        drawn_tokens += len(node.edge)
        label = f"{len(node.edge)} tok, {node.bytes:,} B\n{under.get(node, 0)} live"
        if live.get(node):
            label += f" ({live[node]} end here)"
        dot.node(ids[node], label, peripheries="2" if node.pinned else "1")
        limit = prompt_chars if node.parent is root else edge_chars
        dot.edge(ids[node.parent], ids[node], _short(token_text(list(node.edge)), limit))
    if len(order) > len(shown):
        dot.node("more", f"+{len(order) - len(shown)} more nodes", shape="plaintext")
    dot.graph_attr["comment"] = (f"nodes={len(order) - 1} tokens={total_tokens} "
                                 f"drawn_nodes={len(shown) - 1} drawn_tokens={drawn_tokens}")
    return dot
