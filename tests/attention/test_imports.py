"""The attention package's own imports: all at module level, and no module imports one that imports it back."""

import ast
from pathlib import Path

import ringpack.attention
from ringpack.attention import engine, kv_transport, ring

PACKAGE = Path(ringpack.attention.__file__).parent
MODULES = {path.stem: path for path in PACKAGE.glob("*.py") if path.stem != "__init__"}


def _ringpack_imports(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """``(node, module)`` of every import of a ringpack module in ``tree``; ``from ringpack.attention
    import ring`` counts as importing ``ringpack.attention.ring``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, alias.name) for alias in node.names if alias.name.startswith("ringpack")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ringpack"):
            names = [f"{node.module}.{a.name}" for a in node.names if a.name in MODULES]
            found += [(node, name) for name in names] if node.module == "ringpack.attention" else [(node, node.module)]
    return found


def _local_imports(tree: ast.AST) -> list[str]:
    """ringpack modules imported inside a function body."""
    return [
        name
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for _, name in _ringpack_imports(fn)
    ]


def test_no_function_local_imports_of_ringpack_modules():
    local = {stem: _local_imports(ast.parse(path.read_text())) for stem, path in MODULES.items()}
    assert {stem: names for stem, names in local.items() if names} == {}


def test_attention_modules_import_no_circle():
    prefix = "ringpack.attention."
    graph = {
        stem: {
            name.removeprefix(prefix).split(".")[0]
            for _, name in _ringpack_imports(ast.parse(path.read_text()))
            if name.startswith(prefix)
        }
        for stem, path in MODULES.items()
    }
    assert graph["traced"] and "traced" in graph["api"]  # the graph is read, not empty

    def reaches(start: str, goal: str, seen: set) -> bool:
        nexts = graph.get(start, ())
        return goal in nexts or any(reaches(n, goal, seen | {n}) for n in nexts if n not in seen)

    circles = sorted(stem for stem in graph if reaches(stem, stem, {stem}))
    assert circles == []


def test_the_engine_imports_no_transport():
    """Transports only move bytes for the engine: the engine reaches them through its pass config alone."""
    imported = {name for _, name in _ringpack_imports(ast.parse(MODULES["engine"].read_text()))}
    transports = {f"ringpack.attention.{stem}" for stem in ("ring", "allgather", "p2p", "transports")}
    assert "ringpack.attention.kv_transport" in imported and not imported & transports


def test_the_engine_and_the_protocol_keep_their_former_address():
    """``ringpack.attention.ring`` held the engine and the transport protocol: their names still import from there."""
    for name in engine.__all__:
        assert getattr(ring, name) is getattr(engine, name), name
    for name in kv_transport.__all__:
        assert getattr(ring, name) is getattr(kv_transport, name), name
