"""The import rules of docs/architecture.md ("Packages"), checked by parsing every module."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> top-level modules it must never import
FORBIDDEN = {
    "server": {"mlx", "mlx_lm", "kvarn", "apc", "metal"},
    "engine": {"server", "e2e"},
    "kvarn": {"server", "engine", "apc", "e2e"},
    "apc": {"server", "engine", "kvarn", "metal", "e2e"},
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
