"""Actor options: every actor class declares its options as one validated model.

    from pydantic import Field
    from postrain.core import Actor, Options

    class GreeterOptions(Options):
        greeting: str = Field("hello", description="what `greet` replies")
        num_repeats: int = Field(1, ge=1, description="how many times it says it")

    class Greeter(Actor):
        Options = GreeterOptions           # self.options is a GreeterOptions

Design note. Options are checked twice with the same model, so both checks say the same:
- in the head, when a config loads (`resolve_options`, core/run_options.py; run by `postrain
  up`, `--dry-run` too): every actor's class is imported from its spec's import path (data;
  the kernel knows no class by name), the `[shared]` settings are filled in, and every bad
  field of every actor is reported at once as `actors.N(name).options.FIELD = VALUE: RULE`,
  before any process starts;
- in the actor process before `setup` (`validate_options`), so an actor started without
  that check (a test, a hand-made spec) still refuses a misspelt option.

`[shared]` holds the settings that several actors must agree on (a model, a task, a seed):
each actor whose Options declare a field of that name takes the shared value, an actor may
not set that field again itself, and a shared setting that no actor declares is an error.
"""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import ConfigError


class Options(BaseModel):
    """Base of every actor's options: unknown fields are errors, and options never change
    after validation (`frozen`), so every handler sees the values the run started with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Fields a run config's `[shared]` does not fill in for this actor, though it declares them:
    #: an actor whose `model` is its own (a teacher beside the policy) names "model" here.
    not_shared: ClassVar[frozenset[str]] = frozenset()


class NoOptions(Options):
    """The options of an actor that declares none: any option given is an error."""


def options_class(cls: type) -> type[Options]:
    """The Options model of actor class `cls` (NoOptions where it declares none)."""
    return getattr(cls, "Options", NoOptions)


def validate_options(cls: type, options: dict[str, Any], where: str = "options") -> Options:
    """`options` validated against `cls`'s model; ConfigError naming each bad field otherwise."""
    from .config import validation_lines
    try:
        return options_class(cls).model_validate(options)
    except ValidationError as exc:
        lines = validation_lines(exc, prefix=f"{where}.")
        raise ConfigError(f"{len(lines)} bad option(s) of {cls.__name__}:\n  " + "\n  ".join(lines)) from None
