"""A run's actor options, resolved: `[shared]` filled in, replica names expanded, each actor's
options checked by its class's model (core/options.py), before any process starts.

`resolve_options(config)` is what `postrain up` (and `--dry-run`) runs on a loaded RunConfig:
every actor's class is imported from its spec's import path (data; the kernel knows no class
by name), and every bad field of every actor is reported at once as
`actors.N(name).options.FIELD = VALUE: RULE`.
"""
from __future__ import annotations

from typing import Any

from .actor import import_actor_class
from .config import RunConfig
from .errors import ConfigError
from .options import Options, options_class, validate_options


def resolve_options(config: RunConfig) -> None:
    """Check every actor's options of `config` (a RunConfig) with `[shared]` filled in, and
    store the merged options on each spec (what its process receives). Raises one ConfigError
    listing every bad field of every actor; imports each actor's class to read its model."""
    problems: list[str] = []
    used_shared: set[str] = set()
    for index, spec in enumerate(config.actors):
        where = f"actors.{index}({spec.name}).options"
        try:
            cls = import_actor_class(spec.cls)
        except (ImportError, TypeError) as exc:
            problems.append(f"actors.{index}({spec.name}).cls = {spec.cls!r}: {exc}")
            continue
        if spec.bulk_key is None:   # decided here, where the class is imported anyway (not per node)
            spec.bulk_key = bool(cls.needs_bulk_key)
        options_model = options_class(cls)
        fields = options_model.model_fields
        shared = {key: value for key, value in config.shared.items()
                  if key in fields and key not in options_model.not_shared}
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


def _replica_references(config: RunConfig, name: str, validated: Options, where: str,
                        problems: list[str]) -> dict[str, Any]:
    """The options of actor `name` (given or default) that name an entry with replicas, rewritten
    to the replicas' names: a list holding the entry's name gets all its replicas in its place;
    a single name gets the replica of the same index when `name` is a replica of an entry with
    as many replicas, else a line is added to `problems`. Options naming nothing replicated
    are left out of the result."""
    groups = config.replica_groups()
    if not groups:
        return {}
    mine = config.replica_of(name)
    rewritten: dict[str, Any] = {}
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
