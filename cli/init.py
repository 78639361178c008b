"""`postrain init [FOLDER]`: scaffold an environment package that `postrain up` runs at once.

    postrain init my_env          # my_env/: the package my_env, run.toml, a test, pyproject.toml
    cd my_env && postrain up --config run.toml

Writes (cli/init_templates.py holds the text):

    FOLDER/PACKAGE/__init__.py    the package; PACKAGE is FOLDER's name as an identifier (--name)
    FOLDER/PACKAGE/env.py         a word-reversal Environment with a Python tool, its TaskSpec
                                  (training stream, held-out set, demonstrations)
    FOLDER/run.toml               a complete run config naming `PACKAGE.env:TASK`: sandbox,
                                  generator, learner, environment, orchestrator; a tiny model
    FOLDER/tests/test_env.py      the environment played by a script (pytest)
    FOLDER/pyproject.toml         `pip install -e 'FOLDER[test]'`: pytest, and PACKAGE importable anywhere
    FOLDER/README.md              the commands to run

Invariant: nothing is overwritten. A file that exists, a package name that is not a Python
identifier or that already names an importable module (it would shadow it, or be shadowed) is
refused in one line before anything is written. run.toml finds the package because a config's
own folder is on the import path of the head and every actor (actors/configs/run_config.py).
"""
from __future__ import annotations

import importlib.util
import keyword
import re
import shlex
from pathlib import Path

from postrain.core.errors import PostrainError

from .init_templates import FILES

HELP = "scaffold an environment package (module, run config, test, pyproject) that `postrain up` runs as written"
DESCRIPTION = """Scaffold an environment package that `postrain up` runs as written.

examples:
  postrain init my_env                  my_env/: package my_env, run.toml, tests/, pyproject.toml
  postrain init . --name reverse_words  into the current folder, package reverse_words

then, from FOLDER:
  pip install -e '.[test]'              pytest (the test extra), and PACKAGE importable from anywhere
  python -m pytest tests                the environment, played by a script
  postrain up --config run.toml         the run (runs/PACKAGE); --dry-run checks it first

Nothing is overwritten. More: docs/environments.md#start-from-postrain-init."""


class InitError(PostrainError, ValueError):
    """`postrain init` cannot write the scaffold: the message names what and how to fix it."""


def add_arguments(parser) -> None:
    parser.add_argument("folder", nargs="?", default=".",
                        help="the project folder to create or fill (default: the current folder)")
    parser.add_argument("--name", help="the package's import name (default: FOLDER's name, as an identifier)")


def package_name(folder: Path, name: str | None) -> str:
    """The package's import name: `name`, else the folder's name with every run of characters
    that cannot be in an identifier made `_`, lowercased. InitError when it is no identifier."""
    if name is None:
        name = re.sub(r"\W+", "_", folder.resolve().name).strip("_").lower()
        where = f"the folder name {folder.resolve().name!r} gives {name!r}, which"
        fix = "pass --name NAME"
    else:
        where, fix = f"--name {name!r}", "choose a name of letters, digits and _, not starting with a digit"
    if not name.isidentifier() or keyword.iskeyword(name):
        raise InitError(f"{where} is not a Python package name; fix: {fix}")
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin is not None:   # a namespace package (origin None) is a folder
        raise InitError(f"package name {name!r} is already an importable module ({spec.origin}); fix: pass "
                        "--name with another name")
    return name


def scaffold(folder: str | Path, name: str | None = None) -> list[Path]:
    """Write the scaffold into `folder` (created if missing); the written paths, in order.
    InitError, before anything is written, when a file exists or the name is unusable."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InitError(f"{folder} is a file, not a folder; fix: give a new folder's name")
    package = package_name(folder, name)
    values = {"package": package, "dist_name": package.replace("_", "-"), "run_name": package}
    files = {folder / scaffold_path(path, values): template.substitute(values) for path, template in FILES.items()}
    existing = [str(path) for path in files if path.exists()]
    if existing:
        raise InitError(f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; nothing was "
                        "written; fix: give a new folder (postrain init NEW_FOLDER) or move them away")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(files)


def scaffold_path(path: str, values: dict[str, str]) -> str:
    """A template's relative path with the package's name in it."""
    return path.replace("$package", values["package"])


def main(args) -> int:
    try:
        written = scaffold(args.folder, args.name)
    except (InitError, OSError) as exc:
        message = str(exc) if isinstance(exc, InitError) else f"cannot write into {args.folder}: {exc.strerror}"
        raise SystemExit(f"postrain init: {message}") from None
    folder = Path(args.folder)
    package = written[0].parent.name
    print(f"postrain init: wrote the environment package {package!r} into {folder}:")
    for path in written:
        print(f"  {path}")
    enter = "" if folder.resolve() == Path.cwd() else f"cd {shlex.quote(str(folder))}\n  "
    print(f"next:\n  {enter}pip install -e '.[test]'\n  python -m pytest tests\n"
          "  postrain up --config run.toml --dry-run\n"
          f"  postrain up --config run.toml\n  postrain samples runs/{package} --worst\n"
          f"  postrain report runs/{package}")
    return 0
