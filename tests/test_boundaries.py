"""The import rules of docs/architecture.md ("Packages"), checked by parsing every module."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> top-level modules it must never import
FORBIDDEN = {
    "server": {"mlx", "mlx_lm", "kvarn", "apc", "metal"},
    "engine": {"server", "e2e"},
    "kvarn": {"server", "engine", "apc", "e2e"},
    "apc": {"server", "engine", "metal", "e2e"},
    "metal": {"server", "engine", "kvarn", "apc", "e2e", "mlx_lm"},
    "e2e": {"server", "engine", "kvarn", "apc", "metal", "mlx", "mlx_lm"},
}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no modules"
    bad = {str(f.relative_to(ROOT)): sorted(imported_roots(f) & FORBIDDEN[package]) for f in files}
    assert {f: roots for f, roots in bad.items() if roots} == {}


def test_the_checker_sees_a_forbidden_edge(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("import mlx.core as mx\nfrom kvarn.layout import KVLayout\nfrom . import x\n")
    assert imported_roots(sample) == {"mlx", "kvarn"}


# ---- no run-time switches: product modules keep no A/B settings, and nobody flips another module's state ----
PRODUCT = ("server", "engine", "kvarn", "apc", "metal")
AB_SWITCHES = {"COMMIT_IN_PLACE", "RECIPROCAL_DIVISION", "NUM_SMS"}  # now a kernel argument / the device's count


def _project_aliases(tree: ast.AST) -> set[str]:
    """Names a module binds to something imported from the project's packages."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in PRODUCT)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in PRODUCT:
            names.update(a.asname or a.name for a in node.names)
    return names


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _imports_by_name(node: ast.AST) -> bool:
    """``importlib.import_module(...)`` / ``import_module(...)``: a module named at run time."""
    func = node.func if isinstance(node, ast.Call) else None
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
        (isinstance(func, ast.Name) and func.id == "import_module")


def state_writes(path: Path) -> list[str]:
    """Where a module writes state it imported from the project (``mod.NAME = ...``,
    ``mod.NAME[:] = ...``, ``setattr(mod, ...)``) or rebinds an UPPER_CASE module name inside a
    function (``global NAME``): as "line: what"."""
    tree = ast.parse(path.read_text(), str(path))
    aliases, found = _project_aliases(tree), []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, (ast.Attribute, ast.Subscript)) and _root_name(target) in aliases:
                found.append(f"{node.lineno}: {ast.unparse(target)} = ...")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and (_root_name(node.args[0]) in aliases or _imports_by_name(node.args[0])):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Global) and any(n.isupper() for n in node.names):
            found.append(f"{node.lineno}: global {', '.join(node.names)}")
    return found


def switch_names(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{n.lineno}: {n.id if isinstance(n, ast.Name) else n.attr}" for n in ast.walk(tree)
            if (isinstance(n, ast.Name) and n.id in AB_SWITCHES) or (isinstance(n, ast.Attribute) and n.attr in AB_SWITCHES)]


def empty_module_containers(path: Path) -> list[str]:
    """Module-level names bound to an empty dict, list or set: state meant to be filled at run time."""
    found = []
    for node in ast.parse(path.read_text(), str(path)).body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        empty = (isinstance(value, (ast.Dict, ast.List, ast.Set)) and not getattr(value, "keys", None)
                 and not getattr(value, "elts", None)) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and not value.args
            and value.func.id in ("dict", "list", "set", "defaultdict", "OrderedDict"))
        if empty:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("package", ["metal", "kvarn", "engine", "bench"])
def test_no_module_flips_another_modules_state(package):
    bad = {str(f.relative_to(ROOT)): state_writes(f) for f in sorted((ROOT / package).rglob("*.py"))
           if "bench/out" not in str(f)}
    assert {f: w for f, w in bad.items() if w} == {}


@pytest.mark.parametrize("package", ["metal", "kvarn", "engine"])
def test_no_ab_switches_in_product_modules(package):
    bad = {str(f.relative_to(ROOT)): switch_names(f) for f in sorted((ROOT / package).rglob("*.py"))}
    assert {f: w for f, w in bad.items() if w} == {}


