"""The code's shape, read from the source with `ast` (nothing is imported): no import cycle among
the modules of src/kvflow (lazy imports inside functions count), `kernels` imports nothing above
it, no file over 500 lines (the C source excepted), no function over 60 lines, no dated history
in comments or docstrings; and the tests import helpers from `support`, never each other, with
no sys.path edits."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TESTS = ROOT / "tests"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "kvflow").rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The kvflow modules `name` imports anywhere in its body (a package import counts as its
    __init__; `from package import module` as the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _edges_without_own_packages() -> dict[str, set[str]]:
    """Importing `a.b.c` runs `a` and `a.b` first, so a module's imports of the packages that
    contain it are not edges of a cycle (they run before it anyway)."""
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in GRAPH.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_sees_lazy_imports() -> None:
    """The graph is real: `fused_ops`'s lazy import of the Triton ops (inside a function) is an
    edge, and so is a relative import."""
    assert "kvflow.kernels.triton.ops" in GRAPH["kvflow.kernels.select"]
    assert "kvflow.engine.llm" in GRAPH["kvflow"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_modules() -> None:
    assert _cycles(_edges_without_own_packages()) == []


def test_no_two_top_level_packages_import_each_other() -> None:
    """`kvflow.x.*` importing `kvflow.y.*` and back is a cycle once packages run their
    __init__ (importing a submodule runs its package first)."""
    top = {}
    for m, ts in _edges_without_own_packages().items():
        for t in ts:
            a, b = ".".join(m.split(".")[:2]), ".".join(t.split(".")[:2])
            if a != b:
                top.setdefault(a, set()).add(b)
    assert (
        _cycles({p: top.get(p, set()) for p in {*top, *(t for ts in top.values() for t in ts)}})
        == []
    )


def test_kernels_import_nothing_above_them() -> None:
    for name, targets in GRAPH.items():
        if name.startswith("kvflow.kernels"):
            above = {t for t in targets if not t.startswith("kvflow.kernels")} - {"kvflow.paths"}
            assert not above, (name, above)


def test_paths_is_a_standard_library_leaf() -> None:
    assert GRAPH["kvflow.paths"] == set()
    tree = ast.parse(MODULES["kvflow.paths"].read_text())
    imported = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    imported |= {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
    }
    assert imported <= {
        "__future__",
        "contextlib",
        "fcntl",
        "os",
        "shutil",
        "collections",
        "pathlib",
    }


def test_no_python_file_over_500_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert long == {}


def test_no_function_over_60_lines() -> None:
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {length}")
    assert long == []


DATED = re.compile(r"\b20[2-3][0-9]-[01][0-9](-[0-3][0-9])?\b|\ba first version\b", re.IGNORECASE)


def _comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def test_no_dated_history_in_comments() -> None:
    assert DATED.search("# measured 2026-11-30 21:35") and DATED.search("A first version ...")
    dated = []
    for path in MODULES.values():
        for line, text in _comments_and_docstrings(path.read_text()):
            if DATED.search(text):
                dated.append(f"{path.relative_to(ROOT)}:{line}")
    c_source = (SRC / "kvflow" / "kernels" / "cpu" / "csrc" / "cpu_kernels.c").read_text()
    dated += [
        f"cpu_kernels.c:{i}" for i, ln in enumerate(c_source.splitlines(), 1) if DATED.search(ln)
    ]
    assert dated == []


def test_tests_import_helpers_from_support_not_each_other() -> None:
    test_modules = {p.stem for p in TESTS.rglob("test_*.py")} | {"conftest"}
    for path in TESTS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in test_modules, (path, name)
            if isinstance(node, ast.Attribute) and node.attr in ("insert", "append"):
                target = node.value
                is_sys_path = (
                    isinstance(target, ast.Attribute)
                    and target.attr == "path"
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "sys"
                )
                assert not is_sys_path, f"{path}: sys.path edit"
