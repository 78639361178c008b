"""The packages' import graph points one way (docs/architecture.md, "Layering rules"), and has no cycles:

    ext, sandbox        leaf libraries: import nothing of ours but postrain.core.errors (the one error root)
    core                the kernel: imports nothing of ours above it, and names no role
    actors              the roles: core, ext, sandbox
    bench               the bench: core, ext, sandbox, actors
    cli                 the application layer: anything, the bench included

Checked on the source: every `import`/`from` statement (at any depth: function-level imports
count) and every string that spells a postrain module path (a run-time string import counts too).
So the bench never names `postrain.cli`, not even in a string: where it runs the `postrain`
command (a whole `postrain up`) as a child process, it takes the command from the installed
package's console-script entry point (`postrain.bench.postrain_command`), which is a command
line, not an import; no exception table is needed.

No cycles: across all six packages, module A importing B (directly or through others) while B
imports A is an error, whatever the depth of either import (a function-level import, or one
under `if TYPE_CHECKING:`, still ties the two modules together: move what both need below
both instead). Relative imports are resolved; an import names the module it loads (`from P
import name` loads the submodule P.name where there is one, else P itself, so a package's
__init__ importing a submodule that imports from the package's __init__ is a cycle). Compiled
modules (.pyx) are in the graph with their Python-level imports.
"""
import ast
import re
from collections import deque
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "core": {"core"},
    "ext": {"ext", "core.errors"},
    "sandbox": {"sandbox", "core.errors"},
    "actors": {"actors", "core", "ext", "sandbox"},
    "cli": {"cli", "core", "ext", "sandbox", "actors", "bench"},
    "bench": {"bench", "core", "ext", "sandbox", "actors"},
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


# ------------------------------------------------------------------------------- cycles
def module_name(path: Path) -> str:
    """postrain.PACKAGE.MODULE of a source file (a package's __init__.py: the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "postrain." + ".".join(parts)


PYX_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\b|import\s+([\w.]+))", re.MULTILINE)


def imported_names(path: Path) -> list[tuple[int, str | None, list[str]]]:
    """(level, module, names) of every import statement of a source file; for `import a.b`:
    (0, None, ["a.b"]). A compiled module (.pyx) is read for its Python imports (`cimport`s
    are C declarations, not imports)."""
    if path.suffix == ".pyx":
        return [(0, None, [plain]) if plain else (0, source, [])
                for source, plain in PYX_IMPORT.findall(path.read_text())]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.append((0, None, [alias.name for alias in node.names]))
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module, [alias.name for alias in node.names]))
    return found


@cache
def import_graph() -> dict[str, set[str]]:
    """Each of our modules -> the modules of ours its import statements load (itself left out)."""
    files = {module_name(path): path for package in ALLOWED
             for path in sources(package) + sorted((ROOT / package).rglob("*.pyx"))}

    def ours(name: str) -> str | None:     # the longest prefix of `name` that is one of our modules
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        loaded = set()
        for level, source, names in imported_names(path):
            if source is None and not level:               # import a.b.c
                loaded.update(ours(name) for name in names)
                continue
            base = source or ""
            if level:                                       # relative: from its package, up level - 1
                anchor = package.split(".")[:len(package.split(".")) - (level - 1)]
                base = ".".join(anchor + ([source] if source else []))
            loaded.update(ours(f"{base}.{name}") if f"{base}.{name}" in files else ours(base)
                          for name in names or [""])
        graph[module] = {target for target in loaded if target and target != module}
    return graph


@cache
def import_cycles() -> list[tuple[list[str], list[str]]]:
    """The strongly connected components of more than one module (Tarjan), each as (a shortest
    cycle through its first module: [a, b, ..., a], all its modules)."""
    graph = import_graph()
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(component)

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return [(shortest_cycle(graph, component), sorted(component)) for component in components]


def shortest_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest import cycle through the component's first module, by breadth-first search."""
    start = min(component)
    came_from = {start: None}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for target in sorted(graph[module] & component):
            if target == start:
                path = [module]                         # back from `module` to `start`
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                return path[::-1] + [start]
            if target not in came_from:
                came_from[target] = module
                queue.append(target)
    raise AssertionError(f"no cycle through {start} in its component {sorted(component)}")


def test_the_import_graph_sees_relative_function_level_and_compiled_imports():
    graph = import_graph()
    assert "postrain.core.errors" in graph["postrain.core.config"]           # from .errors import ...
    assert "postrain.ext.cupy_ops" in graph["postrain.ext.advantages"]       # from . import cupy_ops
    assert "postrain.core.supervisor" in graph["postrain.core.ray_nodes"]    # a function-level import
    assert "postrain.ext._kvpool" in graph["postrain.ext.kvpool"]            # a compiled module
    assert graph["postrain.ext._kvpool"] == {"postrain.ext._kvpool_common"}  # ... and its imports


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_cycles(package):
    """No module of `package` is on an import cycle (see the module docstring)."""
    cycles = [(cycle, members) for cycle, members in import_cycles()
              if any(module.split(".")[1] == package for module in members)]
    assert not cycles, "import cycles:\n" + "\n".join(
        " -> ".join(cycle) + (f" (one of the cycles among {', '.join(members)})" if len(members) > 2 else "")
        for cycle, members in cycles)


