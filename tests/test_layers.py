"""The packages' import graph points one way (DESIGN.md, Layout):

    ext, sandbox        leaf libraries: import nothing of ours but postrain.core.errors (the one error root)
    core                the kernel: imports nothing of ours above it, and names no role
    actors              the roles: core, ext, sandbox
    cli, bench          the application layer and the bench: anything

Checked on the source: every `import`/`from` statement (at any depth: function-level imports
count) and every string that spells a postrain module path (a run-time string import counts too).
"""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "core": {"core"},
    "ext": {"ext", "core.errors"},
    "sandbox": {"sandbox", "core.errors"},
    "actors": {"actors", "core", "ext", "sandbox"},
    "cli": {"cli", "core", "ext", "sandbox", "actors", "bench"},
    "bench": {"bench", "core", "ext", "sandbox", "actors", "cli"},
}
MODULE_PATH = re.compile(r"postrain\.((?:core|actors|cli|bench|ext|sandbox)\b(?:\.\w+)?)")
ROLE_WORDS = re.compile(r"\b(sandbox|orchestrator|(?<!async )generator|learner|rollout|reward|ledger|environment)s?\b",
                        re.IGNORECASE)


def docstring_ids(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def targets(path: Path, package: str) -> set[str]:
    """The postrain packages (and `core.errors`) that `path` imports or names in a string
    (docstrings aside)."""
    tree = ast.parse(path.read_text())
    docstrings = docstring_ids(tree)
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside its own package
                names = [package]
            elif node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names = ["postrain." + m for m in MODULE_PATH.findall(node.value)]
        for name in names:
            parts = name.split(".")
            if parts[0] == "postrain" and len(parts) > 1:
                found.add("core.errors" if parts[1:3] == ["core", "errors"] else parts[1])
            elif name == package:
                found.add(package)
    return found


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package):
    wrong = {}
    for path in sources(package):
        allowed = ALLOWED[package]
        bad = {t for t in targets(path, package) if t not in allowed and not (t == "core.errors" and "core" in allowed)}
        if bad:
            wrong[str(path.relative_to(ROOT))] = sorted(bad)
    assert not wrong, f"imports that point up or sideways: {wrong}"


def test_the_kernel_names_no_role_in_its_code():
    """Identifiers and strings of core/ (docstrings and comments aside) mention no role."""
    named = {}
    for path in sources("core"):
        tree = ast.parse(path.read_text())
        docstrings = docstring_ids(tree)
        for node in ast.walk(tree):
            text = None
            if isinstance(node, ast.Name):
                text = node.id
            elif isinstance(node, ast.Attribute):
                text = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                text = node.value
            if text and ROLE_WORDS.search(text.replace("_", " ")):
                named.setdefault(str(path.relative_to(ROOT)), set()).add(text[:60])
    assert not named, f"role names in the kernel: {named}"
