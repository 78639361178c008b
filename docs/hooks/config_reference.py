"""MkDocs hook: renders reference pages from the code's own models at build time.

A page holds a marker; this hook replaces it with tables generated from the classes, so the
page follows the code and cannot drift from it:

The generated text is committed too, between the marker and its closing twin
(`<!-- /config-reference -->`), so the page reads whole in the repository; the site build
renders it again, and tests/test_docs.py fails when the committed text differs from the
code's. After changing an option or a record: `python docs/hooks/config_reference.py`
rewrites both pages.

`<!-- config-reference -->` (docs/config-reference.md): one table per pydantic model (field,
type, default, description):
- the kernel's sections, `postrain.core.config`: `[run]` (RunSection), `[head]`
  (HeadSection), `[[actors]]` (ActorSpec), `[cluster]` (ClusterSection), and what `[shared]` means;
- the head's own sections, `postrain.actors.configs.run_config` (the config `postrain up` reads):
  `[balancer]` (BalancerSection) and `[tracking]` (TrackingSection);
- each role's options: the model `postrain.core.options.options_class` finds on the role's
  actor class (ROLES below), with every nested model it uses as a table of its own, and the
  dataclass behind an options table that is a plain dict (EXPANDED_TABLES);
- each built-in task's options model (`task_options`).

`<!-- records-reference -->` (docs/records.md): every typed record of
`postrain.actors.records`, the messages that cross between roles.

Dataclass fields carry no description object, so their description is the comment that
follows the field on its line in the source (`name: int = 0   # what it is`), continued by the
comment-only lines below it whose `#` stands in the same column.

A class that fails to import fails the build (an error, so `mkdocs build --strict` and
tests/test_docs.py catch it): a reference that silently leaves a part out is the drift these
pages exist to prevent. Named in mkdocs.yml under `hooks:`.
"""
from __future__ import annotations

import dataclasses
import enum
import inspect
import logging
import re
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

log = logging.getLogger("mkdocs.hooks.config_reference")

CONFIG_MARKER = "<!-- config-reference -->"
RECORDS_MARKER = "<!-- records-reference -->"

# (title, import path of the actor class): the roles whose options the page lists.
ROLES = [
    ("Generator", "postrain.actors.generator:GeneratorActor"),
    ("Learner", "postrain.actors.learner:LearnerActor"),
    ("Environment", "postrain.actors.env:EnvironmentActor"),
    ("Sandbox", "postrain.actors.sandbox:SandboxActor"),
    ("Orchestrator", "postrain.actors.orchestrator:OrchestratorActor"),
    ("Gateway", "postrain.actors.gateway:GatewayActor"),
    ("Scorer", "postrain.actors.scorer:ScorerActor"),
    ("Tinker", "postrain.actors.tinker:TinkerActor"),
]

# An option that is a plain dict validated by a dataclass elsewhere: (role path, field) ->
# the dataclass whose fields it takes. Rendered only while the field is still a plain dict.
EXPANDED_TABLES = {
    ("postrain.actors.learner:LearnerActor", "learner"): "postrain.actors.learner:LearnerConfig",
}

# The `[shared]` names the roles use (a convention of the roles; the kernel accepts any name
# some actor declares). Fields of these names are marked *shared* in the roles' tables.
SHARED_NAMES = ("model", "task", "task_options", "seed")

RECORDS_MODULE = "postrain.actors.records"


class ConfigReferenceError(RuntimeError):
    """A reference page could not be rendered (a class failed to import)."""


# (page, marker, renderer name): the pages this hook fills, each between marker and closing twin.
PAGES = [("docs/config-reference.md", CONFIG_MARKER, "render_config_reference"),
         ("docs/records.md", RECORDS_MARKER, "render_records_reference")]


def on_page_markdown(markdown: str, page, config, files) -> str:
    return refreshed(markdown)