def test_metal_keeps_no_run_time_state_but_the_selector_s():
    """The verdicts live in one ``metal.selector.Kernels``; other caches in metal/ are memoized
    functions (``functools``), never module containers filled at run time."""
    bad = {str(f.relative_to(ROOT)): empty_module_containers(f) for f in sorted((ROOT / "metal").rglob("*.py"))}
    assert {f: w for f, w in bad.items() if w} == {}


def test_the_state_checks_see_what_they_forbid(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("import metal\nfrom metal.cuda import commit as C\nimport numpy as np\n"
                      "metal._VERDICT[:] = ['reference']\nC.RECIPROCAL_DIVISION = 0\nsetattr(C, 'X', 1)\n"
                      "np.seterr = None\n_CACHE: dict = {}\n_SEEN = set()\nNAMES = ['a']\n"
                      "def f():\n    global LIMIT\n    LIMIT = 2\n"
                      "import importlib\nsetattr(importlib.import_module('metal.device'), 'N', 1)\n")
    assert [w.split(":")[0] for w in state_writes(sample)] == ["4", "5", "6", "12", "15"]
    assert switch_names(sample) == ["5: RECIPROCAL_DIVISION"]
    assert [w.split(":")[0] for w in empty_module_containers(sample)] == ["8", "9"]


# ---- no import circles: every import counts (deferred ones too), so none can break a circle ----
def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Project modules ``path`` imports anywhere in its body (inside functions too), except under
    ``if TYPE_CHECKING:`` (annotations only, never run). ``from pkg import name`` counts as an
    import of ``pkg.name`` where that is a module, else of ``pkg``."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING") for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            found.update(subs or {node.module})
            if len(subs) < len(node.names):
                found.add(node.module)
    return found - {module_name(path)}


def import_cycles(files: list[Path]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), as sorted names."""
    known = {module_name(f) for f in files}
    graph = {module_name(f): imports_of(f, known) for f in files}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", ["server", "engine", "kvarn", "apc", "metal", "e2e"])
def test_no_import_circles(package):
    files = [f for f in sorted((ROOT / package).rglob("*.py"))]
    assert import_cycles(files) == []


def test_the_circle_check_sees_a_deferred_circle(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import g\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_cycles(sorted(pkg.glob("*.py"))) == [["pkg.a", "pkg.b"]]


# ---- wired at construction: no object sets another object's attributes after it is made ----
WIRED = {"scheduler", "runner", "prefix", "budget", "store", "cache"}  # the engine's parts


def foreign_attribute_writes(path: Path) -> list[str]:
    """Where a module assigns an attribute of one of the engine's parts from outside it
    (``self.scheduler.cache = ...``, ``engine.runner.restore = ...``, ``engine.prefix = ...``):
    as "line: target". ``self.scheduler = ...`` inside the engine is its own attribute."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        for target in flat:
            if not isinstance(target, ast.Attribute):
                continue
            owner = target.value
            through_part = isinstance(owner, ast.Attribute) and owner.attr in WIRED
            part_of_another = target.attr in WIRED and not (isinstance(owner, ast.Name) and owner.id == "self")
            if through_part or part_of_another:
                found.append((node.lineno, f"{node.lineno}: {ast.unparse(target)}"))
    return [where for _, where in sorted(found, key=lambda f: f[0])]


@pytest.mark.parametrize("package", ["engine", "apc"])
def test_the_engine_s_parts_get_what_they_need_at_construction(package):
    """The scheduler gets the prefix cache, the runner its restore and release callbacks, as
    constructor arguments: nothing is attached to them, or swapped out, afterwards."""
    bad = {str(f.relative_to(ROOT)): foreign_attribute_writes(f) for f in sorted((ROOT / package).rglob("*.py"))}
    assert {f: w for f, w in bad.items() if w} == {}


def test_the_construction_check_sees_late_wiring(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("class E:\n    def __init__(self):\n        self.scheduler = S()\n"
                      "        self.scheduler.cache = self.prefix\n"
                      "        self.runner.restore, self.runner.release = 1, 2\n"
                      "def pause(engine):\n    engine.prefix = None\n    request.status = 1\n")
    assert foreign_attribute_writes(sample) == [
        "4: self.scheduler.cache", "5: self.runner.restore", "5: self.runner.release", "7: engine.prefix"]
