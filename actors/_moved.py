"""Old module paths of postrain.actors, kept working for one release: the one alias table.

The roles became packages in 0.3 (actors/generator/, learner/, env/, models/). A config or a
script that still names an old path, such as `postrain.actors.generator_actor:GeneratorActor`,
imports the module at its new path and warns once with the new name (FutureWarning). Remove
this table, and the finder installed by postrain.actors, in the release after.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module (under postrain.actors) -> its new path (under postrain.actors)
MOVED_MODULES: dict[str, str] = {
    "generator_actor": "generator.actor",
    "engine": "generator.engine",
    "sampling": "generator.sampling",
    "speculative": "generator.speculative",
    "model": "models.llama",
    "checkpoint": "models.loading",
    "tokenizer": "models.tokenizer",
    "learner_actor": "learner.actor",
    "learner_batch": "learner.batch",
    "learner_group": "learner.group",
    "learner_state": "learner.state",
    "shared_prefix": "learner.shared_prefix",
    "recovery": "learner.recovery",
    "environment": "env.api",
    "env_actor": "env.actor",
    "tools": "env.tools",
}
PACKAGE = "postrain.actors"


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `postrain.actors.<old>` as the module at its new path (the same module object,
    so classes and state are shared), warning once per old name."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(PACKAGE + ".")
        if fullname.startswith(PACKAGE + ".") and old in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = f"{PACKAGE}.{MOVED_MODULES[spec.name.removeprefix(PACKAGE + '.')]}"
        warnings.warn(f"{spec.name} moved to {new}; the old path works until the next release "
                      f"(fix: import {new}, or name it in the config's `cls`)", FutureWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self._real_spec   # the import system set the old name's spec on it: undo


def install() -> None:
    """Put the finder on sys.meta_path once (idempotent)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
