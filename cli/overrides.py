"""Command-line overrides of a run config: `--set KEY=VALUE` of `postrain up` and `postrain sweep`.

    doc = tomllib.loads(path.read_text())
    key, value = parse_override("orchestrator.num_steps=3")      # ('orchestrator.num_steps', 3)
    set_path(doc, key, value)                                    # -> "option"

KEY is a dotted path into the config document:
- `SECTION.KEY` (`shared.seed`, `run.name`, `head.heartbeat_timeout_s`): a key of a section;
- `ACTOR.FIELD` where FIELD is a field of an `[[actors]]` entry (`generator.memory_mb`,
  `learner.cpus`, `learner.start_timeout_s`): that entry's field;
- `ACTOR.OPTION[.SUB...]` (`orchestrator.num_steps`, `orchestrator.sampling.max_new_tokens`): one of
  the actor's options; an option table named like its actor may be skipped, so `learner.rl_lr` is
  `learner.learner.rl_lr`, the learner actor's LearnerConfig.

VALUE is TOML (`3`, `1e-4`, `"gspo"`, `true`, `[1, 2]`, `{ rank = 8 }`); text that is not TOML is
taken as a string, so `shared.model=models/Qwen3-0.6B` needs no quotes. The document is then
checked as the file is: a misspelt option or a bad value is the config's usual error.
"""
from __future__ import annotations

import tomllib

from postrain.core.config import ActorSpec
from postrain.core.errors import PostrainError

# Fields of an [[actors]] entry that `ACTOR.FIELD` sets (the rest are not a user's to change).
SPEC_FIELDS = frozenset(ActorSpec.model_fields) - {"name", "cls", "options", "rendezvous"}


class OverrideError(PostrainError, ValueError):
    """A `--set` that names nothing in the config or is not KEY=VALUE."""


def toml_value(text: str):
    """`text` read as a TOML value; text that is not one, as a string (stripped)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text.strip()


def parse_override(item: str) -> tuple[str, object]:
    """'orchestrator.num_steps=3' -> ('orchestrator.num_steps', 3); OverrideError naming the form."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise OverrideError(f"--set {item!r}: write KEY=VALUE, e.g. orchestrator.num_steps=3")
    return key.strip(), toml_value(value)


def set_path(doc: dict, key: str, value) -> str:
    """Set the dotted `key` in a parsed run config (module docstring's rule) and say what it set:
    "section" (a section's key), "actor" (an [[actors]] entry's field) or "option" (an actor's
    option). OverrideError when its first part names neither a section nor an actor."""
    head, *rest = key.split(".")
    actors = {a.get("name"): a for a in doc.get("actors", [])}
    if head in actors and len(rest) == 1 and rest[0] in SPEC_FIELDS:
        actors[head][rest[0]] = value
        return "actor"
    if head in actors and rest:
        target, kind = actors[head].setdefault("options", {}), "option"
        if len(rest) == 1 and rest[0] not in target and isinstance(target.get(head), dict):
            target = target[head]
    elif head != "actors" and rest and isinstance(doc.get(head, {}), dict):
        target, kind = doc.setdefault(head, {}), "section"
    else:
        raise OverrideError(f"--set {key}: {head!r} is neither a section of the config "
                            f"({sorted(k for k in doc if k != 'actors')}) nor an actor's name ({sorted(actors)}); "
                            "write SECTION.KEY, ACTOR.FIELD or ACTOR.OPTION")
    for part in rest[:-1]:
        target = target.setdefault(part, {})
    target[rest[-1]] = value
    return kind
