"""The type checker: mypy passes on the whole tree with pyproject.toml's [tool.mypy] settings, and
strictly on the modules its override names (the kernel, the records and message kinds between
roles, and the learner's parts that carry no torch typing); docs/architecture.md, "Layering rules".

mypy reads the packages as they are installed (postrain.core, postrain.actors, ...), while the
repository maps them from top-level folders (pyproject.toml, package-dir): the check runs on a
tree of links named as the packages are."""
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "actors", "cli", "ext", "sandbox", "bench")
STRICT_FLAGS = ("disallow_untyped_defs", "disallow_any_generics", "warn_return_any", "strict_equality")


def run_mypy(tree: Path, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(tree / ".mypy_cache"), *args],
                          cwd=tree, capture_output=True, text=True)


def linked_tree(tmp_path: Path) -> Path:
    (tmp_path / "postrain").mkdir()
    for package in PACKAGES:
        (tmp_path / "postrain" / package).symlink_to(ROOT / package, target_is_directory=True)
    return tmp_path


def test_the_kernel_and_the_records_are_checked_strictly():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    [strict] = [override for override in config["overrides"] if override.get("disallow_untyped_defs")]
    assert {"postrain.core.*", "postrain.actors.records.*"} <= set(strict["module"])
    assert all(strict.get(flag) for flag in STRICT_FLAGS) and "strict" not in strict, \
        "strict = true in an override turns strict on for every module (mypy 2.4): name the flags"


def test_mypy_is_clean_on_the_whole_tree(tmp_path):
    result = run_mypy(linked_tree(tmp_path), [arg for package in PACKAGES for arg in ("-p", f"postrain.{package}")])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_the_check_fails_on_a_type_error(tmp_path):
    (tmp_path / "typo.py").write_text("def count(x: int) -> int:\n    return x + 'one'\n")
    result = run_mypy(tmp_path, ["--strict", "typo.py"])
    assert result.returncode == 1 and 'Unsupported operand types for + ("int" and "str")' in result.stdout
