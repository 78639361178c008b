"""Optional dependencies: which `pip install 'postrain[EXTRA]'` brings a module.

A command or an actor that imports a module of an extra that is not installed fails in one
line naming the extra (`missing_extra_message`), never with a traceback: `postrain`'s entry
point and the loader of import paths in configs (core/actor.py `import_object`) both ask here.
tests/core/test_extras.py checks each row against pyproject.toml's optional dependencies.
"""
from __future__ import annotations

# top-level module -> the extra of pyproject.toml that installs it
EXTRA_OF_MODULE = {
    "gguf": "gguf", "starlette": "gateway", "hypercorn": "gateway", "ray": "cluster",
    "datasets": "tasks", "pyarrow": "tasks", "math_verify": "tasks", "reasoning_gym": "tasks",
    "verifiers": "verifiers", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio",
    "tensorboard": "tensorboard", "openai": "agents", "agents": "agents", "openenv": "openenv",
    "cupy": "gpu", "mkdocs": "docs",
}


def extra_for(module_name: str | None) -> str | None:
    """The extra that installs `module_name` (a dotted name counts by its top level), or None."""
    return EXTRA_OF_MODULE.get((module_name or "").partition(".")[0])


def missing_extra_message(exc: ImportError) -> str | None:
    """One line naming the extra to install for a missing module of an extra; None for any other error."""
    extra = extra_for(getattr(exc, "name", None)) if isinstance(exc, ModuleNotFoundError) else None
    if extra is None:
        return None
    return f"needs the `{exc.name}` package, which the `{extra}` extra installs; fix: pip install 'postrain[{extra}]'"
