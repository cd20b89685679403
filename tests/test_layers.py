"""Layers never point up, modules import each other in no circle, and ringpack's own modules are imported at the top.

Every module of ``ringpack/`` is parsed with ``ast``; every import counts, whether at module level,
under ``if TYPE_CHECKING:``, in a ``try`` or inside a function. The layers, bottom to top:

0. the ground floor, ``ringpack/*.py``: the plan contract, the cost model and its fit, lengths,
   tokens, errors, traffic, a micro-batch's piece table, row ranges, files, checks, mesh
   coordinates, progress;
1. ``ringpack.planner``;  2. ``ringpack.attention``;  3. ``ringpack.data``;  4. ``ringpack.training``;
5. ``ringpack.integrations``;  6. ``ringpack.analysis``;
7. the command line (``ringpack.cli``, ``ringpack.__main__``) and the package root ``ringpack``,
   whose lazy name table reaches every layer.

A function-local import is only for an optional or heavy third-party package (:data:`LAZY`), which
a module imports where it is used so that ``import ringpack`` and the planner stay quick (torch
in the torch-free modules, torch's optional parts elsewhere), and never for one the module already
imports at the top.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ringpack"

#: Package prefix -> layer (longest prefix wins); a module of ``ringpack/*.py`` not named here is layer 0.
LAYERS = {
    "ringpack.planner": 1,
    "ringpack.attention": 2,
    "ringpack.data": 3,
    "ringpack.training": 4,
    "ringpack.integrations": 5,
    "ringpack.analysis": 6,
    "ringpack.calibration": 6,
    "ringpack.cli": 7,
    "ringpack.__main__": 7,
}
TOP = 7
#: Third-party packages a function may import where it uses them: optional extras, or heavy to import.
LAZY = {
    "accelerate",
    "datasets",
    "flash_attn",
    "huggingface_hub",
    "matplotlib",
    "ortools",
    "pandas",
    "pyarrow",
    "ray",
    "tokenizers",
    "tomli",
    "tomllib",
    "torch",
    "tqdm",
    "transformers",
    "triton",
    "yaml",
}
#: (importer, imported) pairs allowed to break the rules. The transformers registration hook imports
#: ringpack's transformers integration only once transformers itself loads: that module needs the
#: optional package, so it is imported as one.
#: ``ringpack.planner.wlb`` is the old path of a peer system that moved up to analysis, kept for one
#: release with a DeprecationWarning.
KNOWN: set[tuple[str, str]] = {
    ("ringpack.integrations.autoregister", "ringpack.integrations.transformers"),
    ("ringpack.planner.wlb", "ringpack.analysis.peers.wlb"),
}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # the module imported (a ringpack submodule named in ``from pkg import sub`` included)
    line: int
    local: bool  # inside a function
    typing: bool = False  # under ``if TYPE_CHECKING:``: for type checkers, never run


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    if module == "ringpack":
        return TOP
    best = max(
        (prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")), key=len, default=None
    )
    return LAYERS[best] if best else 0


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = importer.split(".") if MODULES[importer].name == "__init__.py" else importer.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str) -> list[Import]:
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found: list[Import] = []

    def visit(node: ast.AST, local: bool, typing: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            hint = typing or (isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"))
            if isinstance(child, ast.Import):
                found.extend(Import(module, alias.name, child.lineno, inner, hint) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(module, child)
                subs = [f"{base}.{alias.name}" for alias in child.names if f"{base}.{alias.name}" in MODULES]
                found.extend(Import(module, target, child.lineno, inner, hint) for target in subs or [base])
            visit(child, inner, hint)

    visit(tree, False, False)
    return found


ALL = [imp for module in MODULES for imp in imports_of(module)]
OWN = [imp for imp in ALL if imp.target == "ringpack" or imp.target.startswith("ringpack.")]


def _where(imp: Import) -> str:
    return f"{MODULES[imp.importer].relative_to(ROOT)}:{imp.line} imports {imp.target}"


def test_the_parser_sees_the_imports_it_must_judge():
    """The checks below can fail: the parse finds imports of every kind and places modules in layers."""
    assert len(MODULES) > 60 and "ringpack.data.sampler" in MODULES
    assert layer("ringpack.shard_plan") == 0 and layer("ringpack.planner.split.balanced") == 1
    assert layer("ringpack.calibration.step") == 6 and layer("ringpack.cli.plan") == TOP
    assert layer("ringpack.integrations") == 5 and layer("ringpack.training.cost_learner") == 4
    sampler = {(imp.target, imp.local) for imp in imports_of("ringpack.data.sampler")}
    assert ("ringpack.shard_plan", False) in sampler and ("ringpack.mesh", False) in sampler
    solver = {(imp.target, imp.local) for imp in imports_of("ringpack.planner.solver")}
    assert ("ortools.sat.python", True) in solver  # `from ortools.sat.python import cp_model`, in a function
    root = {(imp.target, imp.typing) for imp in imports_of("ringpack")}
    assert ("ringpack.training.cost_learner", True) in root  # under `if TYPE_CHECKING:`
    demo = {imp.target for imp in imports_of("ringpack.analysis.demo")}
    assert "ringpack.analysis.plots" in demo  # `from ringpack.analysis import plots`: the submodule


def test_no_layer_imports_a_higher_one():
    upward = [
        f"{_where(imp)} (layer {layer(imp.importer)} -> {layer(imp.target)})"
        for imp in OWN
        if layer(imp.target) > layer(imp.importer) and (imp.importer, imp.target) not in KNOWN
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_ringpack_modules_are_imported_at_the_top():
    local = [_where(imp) for imp in OWN if imp.local and (imp.importer, imp.target) not in KNOWN]
    assert not local, "function-local imports of ringpack modules (import them at the top):\n" + "\n".join(local)


def test_functions_import_only_optional_or_heavy_packages():
    at_top = {(imp.importer, imp.target) for imp in ALL if not imp.local and not imp.typing}
    bad = [
        _where(imp) + (" (imported at the top already)" if (imp.importer, imp.target) in at_top else "")
        for imp in ALL
        if imp.local
        and not imp.target.startswith("ringpack")
        and (imp.target.split(".")[0] not in LAZY or (imp.importer, imp.target) in at_top)
    ]
    assert not bad, "function-local imports of packages that belong at the top:\n" + "\n".join(bad)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def _graph(imports: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if imp.target in MODULES and imp.target != imp.importer and (imp.importer, imp.target) not in KNOWN:
            edges.setdefault(imp.importer, set()).add(imp.target)
    return edges


def test_modules_import_each_other_in_no_circle():
    circles = _cycles(_graph(OWN))
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize(
    "edges, circles",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"c"}}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_the_circle_finder_finds_circles(edges, circles):
    assert sorted(_cycles(edges)) == circles
