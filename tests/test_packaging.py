"""The wheel holds every package: each folder with an `__init__.py` under a mapped folder is
listed in pyproject.toml's `packages` (setuptools takes that list as it is, so a package left
out would import in a checkout and be missing from an installed wheel)."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join([name, *relative]))
    assert found - listed == set(), f"packages missing from pyproject.toml's `packages`: {sorted(found - listed)}"
