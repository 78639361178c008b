"""A command that needs an extra that is not installed stops in one line naming it (core/extras.py)."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from postrain.core.extras import EXTRA_OF_MODULE

ROOT = Path(__file__).resolve().parents[2]
POSTRAIN = [sys.executable, "-c", "import sys; from postrain.cli import main; sys.exit(main())"]


def test_every_module_maps_to_an_extra_that_installs_it():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, extra in EXTRA_OF_MODULE.items():
        assert extra in extras, f"{module} maps to extra {extra!r}, which pyproject.toml does not declare"
        names = " ".join(extras[extra]).lower().replace("_", "-")
        assert module.replace("_", "-") in names or module in {"agents", "mlflow", "cupy", "openenv"}, \
            f"extra {extra!r} does not list a distribution for module {module}"


def hidden(tmp_path: Path, *modules: str) -> dict:
    """An environment whose Python finds `modules` missing (a stand-in package raising
    ModuleNotFoundError, first on the path), as on a machine without their extra."""
    for module in modules:
        (tmp_path / module).mkdir()
        (tmp_path / module / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{module}'\", name={module!r})\n")
    import os
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def test_serve_without_the_gateway_extra_names_it_in_one_line(tmp_path):
    done = subprocess.run(POSTRAIN + ["serve", "--model", "tiny", "--port", "0"],
                          env=hidden(tmp_path, "starlette"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == ("postrain serve needs the `starlette` package, which the `gateway` extra "
                                   "installs; fix: pip install 'postrain[gateway]'")


def test_a_gguf_model_without_the_gguf_extra_names_it_in_one_line(tmp_path):
    from postrain.actors.models.loading import resolve_model
    gguf_file = resolve_model("smollm2")
    done = subprocess.run(POSTRAIN + ["serve", "--model", gguf_file, "--port", "0"],
                          env=hidden(tmp_path, "gguf"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().endswith("needs the `gguf` package, which the `gguf` extra installs; "
                                        "fix: pip install 'postrain[gguf]'")
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_reader_that_leaves_the_pipe_early_gets_no_traceback():
    """`postrain status | head`: the reader closes the pipe; postrain ends without a traceback."""
    import os
    read_end, write_end = os.pipe()
    os.close(read_end)   # the reader is gone before anything is written
    done = subprocess.run(POSTRAIN + ["bench", "list"], stdout=write_end, stderr=subprocess.PIPE, text=True,
                          timeout=120)
    os.close(write_end)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