def refreshed(markdown: str) -> str:
    """`markdown` with each marker's block (marker .. closing twin) rendered from the code now."""
    for _, marker, renderer in PAGES:
        if marker in markdown:
            closing = closing_marker(marker)
            start = markdown.index(marker) + len(marker)
            end = markdown.index(closing, start) if closing in markdown else start
            block = "\n" + globals()[renderer]().strip("\n") + "\n"
            markdown = markdown[:start] + block + (markdown[end:] if closing in markdown else closing + "\n" + markdown[end:])
    return markdown


def closing_marker(marker: str) -> str:
    return marker.replace("<!-- ", "<!-- /")


# ---------------------------------------------------------------------------- the config page
def render_config_reference() -> str:
    """The generated part of the config reference, as Markdown."""
    from postrain.actors.configs.run_config import BalancerSection, TrackingSection
    from postrain.core.config import ActorSpec, ClusterSection, HeadSection, RunConfig, RunSection

    out: list[str] = []
    out += _model_section("`[run]`", RunSection)
    out += _model_section("`[head]`", HeadSection)
    out += _shared_section(RunConfig)
    out += _model_section("`[[actors]]`", ActorSpec)
    out += _model_section("`[cluster]`", ClusterSection)
    out += _model_section("`[balancer]`", BalancerSection)
    out += _model_section("`[tracking]`", TrackingSection)
    out += ["## Actor options", "",
            "Each `[[actors]]` entry's `options` table is validated by the model its class declares "
            "(`Options = ...` on the class; `postrain.core.options.options_class`). Unknown fields are "
            "errors; `postrain up --dry-run` names every bad field of every actor before a process starts. "
            "A field marked *shared* may instead be stated once in `[shared]`.", ""]
    for title, path in ROLES:
        out += _role_section(title, path)
    out += _task_options_section()
    return "\n".join(out)


def _model_section(title: str, model: type, level: int = 2) -> list[str]:
    lines = [f"{'#' * level} {title}", "", f"Model: `{_qualname(model)}`.", ""]
    doc = _doc(model)
    if doc:
        lines += [doc, ""]
    return lines + _tables(model)


def _shared_section(run_config: type[BaseModel]) -> list[str]:
    field = run_config.model_fields["shared"]
    return ["## `[shared]`", "",
            f"{field.description}.", "",
            "Any key may appear, but each must be a field of at least one actor's options "
            "(else the config is refused, naming it), and an actor may not set a shared field again "
            "in its own `options`. The shared names in use are `model`, `task`, `task_options` and "
            "`seed`; the roles' tables below mark the fields a `[shared]` value fills in.", "",
            "```toml", "[shared]", 'model = "tiny"', 'task = "arithmetic"',
            "task_options = { max_digits = 2, max_operands = 2 }", "seed = 0", "```", ""]


def _role_section(title: str, path: str) -> list[str]:
    from postrain.core.options import NoOptions, options_class
    cls = _import(path)
    model = options_class(cls)
    lines = [f"### {title}: `{path}`", ""]
    if model is NoOptions:
        return lines + ["This role declares no options: any option given is an error.", ""]
    lines += [f"Model: `{_qualname(model)}`.", ""]
    doc = _doc(model)
    if doc:
        lines += [doc, ""]
    lines += _tables(model, shared=tuple(name for name in SHARED_NAMES if name not in model.not_shared))
    for (role, name), target in EXPANDED_TABLES.items():
        field = model.model_fields.get(name) if role == path else None
        if field is not None and not _nested_classes(field.annotation):
            expanded = _import(target)
            lines += [f"**`{name}`** (the fields of `{_qualname(expanded)}`)", ""]
            doc = _doc(expanded)
            if doc:
                lines += [doc, ""]
            lines += _table(expanded)
    return lines


def _task_options_section() -> list[str]:
    from postrain.actors.tasks import get_task, list_tasks
    lines = ["## Task options", "",
             "`task_options` (usually in `[shared]`) is one dict that feeds the task's generator "
             "(difficulty knobs) and its environment. A task whose spec has an options model checks it "
             "wherever the task is used; a misspelt option is a `TaskOptionsError` naming it. The "
             "built-in tasks:", ""]
    for name in list_tasks():
        model = getattr(get_task(name), "options_model", None)
        lines += [f"### Task `{name}`", ""]
        if model is None:
            lines += ["Its options are not checked by a model.", ""]
            continue
        lines += [f"Model: `{_qualname(model)}`.", ""] + _tables(model)
    return lines


