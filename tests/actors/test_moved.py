"""Old module paths of postrain.actors still import for one release, as the same module, with one
warning naming the new path (actors/_moved.py)."""
import subprocess
import sys

import pytest

from postrain.actors._moved import MOVED_MODULES


def test_an_old_path_imports_the_new_module_and_warns_once_with_its_name():
    script = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from postrain.actors.generator_actor import GeneratorActor as old
    import postrain.actors.generator_actor
from postrain.actors.generator import GeneratorActor
import postrain.actors.generator.actor as new
assert old is GeneratorActor and postrain.actors.generator_actor is new
assert new.__spec__.name == "postrain.actors.generator.actor", new.__spec__.name
messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
assert len(messages) == 1 and "moved to postrain.actors.generator.actor" in messages[0], messages
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_config_naming_an_old_class_path_still_loads_its_actor():
    from postrain.core import import_object
    with pytest.warns(FutureWarning, match="postrain.actors.learner.actor"):
        cls = import_object("postrain.actors.learner_actor:LearnerActor")
    from postrain.actors.learner import LearnerActor
    assert cls is LearnerActor


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_every_old_path_names_a_module_that_exists(old):
    import importlib
    assert importlib.import_module(f"postrain.actors.{MOVED_MODULES[old]}")
