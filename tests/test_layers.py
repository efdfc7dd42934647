"""The package's house rules, checked on its source (imports and definitions as ``ast`` reads
them, every import statement counted: module level, in functions, under ``TYPE_CHECKING``):

* no circular import, and no module importing one of a higher layer (listed in :data:`LAYERS`,
  top first: a module imports only what stands below it, or beside it in its own layer);
* the HF runner's rooms stand in one stack (:data:`HF_ROOMS`), and no backend imports another;
* no module over 400 lines; at most 20 functions of 40 lines or more, the longest under 70;
* query kinds are branched on (``isinstance``, ``type(q) is``, ``case Kind()``) only inside
  runners, and in one module of the HF runner;
* the package root holds entry points and glue only (the query path lives in ``batching/`` and
  ``queries/``, the command line in ``cli/``, the backends in ``llm/``).

``docs/reference/architecture.md`` describes the same layers for readers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "genback"

# top first; a module belongs to the first layer whose prefix it starts with
LAYERS = [
    ("cli", ("genback.__init__", "genback.__main__", "genback.cli", "genback.compat")),
    ("engine", ("genback.engine",)),
    ("facade", ("genback.llm.__init__", "genback.llm.backends")),
    ("backends", ("genback.llm",)),
    ("core", ("genback.core",)),
    ("trie", ("genback.trie",)),
    ("way in", ("genback.batching",)),
    ("shared", ("genback",)),
]
# the HF runner's rooms, top first (execute and chain are the runner's batches, lora, memory and
# options serve it: beside it)
HF_ROOMS = [("model",), ("runner", "execute", "chain", "lora", "memory", "options", "__init__"),
            ("decode",), ("forward",), ("plan",), ("cache",)]
KINDS = {"NextToken", "Score", "Prefill", "Step"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The genback modules an import statement of module ``name`` imports."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        if node.level:
            base = name.rsplit(".", node.level)[0]
            mod = f"{base}.{node.module}" if node.module else base
        else:
            mod = node.module or ""
        targets = []
        for alias in node.names:
            sub = f"{mod}.{alias.name}"
            targets.append(sub if sub in MODULES or f"{sub}.__init__" in MODULES else mod)
    out = []
    for t in targets:
        if not t.startswith("genback"):
            continue
        t = t if t in MODULES else f"{t}.__init__"
        if t in MODULES:
            out.append(t)
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(t for t in _resolve(name, node) if t != name)
        # a package's own __init__ is imported implicitly, never an edge of its modules
        graph[name] = {t for t in edges if not (t.endswith(".__init__")
                                               and name.startswith(t[: -len("__init__")]))}
    return graph


def _layer(name: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(name)


def _hf_room(name: str) -> int | None:
    prefix = "genback.llm.hf."
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".")[0]
    return next(i for i, room in enumerate(HF_ROOMS) if head in room)


def test_the_graph_is_read():
    graph = _graph()
    assert len(graph) > 80
    assert "genback.llm.hf.cache.kvtree" in graph["genback.llm.hf.runner"]
    assert "genback.core.lm" in graph["genback.llm.hf.model"]


def test_no_circular_import():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "circular imports:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_import_goes_down_the_layers():
    up = []
    for name, targets in _graph().items():
        for t in targets:
            if _layer(t) < _layer(name):
                up.append(f"{name} ({LAYERS[_layer(name)][0]}) imports {t} "
                          f"({LAYERS[_layer(t)][0]})")
            a, b = _hf_room(name), _hf_room(t)
            if a is not None and b is not None and b < a:
                up.append(f"{name} imports {t}: a higher room of the HF runner")
            wings = [n.split(".")[2] for n in (name, t) if n.startswith("genback.llm.")
                     and n.count(".") >= 3]
            if len(wings) == 2 and wings[0] != wings[1]:
                up.append(f"{name} imports {t}: another backend")
    assert not up, "\n".join(sorted(up))


def _function_lengths() -> list[tuple[int, str]]:
    out = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node.end_lineno - node.lineno + 1, f"{name}.{node.name}"))
    return sorted(out, reverse=True)


def test_modules_and_functions_stay_short():
    long_modules = [(len(p.read_text().splitlines()), n) for n, p in MODULES.items()
                    if len(p.read_text().splitlines()) > 400]
    assert not long_modules, long_modules
    lengths = _function_lengths()
    long = [f for f in lengths if f[0] >= 40]
    assert len(long) <= 20, long
    assert lengths[0][0] < 70, lengths[:3]


def _kind_branches(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            if names & KINDS:
                lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.Is, ast.IsNot, ast.In))
                                                   for o in node.ops):
            left = node.left
            if (isinstance(left, ast.Call) and getattr(left.func, "id", None) == "type"
                    and {n.id for c in node.comparators for n in ast.walk(c)
                         if isinstance(n, ast.Name)} & KINDS):
                lines.append(node.lineno)
        elif isinstance(node, ast.MatchClass) and getattr(node.cls, "id", None) in KINDS:
            lines.append(node.lineno)
    return lines


def test_query_kinds_are_branched_on_only_inside_runners():
    where = {n: _kind_branches(p) for n, p in MODULES.items()}
    where = {n: lines for n, lines in where.items() if lines}
    outside = [n for n in where if not n.startswith("genback.llm.")]
    assert not outside, {n: where[n] for n in outside}
    hf = [n for n in where if n.startswith("genback.llm.hf.")]
    assert hf == ["genback.llm.hf.forward.results"], hf
    assert where  # (the check finds the branches that are there)


def test_the_package_root_holds_entry_points_and_glue_only():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert root == ["__init__.py", "__main__.py", "compat.py", "cpython.py", "hub.py", "registry.py"], root
    assert not (PACKAGE / "runners").exists()  # the backends live under genback/llm/