# --------------------------------------------------------------------------- the records page
def render_records_reference() -> str:
    """Every record class of postrain.actors.records (a package: one module per exchange), module by
    module in the order the package imports them, each in source order, as Markdown."""
    import importlib
    try:
        module = importlib.import_module(RECORDS_MODULE)
    except Exception as exc:
        log.error("records reference: cannot import %s: %s", RECORDS_MODULE, exc)
        raise ConfigReferenceError(f"records reference: cannot import {RECORDS_MODULE}: {exc}") from exc
    modules = list(dict.fromkeys(obj.__module__ for obj in vars(module).values() if isinstance(obj, type)
                                 and obj.__module__.startswith(module.__name__)))
    classes = [obj for obj in vars(module).values()
               if isinstance(obj, type) and dataclasses.is_dataclass(obj)
               and obj.__module__.startswith(module.__name__) and not obj.__name__.startswith("_")]
    classes.sort(key=lambda cls: (modules.index(cls.__module__), inspect.getsourcelines(cls)[1]))
    out: list[str] = _first_indented_block(module.__doc__ or "")
    for cls in classes:
        out += [f"## `{cls.__name__}`", ""]
        doc = _doc(cls)
        if doc:
            out += [doc, ""]
        out += _table(cls)
    return "\n".join(out)


def _first_indented_block(doc: str) -> list[str]:
    """The first indented block of a docstring (the module's own diagram), as a code block."""
    block: list[str] = []
    for line in inspect.cleandoc(doc).splitlines():
        if line.startswith("    "):
            block.append(line[4:])
        elif block and line.strip():
            break
    while block and not block[-1].strip():
        block.pop()
    return ["```", *block, "```", ""] if block else []


# ------------------------------------------------------------------------------------ tables
def _tables(model: type, shared: tuple[str, ...] = ()) -> list[str]:
    """The table of `model`, then one per nested model or dataclass it uses (each once)."""
    lines: list[str] = []
    seen: set[type] = set()
    queue: list[tuple[str, type]] = [("", model)]
    while queue:
        prefix, current = queue.pop(0)
        if current in seen:
            continue
        seen.add(current)
        if prefix:
            lines += [f"**`{prefix}`** (`{current.__qualname__}`)", ""]
            doc = _doc(current)
            if doc:
                lines += [doc, ""]
        lines += _table(current, shared if not prefix else ())
        for name, annotation in _annotations(current).items():
            for nested in _nested_classes(annotation):
                queue.append((f"{prefix}.{name}" if prefix else name, nested))
    return lines


def _table(cls: type, shared: tuple[str, ...] = ()) -> list[str]:
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, kind, default, description in _rows(cls):
        if name in shared:
            description = f"*shared*: {description}" if description else "*shared*"
        rows.append(f"| `{name}` | {_code(kind)} | {default} | {_escape(description)} |")
    return rows + [""]


def _rows(cls: type) -> list[tuple[str, str, str, str]]:
    """(name, type, default, description) per field of a pydantic model or a dataclass."""
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        rows = []
        for name, field in cls.model_fields.items():
            rule = _constraints(field)
            kind = _type_name(field.annotation) + (f" ({rule})" if rule else "")
            rows.append((name, kind, _pydantic_default(field), field.description or ""))
        return rows
    comments = _field_comments(cls)
    hints = _annotations(cls)
    rows = []
    for field in dataclasses.fields(cls):
        rows.append((field.name, _type_name(hints.get(field.name, field.type)), _dataclass_default(field),
                     comments.get(field.name, "")))
    return rows