# ------------------------------------------------------------------------------- parts, not lines
# The underscore names of other libraries' documented APIs that code may use.
FOREIGN_UNDERSCORE_API = {
    "_exit",                                        # os._exit: a forked child's exit
    "_replace", "_asdict", "_fields", "_make",      # collections.namedtuple's API
    "_version",                                     # torch.Tensor._version: in-place write counter
    "_shutdown", "_run_exitfuncs",                  # threading / atexit, run by a forked child
}


def own_names(tree: ast.AST) -> set[str]:
    """The underscore names a module defines itself: its functions and classes, attributes it
    assigns (on `self` or any object) and class-level fields."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute):
                        own.add(leaf.attr)
                    elif isinstance(leaf, ast.Name):
                        own.add(leaf.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
    return own


def private_reaches(path: Path) -> list[str]:
    """`obj._name` where `_name` belongs to another module (not `self`, `cls` or super(), not a
    name this module defines), and `from M import _name` of a name that is not a module, from a
    module that is not private (a `_module` is its package's implementation room, shared by the
    package's modules: ext/_kvpool_common.py)."""
    tree = ast.parse(path.read_text())
    own = own_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if (isinstance(base, ast.Name) and base.id in ("self", "cls")) or node.attr in own | FOREIGN_UNDERSCORE_API:
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for alias in node.names:
                if (alias.name.startswith("_") and not alias.name.startswith("__") and not is_module(path, node, alias.name)
                        and not (node.module or "").split(".")[-1].startswith("_")):   # a private module: its package's room
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import {alias.name}")
    return found


def is_module(path: Path, node: ast.ImportFrom, name: str) -> bool:
    """True when `from ... import name` names a module (a private module is its package's own)."""
    folder = path.parent
    for _ in range(max(node.level - 1, 0)):
        folder = folder.parent
    if node.level == 0:
        parts = (node.module or "").split(".")
        if parts[0] != "postrain":
            return False
        folder = ROOT / PACKAGE_DIRS.get(parts[1], parts[1]) if len(parts) > 1 else ROOT
        parts = parts[2:]
    else:
        parts = (node.module or "").split(".") if node.module else []
    base = folder.joinpath(*parts)
    return any((base / f"{name}{suffix}").exists() for suffix in (".py", ".pyx")) or (base / name).is_dir()


PACKAGE_DIRS = {package: package for package in ALLOWED}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_module_reaches_into_another_modules_private_names(package):
    """One object lives in one module (docs/architecture.md,
    "Layering rules"): a function that takes another module's object and reads its `_private`
    members is that object spread over two files. Give the object a public method or property."""
    reaches = [reach for path in sources(package) for reach in private_reaches(path)]
    assert not reaches, "reaches into another module's private names:\n" + "\n".join(reaches)


def test_the_private_reach_check_finds_a_reach_and_allows_a_modules_own(tmp_path):
    own = tmp_path / "own.py"
    own.write_text("class A:\n    def __init__(self):\n        self._x = 1\n\ndef peek(a):\n    return a._x\n")
    other = tmp_path / "other.py"
    other.write_text("from own import _helper\n\ndef peek(learner):\n    return learner._logprobs, self._fine\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert private_reaches(own) == []
        assert private_reaches(other) == ["other.py:1 from own import _helper", "other.py:4 learner._logprobs"]
    finally:
        ROOT = saved


# ------------------------------------------------------------------------------- messages
def string_kinds(path: Path) -> list[str]:
    """Calls that name a message by a string: `ref.ask("kind", ...)`, `.tell`, `.stream`, and
    `@handler("kind")`. A message is named once, in its MessageKind declaration (core/messages.py),
    and called with `ref.call(KIND, record)`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name in ("ask", "tell", "stream", "ask_message", "stream_messages", "handler"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)[:80]}")
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_message_is_named_by_a_string_outside_its_declaration(package):
    named = [call for path in sources(package) for call in string_kinds(path)]
    assert not named, "messages named by a string (declare a MessageKind; call ref.call(KIND, ...)):\n" + \
        "\n".join(named)


def test_the_string_kind_check_finds_a_named_message(tmp_path):
    caller = tmp_path / "caller.py"
    caller.write_text("async def f(ref):\n    await ref.ask('generate', {})\n    await ref.call(GENERATE, request)\n"
                      "@handler('stats')\nasync def g(self, body):\n    pass\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert sorted(found.split(" ", 1)[0] for found in string_kinds(caller)) == ["caller.py:2", "caller.py:4"]
    finally:
        ROOT = saved

