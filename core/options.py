"""Actor options: every actor class declares its options as one validated model.

    from pydantic import Field
    from postrain.core import Actor, Options

    class GreeterOptions(Options):
        greeting: str = Field("hello", description="what `greet` replies")
        num_repeats: int = Field(1, ge=1, description="how many times it says it")

    class Greeter(Actor):
        Options = GreeterOptions           # self.options is a GreeterOptions

Design note. Options are checked twice with the same model, so both checks say the same:
- in the head, when a config loads (`resolve_options`, run by `postrain up`, `--dry-run` too):
  every actor's class is imported from its spec's import path (data; the kernel knows no
  class by name), the `[shared]` settings are filled in, and every bad field of every actor
  is reported at once as `actors.N(name).options.FIELD = VALUE: RULE`, before any process
  starts;
- in the actor process before `setup` (`validate_options`), so an actor started without
  that check (a test, a hand-made spec) still refuses a misspelt option.

`[shared]` holds the settings that several actors must agree on (a model, a task, a seed):
each actor whose Options declare a field of that name takes the shared value, an actor may
not set that field again itself, and a shared setting that no actor declares is an error.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import ConfigError


class Options(BaseModel):
    """Base of every actor's options: unknown fields are errors, and options never change
    after validation (`frozen`), so every handler sees the values the run started with."""

    model_config = ConfigDict(extra="forbid", frozen=True)


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


def resolve_options(config) -> None:
    """Check every actor's options of `config` (a RunConfig) with `[shared]` filled in, and
    store the merged options on each spec (what its process receives). Raises one ConfigError
    listing every bad field of every actor; imports each actor's class to read its model."""
    from .actor import import_actor_class
    problems: list[str] = []
    used_shared: set[str] = set()
    for index, spec in enumerate(config.actors):
        where = f"actors.{index}({spec.name}).options"
        try:
            cls = import_actor_class(spec.cls)
        except (ImportError, TypeError) as exc:
            problems.append(f"actors.{index}({spec.name}).cls = {spec.cls!r}: {exc}")
            continue
        fields = options_class(cls).model_fields
        shared = {key: value for key, value in config.shared.items() if key in fields}
        used_shared.update(shared)
        for key in sorted(set(shared) & set(spec.options)):
            problems.append(f"{where}.{key}: also set in [shared]; state it once (remove one of them)")
        merged = {**shared, **spec.options}
        try:
            validated = validate_options(cls, merged, where)
        except ConfigError as exc:
            problems += [line.strip() for line in str(exc).splitlines()[1:]]
            continue
        merged.update(_replica_references(config, spec.name, validated, where, problems))
        spec.options = merged
    for key in sorted(set(config.shared) - used_shared):
        problems.append(f"shared.{key} = {config.shared[key]!r}: no actor declares an option of that name "
                        "(check the spelling; see the config reference in the docs)")
    if problems:
        raise ConfigError(f"{len(problems)} bad option(s):\n  " + "\n  ".join(problems))


def _replica_references(config, name: str, validated: Options, where: str, problems: list[str]) -> dict:
    """The options of actor `name` (given or default) that name an entry with replicas, rewritten
    to the replicas' names: a list holding the entry's name gets all its replicas in its place;
    a single name gets the replica of the same index when `name` is a replica of an entry with
    as many replicas, else a line is added to `problems`. Options naming nothing replicated
    are left out of the result."""
    groups = config.replica_groups()
    if not groups:
        return {}
    mine = config.replica_of(name)
    rewritten = {}
    for field in type(validated).model_fields:
        value = getattr(validated, field)
        if isinstance(value, list) and any(isinstance(v, str) and v in groups for v in value):
            rewritten[field] = [r for v in value for r in (groups[v] if isinstance(v, str) and v in groups else [v])]
        elif isinstance(value, str) and value in groups:
            replicas = groups[value]
            if mine is not None and mine[2] == len(replicas):
                rewritten[field] = replicas[mine[1]]
            else:
                problems.append(f"{where}.{field} = {value!r}: names an entry with {len(replicas)} replicas "
                                f"({replicas[0]} .. {replicas[-1]}) where one actor is meant; name one replica, "
                                f"or give this actor's entry replicas = {len(replicas)} too (replica i then "
                                "pairs with replica i)")
    return rewritten