def _annotations(cls: type) -> dict[str, Any]:
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return {name: field.annotation for name, field in cls.model_fields.items()}
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a forward reference the module cannot resolve: show the text
        return {field.name: field.type for field in dataclasses.fields(cls)}


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's trailing `# comment` in the class source (dataclasses keep no descriptions)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments = {}
    last, column = None, -1   # the field whose comment a comment-only line aligned with it continues
    for line in source.splitlines():
        match = re.match(r"^\s+(\w+)\s*:[^#]*#\s*(.+)$", line)
        if match and match.group(1) not in comments:
            comments[match.group(1)] = match.group(2).strip()
            last, column = match.group(1), line.index("#", match.end(1))
            continue
        more = re.match(r"^(\s+)#\s*(.+)$", line)
        if more and last is not None and len(more.group(1)) == column:
            comments[last] += " " + more.group(2).strip()
        else:
            last = None
    return comments


def _pydantic_default(field) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
    else:
        value = field.default
    if value is PydanticUndefined:
        return "required"
    return _show_default(value)


def _dataclass_default(field) -> str:
    if field.default is not dataclasses.MISSING:
        return _show_default(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return _show_default(field.default_factory())
    return "required"


def _show_default(value: Any) -> str:
    if isinstance(value, BaseModel) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        return _code(_show_instance(value))
    if isinstance(value, enum.Enum):
        value = value.value
    return _code(repr(value))


def _show_instance(value: Any) -> str:
    """`Name(field=value, ...)` with only the fields that differ from the class's defaults."""
    cls = type(value)
    if isinstance(value, BaseModel):
        fields = {name: (field.get_default(call_default_factory=True) if not field.is_required() else None)
                  for name, field in cls.model_fields.items()}
    else:
        fields = {}
        for field in dataclasses.fields(cls):
            if field.default is not dataclasses.MISSING:
                fields[field.name] = field.default
            elif field.default_factory is not dataclasses.MISSING:
                fields[field.name] = field.default_factory()
            else:
                fields[field.name] = dataclasses.MISSING
    changed = [f"{name}={getattr(value, name)!r}" for name, default in fields.items()
               if getattr(value, name) != default]
    return f"{cls.__name__}({', '.join(changed)})"


def _constraints(field) -> str:
    parts = []
    for meta in field.metadata:
        for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="),
                             ("min_length", "min length"), ("max_length", "max length")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{symbol} {value}")
    return ", ".join(parts)


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    if annotation is None or annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(arg) for arg in args)
    if origin is typing.Literal:
        return " | ".join(repr(arg) for arg in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        shown = ", ".join("..." if arg is Ellipsis else _type_name(arg) for arg in args)
        return f"{name}[{shown}]" if args else name
    if annotation is Any:
        return "Any"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _nested_classes(annotation: Any) -> list[type]:
    """The pydantic models and dataclasses inside an annotation (X, X | None, list[X], ...)."""
    if isinstance(annotation, type) and (issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)):
        return [annotation]
    found: list[type] = []
    for arg in typing.get_args(annotation):
        found += _nested_classes(arg)
    return found


# ----------------------------------------------------------------------------------- helpers
def _import(path: str):
    from postrain.core import import_object
    try:
        return import_object(path)
    except Exception as exc:  # any failure to import a part is a broken reference
        log.error("config reference: cannot import %s: %s", path, exc)
        raise ConfigReferenceError(f"config reference: cannot import {path}: {exc}") from exc


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _doc(cls: type) -> str:
    doc = cls.__dict__.get("__doc__") or ""  # its own docstring, never a base class's
    if not doc or (dataclasses.is_dataclass(cls) and re.match(rf"^{cls.__name__}\(", doc)):
        return ""  # dataclasses without a docstring get their signature as __doc__
    return " ".join(line.strip() for line in inspect.cleandoc(doc).split("\n"))


def _code(text: str) -> str:
    """A code span for a table cell (Python-Markdown's tables keep a `|` inside backticks)."""
    return "`" + text.replace("`", "'") + "`"


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":   # rewrite the committed pages from the code
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    for page, _, _ in PAGES:
        path = root / page
        path.write_text(refreshed(path.read_text()))
        print(f"wrote {page}")
