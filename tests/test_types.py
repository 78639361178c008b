"""The type checker: mypy passes, strict, on the modules pyproject.toml's [tool.mypy] overrides
name (the records and message kinds between roles and the kernel, and the learner's parts that
carry no torch typing); docs/architecture.md, "Layering rules".

mypy reads the packages as they are installed (postrain.core, postrain.actors, ...), while the
repository maps them from top-level folders (pyproject.toml, package-dir): the check runs on a
tree of links named as the packages are."""
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "actors", "cli", "ext", "sandbox", "bench")


def strict_targets() -> list[str]:
    """mypy's -m / -p arguments for every module the strict override names."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    modules = [m for override in config["overrides"] if override.get("strict") for m in override["module"]]
    args = []
    for module in modules:
        args += ["-p", module.removesuffix(".*")] if module.endswith(".*") else ["-m", module]
    return args


def run_mypy(tree: Path, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(tree / ".mypy_cache"), *args],
                          cwd=tree, capture_output=True, text=True)


def linked_tree(tmp_path: Path) -> Path:
    (tmp_path / "postrain").mkdir()
    for package in PACKAGES:
        (tmp_path / "postrain" / package).symlink_to(ROOT / package, target_is_directory=True)
    return tmp_path


def test_mypy_is_clean_and_strict_on_the_declared_modules(tmp_path):
    targets = strict_targets()
    assert "postrain.actors.records" in targets and "postrain.core" in targets   # the kernel, its messages too
    result = run_mypy(linked_tree(tmp_path), targets)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_the_check_fails_on_a_type_error(tmp_path):
    (tmp_path / "typo.py").write_text("def count(x: int) -> int:\n    return x + 'one'\n")
    result = run_mypy(tmp_path, ["--strict", "typo.py"])
    assert result.returncode == 1 and 'Unsupported operand types for + ("int" and "str")' in result.stdout
